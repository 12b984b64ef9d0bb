"""--agoq-grads store mode builds Megatron's DDP without its float gradient buffer (issue 19 item 1: "no
full-size float buffer, no transient larger than one bucket"; agoq/megatron/grads/deferred_grad_buffer.py).

Measured from torch's CPU allocator events (agoq.testing.memory) on 2 gloo ranks, tiny LLaMA with 16 narrow
layers and ~20k-element buckets (8 buckets), overlap_grad_reduce on:
  * construction allocates at most the distributed optimizer's parameter buffer + the 8-bit store + one
    bucket's fp32 bytes (slack for small tensors), and no single allocation of the full fp32 buffer's size
    (bf16 parameters under the distributed optimizer, so the parameter buffer is half that size); Megatron's
    own DDP, measured the same way, does allocate it (the measurement can see what it bounds);
  * the placeholders are meta tensors and the memory report counts 0 float bytes;
  * Megatron's-optimizer path (materialize): after the reduction the float buffer is real, every bucket
    and main_grad view lies in it and holds the reduced gradient; zero_grad_buffer puts the meta
    placeholders back, and the next step allocates again;
  * the order check raises when Megatron allocated otherwise.
Training with the deferred buffer: tests/megatron/test_ddp_agoq.py and test_grad_store_memory.py.
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402

from agoq.config import AgoqConfig  # noqa: E402
from agoq.config.sections import GradsConfig  # noqa: E402
from agoq.megatron import runtime  # noqa: E402
from agoq.megatron.grads.ddp import grad_memory_report, wrap_ddp_agoq  # noqa: E402
from agoq.megatron.grads.deferred_grad_buffer import GradBufferOnMeta, check_deferred  # noqa: E402
from agoq.megatron.model import (  # noqa: E402
    ParallelLayout,
    agoq_layer_spec,
    build_model_chunks,
    llama_transformer_config,
)
from agoq.testing.dist import spawn_ranks  # noqa: E402
from agoq.testing.memory import cpu_allocation_peak  # noqa: E402
from tests.megatron._tiny import tiny_shape  # noqa: E402

SHAPE = tiny_shape(num_layers=16, hidden_size=32, ffn_hidden_size=64)
BUCKET = 20000  # elements: ~8 buckets of the ~157k-element buffer
SLACK_BYTES = 64 << 10  # small tensors (scales, bucket bookkeeping), as tests/megatron/test_grad_store_memory.py
MICRO_BATCH = 2


def _build(distopt: bool, dtype: torch.dtype, grad):
    layout = ParallelLayout(tp=1, pp=1)
    runtime.init_model_parallel(layout, seed=1234, device=torch.device("cpu"))
    config = llama_transformer_config(SHAPE, layout, params_dtype=dtype, use_cpu_initialization=True)
    chunks = build_model_chunks(SHAPE, config, agoq_layer_spec("sdpa"), None)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                            use_distributed_optimizer=distopt, bucket_size=BUCKET)
    with cpu_allocation_peak() as peak:
        (model,) = wrap_ddp_agoq(chunks, config, ddp_cfg, torch.device("cpu"), grad)
    buffers = model.buffers + model.expert_parallel_buffers
    out = dict(peak=peak.bytes, largest=peak.largest, numel=sum(b.numel for b in buffers),
               bucket=max(bk.grad_data.numel() for b in buffers for bk in b.buckets),
               buckets=sum(len(b.buckets) for b in buffers),
               param_buffer=sum(b.param_data.nbytes for b in buffers if b.param_data is not None),
               meta=all(b.grad_data.is_meta for b in buffers)
               and all(p.main_grad.is_meta for b in buffers for p in b.params),
               report=grad_memory_report([model]))
    return model, out


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * rank + step)
    pos = torch.arange(SHAPE.seq_length + 1)
    seq = (torch.randint(0, SHAPE.vocab_size, (MICRO_BATCH, 1), generator=g) + 3 * pos) % SHAPE.vocab_size
    return seq[:, :-1], pos[:-1].expand(MICRO_BATCH, -1), seq[:, 1:]


def _materialize_steps(rank: int, model) -> list[dict]:
    """Two steps of Megatron's-optimizer read path (no reader attached: finish_grad_sync materialises)."""
    out = []
    for step in range(2):
        model.zero_grad_buffer()
        tokens, pos, labels = _batch(rank, step)
        model(tokens, pos, None, labels=labels).float().mean().backward()
        model.finish_grad_sync()
        buffers = model.buffers
        ptrs = [(b.grad_data.data_ptr(), b.grad_data.data_ptr() + b.grad_data.nbytes) for b in buffers]

        def inside(t, ptrs=ptrs):
            return any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ptrs)

        params = [p for b in buffers for p in b.params]
        out.append(dict(
            real=not any(b.grad_data.is_meta for b in buffers),
            views_inside=all(inside(bk.grad_data) for b in buffers for bk in b.buckets)
            and all(inside(p.main_grad) for p in params),
            values=all(torch.equal(p.main_grad, model.agoq_grad_of(p)) for p in params),
            nonzero=any(bool(p.main_grad.ne(0).any()) for p in params),
            float_bytes=grad_memory_report([model])["grad_float_bytes"],
        ))
    model.zero_grad_buffer()
    out.append(dict(meta_again=all(b.grad_data.is_meta for b in model.buffers)
                    and all(p.main_grad.is_meta for b in model.buffers for p in b.params),
                    float_bytes=grad_memory_report([model])["grad_float_bytes"]))
    return out


def _rank(rank: int, world_size: int) -> dict:
    from agoq.megatron.install import install

    handle = install(AgoqConfig(device="cpu"))
    try:
        res = {}
        for name, distopt, dtype, grad in [
            ("megatron_distopt_bf16", True, torch.bfloat16, None),
            ("store_distopt_bf16", True, torch.bfloat16, GradsConfig(format="int8_b256", transport="nccl")),
            ("store_fp32", False, torch.float32, GradsConfig(format="int8_b256", transport="nccl")),
        ]:
            model, res[name] = _build(distopt, dtype, grad)
            if name == "store_fp32":
                res["materialize"] = _materialize_steps(rank, model)
            parallel_state.destroy_model_parallel()
        return res
    finally:
        handle.uninstall()


@pytest.fixture(scope="module")
def measured():
    return spawn_ranks(2, _rank)


def test_megatron_allocates_the_full_float_buffer_at_construction(measured):
    """The reference: what the bounds below exclude is visible to the measurement."""
    for r in measured:
        m = r["megatron_distopt_bf16"]
        assert not m["meta"]
        assert m["largest"] >= 4 * m["numel"]
        assert m["peak"] >= m["param_buffer"] + 4 * m["numel"]


@pytest.mark.parametrize("name", ["store_distopt_bf16", "store_fp32"])
def test_store_mode_construction_holds_no_float_buffer(measured, name):
    for rank, r in enumerate(measured):
        s = r[name]
        assert s["buckets"] >= 4, s["buckets"]  # one bucket is a small part of the buffer
        quant = s["report"]["grad_quant_bytes"]
        bound = s["param_buffer"] + quant + 4 * s["bucket"] + SLACK_BYTES
        assert bound < s["param_buffer"] + 4 * s["numel"]  # the bound tells the full buffer apart
        assert s["peak"] <= bound, (rank, name, s["peak"], bound)
        assert s["largest"] < 4 * s["numel"], (rank, name, s["largest"])
        assert s["meta"]
        assert s["report"]["grad_float_bytes"] == 0


def test_materialize_allocates_views_and_release_restores_placeholders(measured):
    for r in measured:
        first, second, released = r["materialize"]
        numel = r["store_fp32"]["numel"]
        for step in (first, second):
            assert step["real"] and step["views_inside"] and step["values"] and step["nonzero"], step
            assert step["float_bytes"] == 4 * numel
        assert released["meta_again"] and released["float_bytes"] == 0


def test_order_check_raises_when_megatron_allocated_otherwise():
    mode = GradBufferOnMeta(distributed_optimizer=True)
    real = types.SimpleNamespace(grad_data=torch.zeros(8), param_data=None, params=[])
    with pytest.raises(RuntimeError, match="did not allocate as agoq expects"):
        check_deferred([real], mode)
    with mode:  # param buffer first (kept), gradient buffer second (meta), as megatron-core 0.19.2
        param_data = torch.zeros(8, dtype=torch.bfloat16, requires_grad=False)
        grad_data = torch.zeros(8, dtype=torch.float32, requires_grad=False)
        other = torch.zeros(8)
    assert not param_data.is_meta and grad_data.is_meta and not other.is_meta
    check_deferred([types.SimpleNamespace(grad_data=grad_data, param_data=param_data, params=[])], mode)
