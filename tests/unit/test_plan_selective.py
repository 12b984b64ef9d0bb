"""--recompute-granularity selective in the planner: Megatron's core-attention checkpoint saves q, k and the
view of the fused QKV output v is (not agoq's compact v), no SDPA out / log-sum-exp; linear_proj keeps its own
input. With SDPA that is more, not less, than no recompute (agoq.plan.storage.megatron_bytes)."""

from __future__ import annotations

import pytest

from agoq.config import AgoqConfig
from agoq.plan import __main__ as plan
from agoq.plan.memory import Layout
from agoq.plan.peak import predict_peaks
from agoq.plan.recipe import recipe_of
from agoq.plan.shape import ModelShape
from agoq.plan.storage import LayerDims, layer_storage, megatron_bytes
from agoq.policy import ScheduleInfo, Site, load_policy

DIMS = LayerDims(seq=256, micro_batch=2, hidden=512, ffn=1408, heads=8, groups=2)


def _storage(name):
    policy = load_policy(plan.POLICY_DIR / f"{name}.yaml")
    return layer_storage(policy, lambda role: Site(0, 0, 1, None, None, role), ScheduleInfo(1, None, 1))


def test_core_attention_recompute_saves_the_fused_qkv_view_and_proj_input_not_sdpa_internals():
    t, n, g, d = DIMS.tokens, 8, 2, 64
    plain = megatron_bytes(_storage("bf16"), DIMS)
    sel = megatron_bytes(_storage("bf16"), DIMS, core_attn_recompute=True)
    assert sel["attn.v"] == 2 * t * (n + 2 * g) * d  # the checkpoint's value: a view of [T, (n + 2g) d]
    assert plain["attn.v"] == 2 * t * g * d  # agoq's compact copy
    assert sel["attn.out"] == 2 * t * n * d  # linear_proj's bf16 input, no fp32 log-sum-exp
    assert plain["attn.out"] == 2 * t * n * d + 4 * t * n
    assert {k: v for k, v in sel.items() if k not in ("attn.v", "attn.out")} == \
        {k: v for k, v in plain.items() if k not in ("attn.v", "attn.out")}
    # with SDPA, selective keeps more than no recompute: 2 (n + g) d - 4 n bytes per token and layer
    assert sum(sel.values()) - sum(plain.values()) == t * (2 * (n + g) * d - 4 * n)


def test_a_quantized_proj_input_leaves_no_bf16_attention_output_under_selective():
    storage = _storage("int8")
    assert storage.roles["attn.proj_input"].how == "quantized"
    assert megatron_bytes(storage, DIMS, core_attn_recompute=True)["attn.out"] == 0


def test_the_flag_reaches_the_recipe_and_the_peak():
    cfg = AgoqConfig.from_flags({"agoq_disable": True, "recompute_granularity": "selective"})
    assert cfg.activations.selective_recompute and not cfg.activations.recompute
    recipe = recipe_of(cfg)
    assert recipe.selective_recompute and not recipe.recompute
    shape, layout = ModelShape(4, 512, 8, 2, 1408, 32000), Layout(seq=256, mbs=2, gbs=2)
    bf16 = load_policy(plan.POLICY_DIR / "bf16.yaml")
    held = [p.held for p in predict_peaks(shape, layout, bf16, recipe)]
    baseline = recipe_of(AgoqConfig.from_flags({"agoq_disable": True}))
    plain = [p.held for p in predict_peaks(shape, layout, bf16, baseline)]
    assert held[0] - plain[0] == 4 * DIMS.tokens * (2 * (8 + 2) * 64 - 4 * 8)


def test_unknown_granularity_is_refused_by_name():
    with pytest.raises(ValueError, match="--recompute-granularity 'block'"):
        AgoqConfig.from_flags({"recompute_granularity": "block"})
