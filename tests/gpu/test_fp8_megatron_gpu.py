"""GPU: agoq's FP8 linears inside the real megatron-core model (one GPU, TP=PP=1), forward + backward
against the same model in bf16. Needs an sm_89+ GPU and megatron-core 0.19.2 (tests/README.md).
Run: ``pytest tests/gpu -m gpu``.

Error bound (per-parameter gradient SQNR vs the bf16 model, same weights, same batch). Every FP8 GEMM
adds independent quantization noise: forward E4M3 x E4M3 (round-trip floors 28 dB each, combined in
power 25 dB, less 1 dB margin: 24 dB), backward E5M2 x E4M3 (22 and 28 dB: 21 dB, less 1: 20 dB); see
agoq/testing/numerics.py FP8_FLOORS_DB. The longest chain reaching a parameter of the first layer in
this 2-layer model is 8 forward GEMMs (both layers' qkv, proj, fc1, fc2) and 5 backward GEMMs (the
second layer's four dgrads and the parameter's own wgrad). Relative noise powers add:
8 x 10**-2.4 + 5 x 10**-2.0 = 0.070 -> 11.5 dB; we allow 3 dB more for non-Gaussian activations
(SwiGLU outputs, softmax-weighted sums): floor 8.5 dB. A wiring error (a wrong scale, transpose or
layout) gives <= 0 dB; identical gradients (FP8 not applied) are rejected separately.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu._world import gpu_megatron_world, gpu_model

pytestmark = [pytest.mark.gpu]

GRAD_FLOOR_DB = 8.5  # module docstring
# the FP8 linears' weight caches (agoq/megatron/layers.py): each linear's own, and fc2's inside the fused
# SwiGLU -> FP8 fc2 op (plain SwiGLU under delayed scaling, and Smooth-SwiGLU)
WEIGHT_CACHE_ATTRS = ("_agoq_fp8_wcache", "_agoq_fp8_smooth_wcache")
SEQ, MICRO_BATCH, VOCAB = 128, 2, 256
SHAPE_KW = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                seq_length=SEQ, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def gpu_world():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("needs an FP8-capable GPU (sm_89+)")
    yield from gpu_megatron_world()


def _build(device, recipe="off", smooth="off", policy=None, reference=None):
    from agoq.policy import FP8Spec

    compute = FP8Spec(recipe=recipe, smooth_swiglu=smooth, bf16_first_layers=0, bf16_last_layers=0)
    model, _ = gpu_model(device, SHAPE_KW, policy=policy, compute=compute, reference=reference)
    return model


def _step(model, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g).to(device)
    pos = torch.arange(SEQ, device=device).expand(MICRO_BATCH, -1)
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _sqnr_db(ref, got):
    noise = (ref - got).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
@pytest.mark.parametrize("smooth,policy", [("off", None), ("per-token", None), ("per-channel", "agoq")])
def test_fp8_model_forward_backward_vs_bf16(gpu_world, recipe, smooth, policy):
    device = gpu_world
    ref_model = _build(device, policy=policy)
    model = _build(device, recipe=recipe, smooth=smooth, policy=policy, reference=ref_model)
    fp8_linears = [m for m in model.modules() if getattr(m, "agoq_fp8", None) is not None]
    assert len(fp8_linears) == 8  # 2 layers x (qkv, proj, fc1, fc2): no bf16 layer by rule here
    loss_ref, grads_ref = _step(ref_model, device)
    for _ in range(3):  # delayed scaling: step 0 bootstraps, later steps use the history
        loss, grads = _step(model, device)
    assert abs(loss - loss_ref) <= 1e-2 * abs(loss_ref), (loss, loss_ref)
    report = {name: _sqnr_db(g, grads[name]) for name, g in grads_ref.items()}
    worst = min(report, key=report.get)
    assert report[worst] >= GRAD_FLOOR_DB, (worst, report[worst])
    layer_params = [v for n, v in report.items() if "decoder.layers" in n and "linear" in n]
    assert layer_params and all(not math.isinf(v) for v in layer_params)  # FP8 really changed the gradients


def test_fp8_delayed_state_lives_outside_the_state_dict(gpu_world):
    model = _build(gpu_world, recipe="delayed")
    keys_before = set(model.state_dict())
    _step(model, gpu_world)
    states = [m.__dict__["_agoq_fp8_state"] for m in model.modules() if "_agoq_fp8_state" in m.__dict__]
    assert len(states) == 8 and all(s.num_updates["x"] == 1 and s.num_updates["g"] == 1 for s in states)
    assert set(model.state_dict()) == keys_before  # checkpoints unchanged (histories restart on resume)


@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
@pytest.mark.parametrize("smooth,policy", [("off", None), ("per-channel", "agoq")])
def test_weight_cache_bytes_equal_the_planner(gpu_world, recipe, smooth, policy):
    """The memory the FP8 weight caches hold after a step (freed when they are cleared) is the planner's
    agoq.plan.fp8.weight_cache_bytes per FP8 layer; per-tensor scale metas (a few floats each, one 512-byte
    allocator block at most) are not charged."""
    from agoq.plan import fp8 as plan_fp8
    from agoq.plan.shape import ModelShape
    from agoq.policy import FP8Spec

    model = _build(gpu_world, recipe=recipe, smooth=smooth, policy=policy)
    _step(model, gpu_world)
    caches = [m.__dict__[key] for m in model.modules() for key in WEIGHT_CACHE_ATTRS if key in m.__dict__]
    live = [c for c in caches if c._entry is not None]
    spec = FP8Spec(recipe=recipe, smooth_swiglu=smooth, bf16_first_layers=0, bf16_last_layers=0)
    shape = ModelShape(*(SHAPE_KW[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                               "num_query_groups", "ffn_hidden_size", "vocab_size")))
    assert len(live) == SHAPE_KW["num_layers"] * len(plan_fp8.cached_linears(spec))
    predicted = SHAPE_KW["num_layers"] * plan_fp8.weight_cache_bytes(spec, shape)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for cache in caches:
        cache.clear()
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    scale_blocks = 0 if recipe == "rowwise" else 512 * len(live)
    assert predicted <= freed <= predicted + scale_blocks, (freed, predicted)
