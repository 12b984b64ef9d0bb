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
