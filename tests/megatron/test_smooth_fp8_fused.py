"""The fused (Smooth-)SwiGLU + FP8 fc2 paths (agoq.ops.smooth_swiglu_fp8) inside the real megatron-core model, on CPU.

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

Plain FP8 (no Smooth-SwiGLU): the fused path (swiglu_fp8_fc2, the default) against Megatron's own MLP (its
unfused ``glu``, then the FP8 fc2; ``SavePaths(fuse_swiglu_fp8=False)``, AgoqConfig.kernels.fuse_swiglu_fp8), with
the same equalities and floor, also
at TP=2 (gloo: Megatron's row-parallel all-reduce after the op; per-rank delayed-scaling histories on both paths),
and the rule that keeps Megatron's MLP (bias_activation_fusion, current scaling, the bf16 first / last layers).
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


def _build(mode, policy, fused, reference=None, tp=1, recipe="delayed", bf16_layers=0, **config_overrides):
    import dataclasses

    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.ops.saved_act import SavePaths
    from agoq.policy import FP8Spec, ScheduleInfo

    shape = tiny_shape()
    config = llama_transformer_config(shape, ParallelLayout(tp=tp), params_dtype=torch.bfloat16,
                                      use_cpu_initialization=True)
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    compute = FP8Spec(recipe=recipe, smooth_swiglu=mode, bf16_first_layers=bf16_layers, bf16_last_layers=0)
    if isinstance(policy, str):
        policy = POLICIES / f"{policy}.yaml"
    spec = agoq_layer_spec("sdpa", policy=policy,
                           schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1), compute=compute,
                           save_paths=SavePaths(fuse_smooth_fp8=fused, fuse_swiglu_fp8=fused))
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


def _fused_fc2s(model):
    return [m for m in model.modules() if "_agoq_fp8_smooth_wcache" in m.__dict__]


def _compare_plain(unfused, fused, policy, steps=2):
    """(loss equal, last fc2 weight gradient equal, worst gradient SQNR) per step: Megatron's MLP vs the fused op."""
    out = []
    for step in range(steps):  # step 0 bootstraps the delayed histories, step 1 uses them
        loss_u, grads_u = _step(unfused, step)
        loss_f, grads_f = _step(fused, step)
        last_fc2 = [n for n in grads_u if "layers.1.mlp.linear_fc2.weight" in n]
        fc2_equal = bool(last_fc2) and all(torch.equal(grads_f[n], grads_u[n]) for n in last_fc2)
        worst = min(_sqnr_db(grads_u[n], grads_f[n]) for n in grads_u)
        out.append((torch.equal(loss_f, loss_u), fc2_equal or policy != "bf16", worst))
    return out


@pytest.mark.parametrize("policy", ["bf16", "agoq"])
def test_fused_plain_fp8_mlp_equals_megatrons(mcore_world1, fp8_on_cpu, policy):
    """Plain FP8 (delayed): the fused SwiGLU + fc2 op against Megatron's MLP (bf16 policy) or agoq's SwiGLU storing
    the quantized fc1 output (agoq policy): the loss bit for bit, the last fc2's weight gradient bit for bit with the
    fc1 output kept in bf16, every gradient >= GRAD_FLOOR_DB (module docstring)."""
    unfused = _build("off", policy, fused=False)
    fused = _build("off", policy, fused=True, reference=unfused)
    for step, (loss_equal, fc2_equal, worst) in enumerate(_compare_plain(unfused, fused, policy)):
        assert loss_equal and fc2_equal, step
        assert worst >= GRAD_FLOOR_DB, (step, worst)
    assert len(_fused_fc2s(fused)) == 2 and not _fused_fc2s(unfused)  # both layers' fc2 ran the fused op
    assert all(m.agoq_plain_fp8 for m in fused.modules() if type(m).__name__ == "AgoqMLP")


def test_plain_fusion_rule_keeps_megatrons_mlp(mcore_world1, fp8_on_cpu):
    """Where the fused op cannot give Megatron's values it does not run, and the rule says why: Megatron's
    compiled bias_swiglu (bias_activation_fusion), current scaling, and the bf16 first layer (no FP8 fc2)."""
    fusion = _build("off", "bf16", fused=True, bias_activation_fusion=True)
    for mlp in (m for m in fusion.modules() if type(m).__name__ == "AgoqMLP"):
        assert not mlp.agoq_plain_fp8 and any("bias_activation_fusion" in p for p in mlp.plain_fusion_problems())
    current = _build("off", "bf16", fused=True, recipe="current")
    first_bf16 = _build("off", "bf16", fused=True, bf16_layers=1)
    for model in (current, first_bf16):
        _step(model, 0)
    assert not _fused_fc2s(current) and len(_fused_fc2s(first_bf16)) == 1
    mlps = [m for m in first_bf16.modules() if type(m).__name__ == "AgoqMLP"]
    assert [m.agoq_plain_fp8 for m in mlps] == [False, True]
    assert any("delayed scaling" in p for p in mlps[0].plain_fusion_problems())


@pytest.mark.parametrize("mode", ["off", "per-token"])
def test_a_quantized_fc2_request_runs_unfused_and_is_stored_as_asked(mcore_world1, fp8_on_cpu, tmp_path, mode):
    """SwiGLU input bf16 and mlp.fc2_input int8 under FP8 delayed scaling: the fused SwiGLU -> FP8 fc2 op, which
    would keep fc2's input as its own E4M3 copy, does not run; the rule says why, and fc2 stores its input in the
    asked format (the byte counter sees an mlp.fc2_input copy on every layer; before, nothing, silently)."""
    path = tmp_path / "fc2_int8.yaml"
    path.write_text("version: 1\ndefault: {activations: bf16}\nrules:\n"
                    "  - when: {role: [mlp.fc2_input]}\n    set: {activations: int8_b128}\n")
    model = _build(mode, path, fused=True)
    mlps = [m for m in model.modules() if type(m).__name__ == "AgoqMLP"]
    assert len(mlps) == 2 and not any(m.agoq_plain_fp8 for m in mlps)
    assert all(any("mlp.fc2_input bf16" in p and "int8_b128" in p for p in m.plain_fusion_problems()) for m in mlps)
    counter = mlps[0].linear_fc2.agoq_save.counter
    _step(model, 0)
    assert not _fused_fc2s(model)
    assert {role for _, role in counter.packed} == {"mlp.fc2_input"}
    assert sorted(layer for layer, _ in counter.packed) == [0, 1]


def _tp_rank(rank: int, world_size: int) -> list:
    from megatron.core import parallel_state

    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout
    from agoq.ops import fp8_linear

    fp8_linear.check_fp8_device = lambda *a, **k: None  # FP8 math on CPU (the fp8_on_cpu fixture, in this rank)
    handle = install(AgoqConfig(device="cpu"))
    try:
        runtime.init_model_parallel(ParallelLayout(tp=2), seed=1234, device=torch.device("cpu"))
        unfused = _build("off", "bf16", fused=False, tp=2)
        fused = _build("off", "bf16", fused=True, tp=2, reference=unfused)
        out = _compare_plain(unfused, fused, "bf16")
        parallel_state.destroy_model_parallel()
        return [(a, b, w >= GRAD_FLOOR_DB) for a, b, w in out]
    finally:
        handle.uninstall()


@pytest.mark.dist
def test_tp2_fused_plain_fp8_mlp_equals_megatrons(fp8_on_cpu):
    """TP=2 (gloo, 2 ranks, each half of the FFN channels): the fused op's TP-partial output goes through Megatron's
    row-parallel all-reduce; per-tensor delayed scaling keeps one history per rank on both paths (nothing is
    reduced), so each rank's loss and last fc2 weight-gradient shard equal the unfused path's."""
    from agoq.testing.dist import spawn_ranks

    per_rank = spawn_ranks(2, _tp_rank)
    assert per_rank == [[(True, True, True)] * 2] * 2, per_rank
