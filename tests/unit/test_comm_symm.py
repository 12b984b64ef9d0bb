"""agoq.comm.symm (the NVLink peer-memory transport) refuses what it cannot do, by name, before touching a
process group: CPU tensors, formats without a fused kernel, unsupported ops. Its results are checked on GPUs
(tests/kernels/test_comm_kernels.py for the peer kernels; benchmarks/bench_allreduce.py checks the transport bit
for bit against the NCCL one on every size)."""

import pytest
import torch
import torch.distributed as dist

from agoq.comm import symm


def test_cpu_tensors_are_refused_with_the_alternative():
    with pytest.raises(ValueError, match="runs on CUDA tensors.*allreduce_8bit"):
        symm.allreduce_8bit_peer(torch.zeros(512), fmt="int8_b256")
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        symm.reduce_scatter_8bit_peer(torch.zeros(256), torch.zeros(512), fmt="int8_b256")


@pytest.mark.parametrize("fmt, match", [("int4_b64", "no fused kernel"), ("bf16", "unquantized"),
                                        ("int8_b256_sr", "stochastic")])
def test_formats_without_a_peer_kernel_are_refused(fmt, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        symm.PeerReducer(None, fmt, torch.device("cuda", 0))


def test_max_product_is_refused():
    with pytest.raises(ValueError, match="SUM and ReduceOp.AVG"):
        symm.allreduce_8bit_peer(torch.zeros(512), dist.ReduceOp.MAX, fmt="int8_b256")


def test_symmetric_store_refuses_cpu_formats_and_uneven_blocks():
    from agoq.comm.symm_store import SymmetricBlocks

    with pytest.raises(ValueError, match="no fused kernel.*--agoq-grad-transport nccl"):
        SymmetricBlocks(None, "int4_b64", 4, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        SymmetricBlocks(None, "int8_b256", 4, torch.device("cpu"))


def test_peer_transport_problems_on_cpu_name_the_flag():
    """On CPU (gloo) auto picks nccl and says why; peer stops with the flag and the fix. No process group is
    touched (the local checks fail first), so a plain object stands in for the group."""
    from agoq.formats import parse_format
    from agoq.megatron.grads.grad_transport import resolve_transport

    INT8 = parse_format("int8_b256")  # noqa: N806

    class _Group:  # dist.get_world_size(group) is the only call before the device check
        pass

    import unittest.mock as mock

    with mock.patch.object(dist, "get_world_size", return_value=2):
        transport, why = resolve_transport("auto", _Group(), torch.device("cpu"), INT8)
        assert transport == "nccl" and "cpu" in why and why.startswith("auto")
        with pytest.raises(ValueError, match="--agoq-grad-transport peer: the gradients are on cpu.*nccl"):
            resolve_transport("peer", _Group(), torch.device("cpu"), INT8)
    assert resolve_transport("nccl", None, torch.device("cpu"), INT8)[0] == "nccl"


def test_transport_choices_are_checked_where_the_flag_lands():
    from agoq.config.sections import GradsConfig
    from agoq.config.values import GRAD_TRANSPORTS
    from agoq.megatron.grads import ddp

    assert ddp.GRAD_TRANSPORTS == GRAD_TRANSPORTS
    with pytest.raises(ValueError, match="--agoq-grad-transport 'nvlink': choose one of"):
        GradsConfig(format="int8_b256", transport="nvlink")
    assert GradsConfig(format="int8_b256", transport="peer").transport == "peer"


def test_split_segments_cuts_a_range_at_its_float_spans():
    """reduce_to_owners' plan (agoq.comm.symm_store.split_segments): fp32 runs where a span covers the range,
    in-place runs between, spans clipped to the range, empty runs left out, unsorted spans refused."""
    from agoq.comm.symm_store import split_segments

    assert split_segments(10, 20, []) == [(10, 20, False)]
    assert split_segments(10, 20, [(10, 11), (19, 20)]) == [(10, 11, True), (11, 19, False), (19, 20, True)]
    assert split_segments(10, 20, [(0, 12), (15, 16), (16, 17), (25, 30)]) == [
        (10, 12, True), (12, 15, False), (15, 16, True), (16, 17, True), (17, 20, False)]
    assert split_segments(10, 20, [(0, 30)]) == [(10, 20, True)]
    assert split_segments(5, 5, [(5, 6)]) == []
    with pytest.raises(ValueError, match="sorted, disjoint"):
        split_segments(0, 10, [(5, 6), (2, 3)])
    with pytest.raises(ValueError, match="sorted, disjoint"):
        split_segments(0, 10, [(6, 5)])


class _FakeSymmMem:
    """The two torch.distributed._symmetric_memory functions enable_group looks at, recording the calls."""

    def __init__(self, deprecated: bool, enabled: set[str]):
        self.calls, self.enabled = [], set(enabled)

        def enable_symm_mem_for_group(name):
            self.calls.append(name)
            self.enabled.add(name)

        if deprecated:  # what typing_extensions.deprecated (torch 2.11's decorator) leaves on the function
            enable_symm_mem_for_group.__deprecated__ = "no need to call this function anymore"
        self.enable_symm_mem_for_group = enable_symm_mem_for_group
        self.is_symm_mem_enabled_for_group = lambda name: name in self.enabled


@pytest.mark.parametrize("deprecated, enabled, expected", [(False, set(), ["g"]), (False, {"g"}, []),
                                                           (True, set(), [])])
def test_enable_group_registers_a_group_only_where_torch_still_needs_it(deprecated, enabled, expected):
    fake = _FakeSymmMem(deprecated, enabled)
    symm.enable_group(fake, "g")
    symm.enable_group(fake, "g")  # the second store of a group: never twice
    assert fake.calls == expected
