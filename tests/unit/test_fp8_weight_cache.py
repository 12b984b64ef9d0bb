"""agoq.ops.fp8_weight_cache and its use by FP8LinearFunction (CPU: the reference casts and torch's CPU
``_scaled_mm`` where present): the weight is cast once per weight version, the entry is rebuilt when
the weight changes (optimizer step, in-place edit, explicit invalidation), and the gradients equal
those of the uncached op."""

from __future__ import annotations

import math

import pytest
import torch

from agoq.ops.fp8_linear import FP8LinearFunction
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache, fp8_weights_changed, weight_generation
from agoq.testing.fp8 import CPU_SCALED_MM_SKIP_REASON, cpu_scaled_mm_available

needs_cpu_scaled_mm = pytest.mark.skipif(not cpu_scaled_mm_available(), reason=CPU_SCALED_MM_SKIP_REASON)


def _counting_cache():
    cache, made = FP8WeightCache(), []

    def get(w, recipe):
        return cache.get(w, recipe, lambda t: made.append(t.clone()) or len(made))

    return cache, made, get


def test_entry_is_reused_until_the_weight_changes():
    w = torch.nn.Parameter(torch.randn(16, 32))
    recipe = FP8Recipe()
    cache, made, get = _counting_cache()
    assert get(w, recipe) == get(w, recipe) == 1  # second micro-batch: no new cast
    fp8_weights_changed()
    assert get(w, recipe) == 2 and weight_generation() > 0
    with torch.no_grad():
        w.mul_(0.5)  # in-place edit: the version counter moves
    assert get(w, recipe) == 3 and torch.equal(made[-1], w.detach())
    delayed = FP8Recipe(scaling="delayed")
    assert get(w, delayed) == 4  # another recipe object
    other = torch.nn.Parameter(w.detach().clone())
    assert get(other, delayed) == 5  # another tensor (data_ptr)
    assert get(other, delayed) == 5 and cache.refreshes == len(made) == 5


def test_torch_optimizer_step_invalidates_every_cache():
    w = torch.nn.Parameter(torch.randn(16, 32))
    _, _, get = _counting_cache()
    recipe = FP8Recipe()
    get(w, recipe)
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones_like(w)
    before = weight_generation()
    opt.step()  # the global step post-hook bumps the generation
    assert weight_generation() == before + 1
    assert get(w, recipe) == 2


def _data(m=64, k=96, n=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).bfloat16()
    g = torch.randn(m, n, generator=gen).bfloat16()
    return x, w, g


@needs_cpu_scaled_mm
@pytest.mark.parametrize("recipe", [FP8Recipe(fast_accum_forward=False),
                                    FP8Recipe(scaling="delayed", fast_accum_forward=False),
                                    FP8Recipe(granularity="row", fast_accum_forward=False)],
                         ids=["current", "delayed", "row"])
def test_cached_weight_gives_the_uncached_results_and_casts_once(recipe):
    """Two micro-batches with the same weight: identical outputs and gradients with and without the
    cache; with it the weight is cast once (delayed scaling: the w slot records once)."""
    batches = [_data(seed=s) for s in (1, 2)]
    w0 = batches[0][1]
    results = {}
    for cached in (False, True):
        state = FP8ScalingState(recipe) if recipe.scaling == "delayed" else None
        cache = FP8WeightCache() if cached else None
        w = w0.clone().requires_grad_()
        outs = []
        for x, _, g in batches:
            xr = x.clone().requires_grad_()
            y = FP8LinearFunction.apply(xr, w, state, recipe, None, None, True, cache)
            y.backward(g)
            outs.append((y.detach(), xr.grad))
        results[cached] = (outs, w.grad.clone())
        if cached:
            assert cache.refreshes == 1
            if state is not None:
                assert state.num_updates == {"x": 2, "w": 1, "g": 2}
    # delayed, uncached: micro-batch 2 casts w with the history's scale, which is micro-batch 1's
    # (bootstrap) scale of the same w: the same codes, so the same results here too
    (outs_a, dw_a), (outs_b, dw_b) = results[False], results[True]
    for (ya, dxa), (yb, dxb) in zip(outs_a, outs_b, strict=True):
        assert torch.equal(yb, ya) and torch.equal(dxb, dxa)
    assert torch.equal(dw_b, dw_a)


@needs_cpu_scaled_mm
def test_w_col_scale_bypasses_the_cache():
    x, w, g = _data()
    cache = FP8WeightCache()
    s = torch.full((w.shape[1],), 2.0)
    FP8LinearFunction.apply(x.requires_grad_(), w.requires_grad_(), None, FP8Recipe(), s, None, True, cache)
    assert cache.refreshes == 0
