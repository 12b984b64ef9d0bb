"""agoq.plan.fp8 against the real FP8 objects on the CPU (reference casts, torch's CPU ``_scaled_mm``):
the weight-cache bytes the planner charges per FP8 layer equal the storages of the cache entries that
FP8LinearFunction builds for that layer's four linears; delayed scaling's state equals the planner's
count; an FP8 linear saves x as 1 byte per element; the planner's constants equal the ops' ones."""

from __future__ import annotations

import pytest
import torch

from agoq.ops import fp8_scaling
from agoq.ops.fp8_linear import FP8LinearFunction
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache, fp8_weights_changed
from agoq.plan import fp8 as plan_fp8
from agoq.plan.shape import ModelShape
from agoq.policy import FP8Spec
from agoq.ref import fp8 as ref_fp8

# a tiny LLaMA layer: every GEMM dim a multiple of 16 (torch._scaled_mm); GQA so q and kv widths differ
SHAPE = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                   vocab_size=128)
TOKENS = 32
RECIPES = {"current": FP8Recipe(), "delayed": FP8Recipe(scaling="delayed"),
           "rowwise": FP8Recipe(granularity="row", scaling="current")}


def _storages(tensors) -> dict[int, torch.Tensor]:
    return {t.untyped_storage().data_ptr(): t for t in tensors if isinstance(t, torch.Tensor)}


def _nbytes(storages: dict[int, torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in storages.values())


def _run_linear(w, recipe, state, cache, *, saved=None):
    """One forward + backward of FP8LinearFunction with a weight cache (what agoq's Megatron linears call)."""
    x = torch.randn(TOKENS, w.shape[1]).bfloat16().requires_grad_()

    def pack(t):
        if saved is not None and t is not w:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = FP8LinearFunction.apply(x, w, state, recipe, None, None, True, cache)
    y.float().sum().backward()
    return y


def test_constants_equal_the_ops():
    assert plan_fp8.META_HEADER == ref_fp8.META_HEADER
    assert plan_fp8.META_POOL_ROWS == fp8_scaling.META_POOL_ROWS
    assert plan_fp8.META_ROW_ALIGN == fp8_scaling.META_ROW_ALIGN
    assert plan_fp8.SCALING_SLOTS == len(fp8_scaling.SLOT_VARIANTS)


@pytest.mark.parametrize("name", list(RECIPES))
def test_weight_cache_bytes_equal_the_cache_entries(name):
    """Sum over one layer's four linears of the FP8 data (and row-wise scale vectors) the cache keeps."""
    recipe, counted = RECIPES[name], 0
    for n, k in plan_fp8.linear_shapes(SHAPE).values():
        w = torch.nn.Parameter((torch.randn(n, k) / k**0.5).bfloat16())
        state = FP8ScalingState(recipe) if recipe.scaling == "delayed" else None
        cache = FP8WeightCache()
        _run_linear(w, recipe, state, cache)
        entry = cache._entry
        parts = _storages([entry.fwd_b, entry.dgrad_b, entry.fwd_scale_inv, entry.dgrad_scale_inv, entry.scale_src])
        fp8_data = {p: t for p, t in parts.items() if t.element_size() == 1}
        assert len(fp8_data) == plan_fp8.WEIGHT_CACHE_LAYOUTS  # row-major + transposed, separate storages
        counted += _nbytes(fp8_data)
        scales = {p: t for p, t in parts.items() if p not in fp8_data}
        if name == "rowwise":
            counted += _nbytes(scales)
        else:  # per-tensor: 0-dim views of a meta vector (state-owned or a few floats): not charged
            assert all(t.numel() <= plan_fp8.META_HEADER + 1 for t in scales.values())
    spec = FP8Spec(recipe=name)
    assert counted == plan_fp8.weight_cache_bytes(spec, SHAPE)
    assert plan_fp8.weight_cache_bytes(spec, SHAPE) >= 2 * sum(n * k for n, k in plan_fp8.linear_shapes(SHAPE).values())


def test_per_channel_smooth_swiglu_caches_no_fc2_weight():
    w = torch.nn.Parameter(torch.randn(64, 96).bfloat16())
    cache = FP8WeightCache()
    x = torch.randn(TOKENS, 96).bfloat16().requires_grad_()
    FP8LinearFunction.apply(x, w, None, RECIPES["current"], torch.ones(96), None, True, cache)
    assert cache._entry is None  # w_col_scale: no cache
    assert plan_fp8.cached_linears(FP8Spec(recipe="current", smooth_swiglu="per-channel")) == (
        "linear_qkv", "linear_proj", "linear_fc1")


def test_scaling_state_bytes_equal_the_state():
    """After two weight versions every slot (x, w, g) writes into a meta pool: the state's storages."""
    recipe = RECIPES["delayed"]
    w = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    state, cache = FP8ScalingState(recipe), FP8WeightCache()
    for _ in range(2):
        _run_linear(w, recipe, state, cache)
        fp8_weights_changed()
    pools = [t for pool in state._pools.values() for t in pool[0]]
    held = _storages(list(state._buffers.values()) + pools)
    assert _nbytes(held) == plan_fp8.scaling_state_bytes(FP8Spec(recipe="delayed"))
    assert plan_fp8.scaling_state_bytes(FP8Spec(recipe="current")) == 0


def test_fp8_linear_saves_x_in_one_byte_per_element():
    """No x_saver: x's transposed FP8 copy is the only activation saved (agoq.plan.fp8: -1 B vs bf16)."""
    w = torch.nn.Parameter(torch.randn(64, 96).bfloat16())
    saved: list = []
    _run_linear(w, RECIPES["current"], None, FP8WeightCache(), saved=saved)
    data = [t for t in saved if t is not None and t.numel() > 1]
    assert [(t.dtype, t.numel()) for t in data] == [(torch.float8_e4m3fn, TOKENS * 96)]
    assert plan_fp8.FP8_BYTES == data[0].element_size()
