"""Smooth-SwiGLU and the FP8 flags in the real megatron-core model, on CPU.

Smooth-SwiGLU divides the SwiGLU output by a power-of-two scale s and undoes it around fc2 (per
token: fc2's output times s; per channel: fc2's weight columns times s). A power-of-two factor
commutes with every floating-point rounding (it only shifts exponents), so, barring underflow to
subnormals or overflow, each product, partial sum and rounding of the smoothed MLP equals the plain
MLP's shifted by the same power of two, in forward (z = glu / s, fc2(z) * s or z @ (W * s).T) and in
backward (grad_z = grad_y @ W scaled by s, then / s; dW = dW' * s). Our test tensors are O(1e-3..1e2)
in fp32 and bf16 (which has fp32's exponent range), far from both limits, so we require bit
identity of losses and every parameter gradient. Any missing or mismatched rescale (a wrong s, an s
recomputed in backward, a missing TP reduction) breaks the identity.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agoq.testing.procs import TINY_CONFIG, child_env, iteration_records, run_pretrain
from tests.megatron._tiny import TINY_SEQ, TINY_VOCAB, tiny_shape

pytestmark = pytest.mark.megatron

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policy"
SEQ, MICRO_BATCH, VOCAB = TINY_SEQ, 2, TINY_VOCAB


def _build(smooth: str, policy: str | None, dtype, reference=None, tp: int = 1):
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.policy import FP8Spec, ScheduleInfo

    shape = tiny_shape()
    config = llama_transformer_config(shape, ParallelLayout(tp=tp), params_dtype=dtype, use_cpu_initialization=True)
    spec = agoq_layer_spec("sdpa", policy=None if policy is None else POLICIES / f"{policy}.yaml",
                           schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1),
                           compute=FP8Spec(smooth_swiglu=smooth))
    (model,) = build_model_chunks(shape, config, spec, None)
    if dtype == torch.bfloat16:
        model = Float16Module(config, model)
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    return model


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(MICRO_BATCH, -1)


def _train(model, steps=2, lr=1e-2):
    losses, grads = [], []
    for step in range(steps):
        tokens, labels, pos = _batch(step)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses, grads


def _assert_identical(a, b, what):
    (losses_a, grads_a), (losses_b, grads_b) = a, b
    for step, (la, lb) in enumerate(zip(losses_a, losses_b, strict=True)):
        assert torch.equal(la, lb), f"{what}: step {step} loss {la.item()} vs {lb.item()}"
        assert grads_a[step].keys() == grads_b[step].keys()
        for name, grad in grads_a[step].items():
            assert torch.equal(grad, grads_b[step][name]), f"{what}: step {step} {name}"


@pytest.mark.parametrize("mode", ["per-token", "per-channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", [None, "agoq"])
def test_smooth_swiglu_mlp_equals_plain_swiglu(mcore_world1, mode, dtype, policy):
    """Real Megatron MLP, forward + backward over 2 SGD steps, with Megatron's own storage (policy
    None) and with agoq's SwiGLU recompute from an nf4-stored fc1 output (agoq.yaml: the backward
    recomputes SwiGLU and must reuse the forward's s)."""
    plain = _build("off", policy, dtype)
    smooth = _build(mode, policy, dtype, reference=plain)
    assert type(smooth.module if dtype == torch.bfloat16 else smooth).__name__ == "GPTModel"
    mlps = [m for m in smooth.modules() if type(m).__name__ == "AgoqMLP"]
    assert len(mlps) == 2 and all(m.agoq_smooth == mode.replace("-", "_") for m in mlps)
    _assert_identical(_train(plain), _train(smooth), f"{mode} {dtype} policy={policy}")


def test_smooth_swiglu_really_rescales(mcore_world1, monkeypatch):
    """Guard against a vacuous identity: fc2's input in the smoothed model is the SwiGLU output divided
    by a non-trivial scale (per token: its max |up|, rounded up to a power of two)."""
    from agoq.megatron import mlp

    seen = {}
    real = mlp.glu_smooth_scale

    def spy(h, glu, mode, **kw):
        seen["s"] = real(h, glu, mode, **kw)
        return seen["s"]

    monkeypatch.setattr(mlp, "glu_smooth_scale", spy)
    model = _build("per-token", None, torch.float32)
    tokens, labels, pos = _batch(0)
    model(tokens, pos, None, labels=labels)
    s = seen["s"]
    assert s.shape == (SEQ, MICRO_BATCH, 1) and (s != 1).any()
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))  # powers of two


# ------------------------------------------------------------------------------------ TP = 2 ----
def _tp_rank(rank: int, world_size: int) -> dict:
    """One forward/backward of the TP=2 model: plain, per-token, per-channel (same weights)."""
    from megatron.core import parallel_state

    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    handle = install(AgoqConfig(device="cpu"))
    try:
        runtime.init_model_parallel(ParallelLayout(tp=2), seed=1234, device=torch.device("cpu"))
        plain = _build("off", None, torch.float32, tp=2)
        models = {"off": plain, **{m: _build(m, None, torch.float32, reference=plain, tp=2)
                                   for m in ("per-token", "per-channel")}}  # same weights, built before training
        out = {}
        for mode, model in models.items():
            out[mode] = _train(model, steps=1)
            if mode == "per-token":  # the scale must be TP-global: check the two ranks saw the same s
                mlp = next(m for m in model.modules() if type(m).__name__ == "AgoqMLP")
                h, _ = mlp.linear_fc1(torch.randn(SEQ, MICRO_BATCH, 64, generator=torch.Generator().manual_seed(3)))
                from agoq.ops.smooth_swiglu import smooth_scale

                out["s_global"] = smooth_scale(h.detach(), "per_token", tp_group=mlp.tp_group)
                out["s_local"] = smooth_scale(h.detach(), "per_token")
        parallel_state.destroy_model_parallel()
        return out
    finally:
        handle.uninstall()


@pytest.mark.dist
def test_tp2_smooth_swiglu_equals_plain_through_the_real_model():
    """TP=2 (gloo, 2 ranks): each rank holds half of the FFN channels. Per-token Smooth-SwiGLU must
    all-reduce (MAX) its scale before fc2's row-parallel reduction, per-channel needs none; both
    must equal the plain TP=2 model bit for bit on every rank's parameter shards."""
    from agoq.testing.dist import spawn_ranks

    per_rank = spawn_ranks(2, _tp_rank)
    for rank, result in enumerate(per_rank):
        for mode in ("per-token", "per-channel"):
            _assert_identical(result["off"], result[mode], f"rank {rank} {mode}")
    assert torch.equal(per_rank[0]["s_global"], per_rank[1]["s_global"])
    # the local maxima really differ between the shards, so the reduction is doing work
    assert not torch.equal(per_rank[0]["s_local"], per_rank[1]["s_local"])


# ------------------------------------------------------------------- the script, flags, errors ----
@pytest.fixture(scope="session")
def env(agoq_cache):
    return child_env(AGOQ_CACHE=str(agoq_cache))


@pytest.mark.dist
def test_pretrain_with_smooth_swiglu_per_channel_loss_falls(env):
    args = ["--config", str(TINY_CONFIG), "--pipeline-model-parallel-size", "2", "--train-iters", "20", "--lr",
            "1e-2", "--agoq-smooth-swiglu", "per-channel"]
    proc = run_pretrain(2, args, env=env)
    losses = [r["loss"] for r in iteration_records(proc.stdout)]
    assert len(losses) == 20, proc.stdout[-3000:]
    assert losses[-1] < losses[0] - 1.0, losses  # same bar as the plain PP=2 run (test_pretrain_script.py)
    assert "fp8: off (bf16 linears) | smooth-swiglu: per-channel" in proc.stdout


@pytest.mark.dist
def test_pretrain_fp8_on_cpu_stops_with_the_flag_named(env):
    args = ["--config", str(TINY_CONFIG), "--train-iters", "4", "--agoq-fp8", "delayed"]
    proc = run_pretrain(2, args, env=env, check=False)
    assert proc.returncode != 0
    needs_gpu = "pretrain_llama.py: error: --agoq-fp8 delayed (or the policy's fp8.recipe) needs an NVIDIA GPU"
    assert needs_gpu in proc.stderr
    assert "this run is on the cpu" in proc.stderr and iteration_records(proc.stdout) == []


def test_fp8_layers_raise_on_cpu_at_the_op(mcore_world1):
    """A model built with FP8 linears directly through the API (no script check) fails on the first
    forward with the op's error, never silently in bf16."""
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.policy import FP8Spec

    shape = tiny_shape(num_layers=3)
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.bfloat16,
                                      use_cpu_initialization=True)
    spec = agoq_layer_spec("sdpa", compute=FP8Spec(recipe="delayed"))
    (model,) = build_model_chunks(shape, config, spec, None)
    plan = spec.params["agoq_plan"]  # the model's rows, resolved before Megatron built the layers
    assert plan.fp8_layers == {0: False, 1: True, 2: False}  # first and last layers stay bf16 by rule
    layer1 = model.decoder.layers[1]
    assert layer1.mlp.linear_fc2.agoq_fp8.scaling == "delayed"
    assert model.decoder.layers[0].mlp.linear_fc1.agoq_fp8 is None
    assert model.output_layer.__class__.__name__ == "ColumnParallelLinear"  # the LM head is Megatron's, bf16
    tokens, labels, pos = _batch(0)
    with pytest.raises(NotImplementedError, match="sm_89"):
        model.bfloat16()(tokens, pos, None, labels=labels)


@pytest.mark.dist
def test_bench_fp8_whole_step_harness_smoke(tmp_path, env):
    """benchmarks/bench_fp8.py part (b) on CPU: the fp8 suite of bench_pretrain in its tiny form (bf16 and
    Smooth-SwiGLU; FP8 needs a GPU), summarised with the loss comparison."""
    import json
    import subprocess
    import sys

    from agoq.testing.procs import REPO_ROOT

    out = tmp_path / "fp8.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_fp8.py"), "--smoke", "--step-smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    step = json.loads(out.read_text())["whole_step"]
    assert set(step["summary"]) == {"bf16", "smooth-swiglu per-token"} and not step["failed"]
    assert len(step["losses"]["bf16"]) == 4
    # Smooth-SwiGLU is function-preserving: the same losses as bf16 (bit for bit; see the module docstring)
    assert step["losses"]["smooth-swiglu per-token"] == step["losses"]["bf16"]
    assert step["summary"]["smooth-swiglu per-token"]["loss_max_abs_diff_vs_bf16"] == 0.0
