"""agoq.comm.reduce without a process group: format checks, wire-byte model, the reduce_scatter_tensor
signature, the device dispatch, and the reference collective on one simulated rank."""

import inspect

import pytest
import torch
import torch.distributed as dist

from agoq.comm.reduce import check_grad_format, make_reduce_scatter, quant_ops_for, reduce_scatter_int8, wire_bytes
from agoq.ref.collectives import ref_allreduce_8bit, ref_reduce_scatter_8bit
from agoq.ref.quant import ref_dequantize, ref_quantize


def test_signature_matches_reduce_scatter_tensor():
    expected = list(inspect.signature(dist.reduce_scatter_tensor).parameters)
    assert list(inspect.signature(reduce_scatter_int8).parameters) == expected
    assert list(inspect.signature(make_reduce_scatter("int4_b64")).parameters) == expected


@pytest.mark.parametrize("name, err", [("bf16", ValueError), ("cuint8_b32", ValueError),
                                       ("int8_b256_sr", NotImplementedError), ("nonsense", ValueError)])
def test_rejects_formats_that_cannot_carry_gradients(name, err):
    with pytest.raises(err):
        check_grad_format(name)


def test_cuda_reduction_refuses_a_format_without_a_fused_kernel():
    """No quiet fallback: on CUDA a gradient format without the fused one-byte kernels is refused with the flag and a
    format that works (checked once, when the DDP is built); the CPU runs the reference for any format."""
    from agoq.comm.pipeline import check_reduction_kernel, comm_ops_for
    from agoq.formats import parse_format

    int4 = parse_format("int4_b128")
    check_reduction_kernel(torch.device("cpu"), int4)
    assert comm_ops_for(torch.device("cpu"), int4)[0].__name__ == "ref_quantize_rows"
    check_reduction_kernel(torch.device("cuda"), parse_format("int8_b256"))  # the fused kernels take it
    with pytest.raises(ValueError, match="int4_b128 has no fused reduction kernel.*--agoq-grads int8_b256"):
        comm_ops_for(torch.device("cuda"), int4)


def test_wire_bytes_int8_b256():
    numel, world = 1 << 20, 4
    row = numel // world  # a multiple of 256: no padding
    assert wire_bytes(numel, world, "int8_b256") == 2 * (world - 1) * (row + row // 256 * 4)
    assert wire_bytes(numel, world, "int8_b256", all_gather=False) == (world - 1) * (row + row // 256 * 4)
    # padding: 1 element per rank still sends a whole block per row
    assert wire_bytes(world, world, "int8_b256", all_gather=False) == (world - 1) * (256 + 4)


def test_cpu_dispatch_is_the_reference():
    assert quant_ops_for(torch.device("cpu")) == (ref_quantize, ref_dequantize)


def test_single_rank_reference_is_a_quantization_round_trip():
    x = torch.randn(1000)
    once = ref_dequantize(ref_quantize(x, "int8_b256"))
    assert torch.equal(ref_reduce_scatter_8bit([x], "int8_b256")[0], once)  # no requantization
    twice = ref_dequantize(ref_quantize(once, "int8_b256"))
    assert torch.equal(ref_allreduce_8bit([x], "int8_b256")[0], twice)


def test_the_stores_all_reduce_takes_the_gather_route_only_where_it_sends_no_more_bytes():
    """At W = 2 one all-gather per chunk sends exactly the all-to-all + all-gather's bytes; above it sends W / 2
    times more (agoq.comm.reduce.GATHER_ROUTE_MAX_WORLD's measurements). Both routes leave the same bits
    (tests/dist/test_comm_reduce.py)."""
    from agoq.comm.reduce import (
        GATHER_ROUTE_MAX_WORLD,
        allreduce_blocks_,
        allreduce_blocks_gather_,
        stored_allreduce_route,
    )

    assert GATHER_ROUTE_MAX_WORLD == 2
    assert [stored_allreduce_route(w) for w in (1, 2, 3, 4, 8)] == [allreduce_blocks_gather_] * 2 + [
        allreduce_blocks_] * 3
