"""The fused Smooth-SwiGLU + FP8 fc2 path (agoq.ops.smooth_swiglu_fp8) inside the real megatron-core model, on CPU.

FP8 linears need an sm_89+ GPU for speed, but their math runs on CPU too (agoq.ref casts, CPU
``torch._scaled_mm``); this test lifts the device check (monkeypatched ``check_fp8_device``) to compare, in one
model, the fused path (the default) with the unfused one (``SavePaths(fuse_smooth_fp8=False)``): the AgoqMLP ->
fc2 hand-off, fc2 fed the fc1 output, Megatron's row-parallel all-reduce and bias, activation storage.

Equal bit for bit: the loss (the forward is the same codes and scales) and, with the fc1 output kept in
bf16, the last layer's fc2 weight gradient (the same output gradient and z codes; with activation storage
both paths rebuild z from the dequantized h, the unfused one on CPU with Megatron's two bf16 roundings, the
fused one in fp32 with one, as agoq's CUDA recompute kernels do). Every other gradient passes through the
SwiGLU backward, which the fused op computes in fp32 with one rounding where the unfused autograd rounds after
each bf16 op (tests/unit/test_smooth_swiglu_fp8.py): a relative perturbation of about 2**-7, which flips an
E5M2 code of the next FP8 gradient cast (2 mantissa bits: steps of 2**-2) with probability ~2**-5, each flip
an error of ~2**-2: noise power ~2**-5 * 2**-4 = 2**-9 per cast (27 dB), about two such casts on the longest
chain of this 2-layer model: ~24 dB (measured 22.5-23.5 dB). Floor: 15 dB; a wiring error (a wrong scale,
a missing un-smoothing, the TP / bias path) is ~0 dB.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.megatron._tiny import TINY_SEQ, TINY_VOCAB, tiny_shape

pytestmark = pytest.mark.megatron

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policy"
MICRO_BATCH = 2
GRAD_FLOOR_DB = 15.0  # module docstring


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    import torch

    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch has no CPU torch._scaled_mm ({exc})")
    from agoq.ops import fp8_linear

    monkeypatch.setattr(fp8_linear, "check_fp8_device", lambda *a, **k: None)


def _build(mode, policy, fused, reference=None):
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.ops.saved_act import SavePaths
    from agoq.policy import FP8Spec, ScheduleInfo

    shape = tiny_shape()
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.bfloat16,
                                      use_cpu_initialization=True)
    compute = FP8Spec(recipe="delayed", smooth_swiglu=mode, bf16_first_layers=0, bf16_last_layers=0)
    spec = agoq_layer_spec("sdpa", policy=None if policy is None else POLICIES / f"{policy}.yaml",
                           schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1), compute=compute,
                           save_paths=SavePaths(fuse_smooth_fp8=fused))
    (model,) = build_model_chunks(shape, config, spec, None)
    model = Float16Module(config, model)
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    return model


def _step(model, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY_VOCAB, (MICRO_BATCH, TINY_SEQ + 1), generator=g)
    pos = torch.arange(TINY_SEQ).expand(MICRO_BATCH, -1)
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _sqnr_db(ref, got):
    noise = (ref - got).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / max(noise, 1e-300))


@pytest.mark.parametrize("mode,policy", [("per-token", "bf16"), ("per-channel", "bf16"), ("per-token", "agoq")])
def test_fused_smooth_fp8_mlp_equals_unfused(mcore_world1, fp8_on_cpu, mode, policy):
    unfused = _build(mode, policy, fused=False)
    fused = _build(mode, policy, fused=True, reference=unfused)
    for step in range(2):  # step 0 bootstraps the delayed histories, step 1 uses them
        loss_u, grads_u = _step(unfused, step)
        loss_f, grads_f = _step(fused, step)
        assert torch.equal(loss_f, loss_u), (step, loss_f.item(), loss_u.item())
        if policy == "bf16":
            last_fc2 = [n for n in grads_u if "layers.1.mlp.linear_fc2.weight" in n]
            assert last_fc2 and all(torch.equal(grads_f[n], grads_u[n]) for n in last_fc2), step
        worst = min(grads_u, key=lambda n: _sqnr_db(grads_u[n], grads_f[n]))
        assert _sqnr_db(grads_u[worst], grads_f[worst]) >= GRAD_FLOOR_DB, (step, worst)
    fc2s = [m for m in fused.modules() if type(m).__name__ == "AgoqRowParallelLinear" and "_agoq_fp8_smooth_wcache"
            in m.__dict__]
    assert len(fc2s) == 2  # both layers' fc2 ran the fused op
    assert not any("_agoq_fp8_smooth_wcache" in m.__dict__ for m in unfused.modules())


def test_fc2_input_amax_reads_the_delayed_history(mcore_world1, fp8_on_cpu):
    """agoq.megatron.compute.fc2_input_amax (the trainer's --log-fc2-amax): per global layer the newest amax of
    fc2's FP8 input, i.e. the smoothed z's max with Smooth-SwiGLU (bounded by |silu(gate)|) and the SwiGLU
    output's without; nothing for a model without FP8."""
    from agoq.megatron.compute import fc2_input_amax

    smooth = _build("per-token", "bf16", fused=True)
    plain = _build("off", "bf16", fused=True, reference=smooth)
    assert fc2_input_amax([smooth]) == {}  # no history before the first forward
    _step(smooth, 0)
    _step(plain, 0)
    got, got_plain = fc2_input_amax([smooth]), fc2_input_amax([plain])
    assert sorted(got) == ["fc2_input_amax/layer_0", "fc2_input_amax/layer_1", "fc2_input_amax_max"]
    fc2s = [m.mlp.linear_fc2 for m in smooth.modules() if hasattr(m, "layer_number") and hasattr(m, "mlp")]
    for i, fc2 in enumerate(fc2s):
        assert got[f"fc2_input_amax/layer_{i}"] == fc2.__dict__["_agoq_fp8_state"].amax_history("x")[0].item()
    assert got["fc2_input_amax_max"] == max(got[k] for k in got if "/layer_" in k)
    assert got.keys() == got_plain.keys() and got != got_plain  # z = glu / s vs glu
    assert fc2_input_amax([_build_bf16()]) == {}


def _build_bf16():
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config

    config = llama_transformer_config(tiny_shape(), ParallelLayout(), params_dtype=torch.float32,
                                      use_cpu_initialization=True)
    (model,) = build_model_chunks(tiny_shape(), config, agoq_layer_spec("sdpa"), None)
    return model
