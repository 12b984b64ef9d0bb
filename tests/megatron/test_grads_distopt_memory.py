"""8-bit gradients (``--agoq-grads int8_b256``, store mode) under ``--use-distributed-optimizer``: the
gradient bytes per parameter per rank that scripts/pretrain_llama.py measures from the live tensors
(``--log-json`` ``memory_breakdown``, agoq/train/memory_report.py) at their real cost, d = 2 ranks.

Bounds (issue 19; docs/numerics.md "Distributed optimizer"): the 8-bit store is 1 + 4/256 B/param plus
per-parameter padding to whole 256-element blocks (< 0.1 here). agoq's optimizer reads its shard from the
store one parameter at a time: <= 1.1 + 1.1/d. Megatron's fp32 optimizer needs every shard gradient in
fp32 at once: <= 1.1 + 4/d. Before the fix the reduced shard lived in an fp32 window over every parameter
the shard touches, next to the store: 3.02 B/param here, 5.02 at d = 1.
Numerics: agoq's AdamW with 8-bit gradients tracks the float-gradient run of the same recipe within
tests/megatron/test_ddp_agoq.py's per-step loss band (0.5 %); Megatron's Adam with 8-bit gradients under
the distributed optimizer is checked the same way in process there (test_dp2_distributed_optimizer_...).
Three launches (~20 s each on 2 CPU ranks).
"""

from __future__ import annotations

import json

import pytest

from agoq.testing.procs import TINY_CONFIG, child_env, iteration_records, run_pretrain

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

D = 2
ITERS = 6
LOSS_BAND_REL = 0.005  # tests/megatron/test_ddp_agoq.py
ARGS = ["--config", str(TINY_CONFIG), "--use-distributed-optimizer", "--train-iters", str(ITERS), "--lr", "1e-2"]
INT8 = ["--agoq-grads", "int8_b256"]
STORE_BYTES = 1 + 4 / 256


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One data cache for the module: the default corpus and tokenizer are built once."""
    return child_env(AGOQ_CACHE=str(tmp_path_factory.mktemp("agoq_cache")))


def _run(env, tmp_path, name: str, extra: list[str]) -> tuple[list[float], dict, str]:
    log = tmp_path / f"{name}.jsonl"
    proc = run_pretrain(D, ARGS + extra + ["--log-json", str(log)], env=env)
    losses = [r["loss"] for r in iteration_records(proc.stdout)]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    memory = [r["memory_breakdown"] for r in records if "memory_breakdown" in r]
    assert len(losses) == ITERS and memory, proc.stdout[-3000:]
    return losses, memory[-1], proc.stdout


def test_agoq_optimizer_reads_the_8bit_shard_without_a_float_window(env, tmp_path):
    base, base_mem, _ = _run(env, tmp_path, "float", ["--agoq-optimizer", "adamw"])
    losses, mem, stdout = _run(env, tmp_path, "int8", ["--agoq-optimizer", "adamw"] + INT8)
    grads = mem["grads_bytes_per_param"]
    assert STORE_BYTES <= grads <= 1.1 + 1.1 / D, \
        f"int8 grads + distributed optimizer + agoq AdamW: {grads:.3f} B/param"
    assert base_mem["grads_bytes_per_param"] >= 2.0  # the float run keeps Megatron's bf16/fp32 buffer
    assert mem["weights_bytes_per_param"] == base_mem["weights_bytes_per_param"]
    assert mem["optimizer_bytes_per_param"] == pytest.approx(base_mem["optimizer_bytes_per_param"], rel=1e-6)
    # the start-up report names what is in use
    assert "agoq AdamW" in stdout and "int8_b256 gradients" in stdout, stdout[:3000]
    assert losses != base, "identical to the float run: the 8-bit path did not run"
    assert losses[-1] < losses[0] - 0.3, losses  # it trains
    for step, (a, b) in enumerate(zip(losses, base, strict=True)):
        assert abs(a - b) <= LOSS_BAND_REL * b, f"step {step}: loss {a:.4f} vs float gradients {b:.4f}"


def test_megatron_optimizer_holds_only_its_fp32_shard(env, tmp_path):
    losses, mem, stdout = _run(env, tmp_path, "torch_int8", INT8)
    grads = mem["grads_bytes_per_param"]
    # 8-bit store + this rank's fp32 shard gradients (Megatron's .grad tensors, counted as gradients)
    assert 1 + 4 / D <= grads <= 1.1 + 4 / D, f"int8 grads + distributed optimizer + Megatron Adam: {grads:.3f}"
    assert "Megatron's Adam" in stdout and "int8_b256 gradients" in stdout, stdout[:3000]
    assert losses[-1] < losses[0] - 0.3, losses


def _reduce_shard_in_place(rank: int, world_size: int) -> dict:
    """Two parameters (600 and 1400 elements) in one bucket of 2000: the shard boundary (element 1000) falls
    inside the second parameter's second 256-block (block 4), which both ranks' block ranges hold. With
    one-block chunks rank 1 reduces block 4 in its first chunk, while rank 0's range reaches it only in its
    fifth, when rank 1 still has to send its own (unreduced) contribution."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from agoq.megatron.grads.grad_store import BucketStore

    params = [torch.nn.Parameter(torch.zeros(600)), torch.nn.Parameter(torch.zeros(1400))]
    bucket = SimpleNamespace(params_list=params, param_to_index={params[0]: (0, 600), params[1]: (600, 2000)},
                             grad_data=torch.zeros(2000))
    for p in params:
        p.main_grad = torch.zeros(p.shape)
    store = BucketStore(bucket, "int8_b256", torch.device("cpu"), error_feedback=False, world=world_size, rank=rank,
                        touched=set(), chunk_bytes=256)
    store.reader_attached = True
    g = torch.Generator().manual_seed(7 + rank)
    local = [torch.randn(p.numel(), generator=g) for p in params]
    for p, x in zip(params, local, strict=True):
        store.accumulate(p, x)
    stored = torch.cat([store.qbuf.dequantize(i) for i in range(2)])  # what this rank sends
    total = [torch.zeros_like(stored) for _ in range(world_size)]
    dist.all_gather(total, stored)
    store.start_reduce_scatter(dist.group.WORLD, average=False, post_scale=1.0, async_op=False)
    store.finish_reduce_scatter()
    lo, hi = 1000 * rank, 1000 * (rank + 1)
    got = torch.cat([store.shard_grad(params[0], lo, min(hi, 600)) if lo < 600 else torch.zeros(0),
                     store.shard_grad(params[1], max(lo, 600) - 600, hi - 600)])
    return {"got": got, "want": sum(total)[lo:hi], "shared": sorted(store.shared_blocks)}


def test_boundary_block_is_requantized_after_every_chunk_sent():
    from agoq.testing.dist import spawn_ranks

    for r, out in enumerate(spawn_ranks(2, _reduce_shard_in_place)):
        assert out["shared"] == [4], "the layout must put block 4 across the shard boundary"
        # requantized sum: int8 absmax rounding, <= half a step of the block's absmax (max |sum| < 8 here)
        err = float((out["got"] - out["want"]).abs().max())
        assert err <= 8 / 127, f"rank {r}: shard differs from the fp32 sum by {err:.4f}"
