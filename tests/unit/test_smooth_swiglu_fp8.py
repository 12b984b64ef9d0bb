"""agoq.ops.smooth_swiglu_fp8 (the fused Smooth-SwiGLU + FP8 fc2 op) on CPU, where it runs the agoq.ref twins
of its kernels and CPU ``torch._scaled_mm``, against the unfused composition it replaces: Megatron's SwiGLU
(swiglu_reference), the smoothing scale (glu_smooth_scale), ``z / s``, the FP8 linear (FP8LinearFunction,
``w_col_scale`` per channel) and, per token, the un-smoothing (unsmooth_fc2_output).

What must be equal, bit for bit: fc2's output, fc2's weight gradient and all three delayed-scaling histories
(the same codes are cast with the same scales and, s being a power of two, the row-wise GEMM scales and the
in-cast multiply by s are exact); the fc1-output gradient equals agoq.ref.swiglu.ref_swiglu_bwd_scaled of the
unfused path's own grad_z (the fused op computes the SwiGLU backward in fp32 with one rounding, as the
saved-activation path's kernel; the unfused autograd of bf16 ops rounds after every op, so against it the
fc1-output gradient differs by a few bf16 rounding steps: bound below). TP=2 (gloo): the per-token amax
all-reduce makes every rank's s the TP-global one, so each rank's partial output equals the unfused path's.
"""

from __future__ import annotations

import pytest
import torch

from agoq.formats import parse_format
from agoq.ops.fp8_linear import FP8LinearFunction
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache
from agoq.ops.saved_act import SavedBytesCounter
from agoq.ops.saved_swiglu import swiglu_reference
from agoq.ops.smooth_swiglu import glu_smooth_scale, unsmooth_fc2_output
from agoq.ops.smooth_swiglu_fp8 import fused_smooth_supported, smooth_swiglu_fp8_fc2
from agoq.ref.swiglu import ref_swiglu_bwd_scaled
from agoq.testing.numerics import sqnr_db

MODES = ["per_token", "per_channel"]
RECIPE = FP8Recipe(scaling="delayed")
SEQ, BATCH, FFN, HIDDEN = 16, 2, 64, 48  # tokens and widths multiples of 16 (torch._scaled_mm)
# Unfused autograd rounds to bf16 after silu, its backward, the products and the division by s (about six
# roundings of 2**-9 relative each) where the fused backward rounds once: 6 * 2**-9 ~ 2**-6.4, so 2**-6 of
# the gradient's largest magnitude bounds the elementwise difference.
DH_UNFUSED_ATOL = 2.0**-6
STORE_FLOOR_DB = 20.0  # int8_b64 h (>= 40 dB) then the E4M3 re-cast of z (~28 dB floor): 20 dB with margin


def _inputs(seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(SEQ, BATCH, 2 * FFN, generator=g)
    if outlier:
        h[3, 1, FFN + 5] = 60.0  # an up outlier: the token / channel the smoothing exists for
    w = torch.randn(HIDDEN, FFN, generator=g) * 0.1
    gy = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return h.to(torch.bfloat16), w.to(torch.bfloat16), gy.to(torch.bfloat16)


def _param(w0):
    return w0.clone().requires_grad_()


def _unfused(h0, w, gy, state, mode, tp_group=None, cache=None):
    """The unfused path as AgoqMLP ran it; ``w`` a leaf parameter (its grad is reset), ``cache`` fc2's weight
    cache (FP8LinearFunction ignores it with a column scale, as in the layer)."""
    h = h0.clone().requires_grad_()
    w.grad = None
    glu = swiglu_reference(h)
    s = glu_smooth_scale(h, glu, mode, tp_group=tp_group)
    z = glu / s.to(glu.dtype)
    grads = {}
    z.register_hook(lambda grad: grads.setdefault("z", grad))
    y = FP8LinearFunction.apply(z, w, state, RECIPE, None if mode == "per_token" else s, None, True,
                                cache if mode == "per_token" else None)
    if mode == "per_token":
        y = unsmooth_fc2_output(y, s)
    y.backward(gy)
    return y.detach(), h.grad, w.grad, s, grads["z"]


def _fused(h0, w, gy, state, cache, mode, **kw):
    h = h0.clone().requires_grad_()
    w.grad = None
    y = smooth_swiglu_fp8_fc2(h, w, state, RECIPE, per_token=mode == "per_token", weight_cache=cache, **kw)
    y.backward(gy)
    return y.detach(), h.grad, w.grad


def _same_states(a: FP8ScalingState, b: FP8ScalingState) -> bool:
    return all(torch.equal(a.meta(slot), b.meta(slot)) for slot in ("x", "w", "g"))


@pytest.mark.parametrize("mode", MODES)
def test_fused_equals_unfused_over_delayed_steps(mode):
    """Three micro-batches of one weight version: the first bootstraps every slot (current scaling), later
    ones use the history (the weight cache's entry of the first micro-batch serves all three per token)."""
    st_f, st_u, cache_f, cache_u = FP8ScalingState(RECIPE), FP8ScalingState(RECIPE), FP8WeightCache(), FP8WeightCache()
    _, w0, _ = _inputs()
    w_f, w_u = _param(w0), _param(w0)
    for step in range(3):
        h, _, gy = _inputs(seed=step)
        y_u, dh_u, dw_u, s, grad_z = _unfused(h, w_u, gy, st_u, mode, cache=cache_u)
        y_f, dh_f, dw_f = _fused(h, w_f, gy, st_f, cache_f, mode)
        assert torch.equal(y_f, y_u) and torch.equal(dw_f, dw_u), step
        assert _same_states(st_f, st_u), step
        assert torch.equal(dh_f, ref_swiglu_bwd_scaled(h, grad_z, s)), step
        bound = DH_UNFUSED_ATOL * dh_u.float().abs().max()
        assert (dh_f.float() - dh_u.float()).abs().max() <= bound, step


@pytest.mark.parametrize("mode", MODES)
def test_fused_with_activation_storage(mode):
    """store=(fmt, key, counter): only h quantized is kept (counted), the forward is unchanged, and the
    gradients come from the dequantized h with the forward's s (wgrad re-casts z with the forward's scale)."""
    fmt = parse_format("int8_b64")
    counter = SavedBytesCounter()
    h, w0, gy = _inputs()
    y_ref, dh_ref, dw_ref = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), mode)
    y, dh, dw = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), mode,
                       store=(fmt, (3, "mlp.swiglu_input"), counter))
    assert torch.equal(y, y_ref)
    assert sqnr_db(dw_ref.float(), dw.float()) >= STORE_FLOOR_DB
    assert sqnr_db(dh_ref.float(), dh.float()) >= STORE_FLOOR_DB
    assert counter.by_role() and counter.total() > 0  # the quantized h was counted (and freed by backward)


def test_epilogue_unsmoothing_equals_the_gemm_one():
    """unsmooth="epilogue" (benchmarks/bench_fp8.py's A/B): tensor-wise GEMM then y *= s gives the unfused values
    too; an unknown mode is refused with the allowed ones."""
    h, w0, gy = _inputs()
    y_gemm, dh_gemm, dw_gemm = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), "per_token")
    y_epi, dh_epi, dw_epi = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), "per_token",
                                   unsmooth="epilogue")
    y_u, _, _, _, _ = _unfused(h, _param(w0), gy, FP8ScalingState(RECIPE), "per_token", cache=FP8WeightCache())
    assert torch.equal(y_epi, y_u) and torch.equal(y_epi, y_gemm)
    assert torch.equal(dh_epi, dh_gemm) and torch.equal(dw_epi, dw_gemm)
    with pytest.raises(ValueError, match="un-smoothing mode 'after'"):
        _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), "per_token", unsmooth="after")


@pytest.mark.parametrize("mode", MODES)
def test_fp16_model_equals_unfused(mode):
    """fp16: the row-wise GEMM returns bf16 only, so per token the op un-smooths after the tensor-wise GEMM (fp16
    out): the output stays the unfused path's, bit for bit."""
    h, w0, gy = (t.to(torch.float16) for t in _inputs())
    y_u, _, dw_u, _, _ = _unfused(h, _param(w0), gy, FP8ScalingState(RECIPE), mode, cache=FP8WeightCache())
    y_f, _, dw_f = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), mode)
    assert y_f.dtype == torch.float16 and torch.equal(y_f, y_u)
    assert torch.equal(dw_f, dw_u)  # per channel: the fp16 wgrad times s after the GEMM, as unfused


def test_no_grad_forward_keeps_nothing():
    h, w, _ = _inputs()
    st, cache = FP8ScalingState(RECIPE), FP8WeightCache()
    with torch.no_grad():
        y = smooth_swiglu_fp8_fc2(h, w, st, RECIPE, per_token=True, weight_cache=cache)
    y_grad, _, _ = _fused(h, _param(w), torch.ones(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16),
                          FP8ScalingState(RECIPE), FP8WeightCache(), "per_token")
    assert y.grad_fn is None and torch.equal(y, y_grad)


def test_weight_cache_per_token_persists_per_channel_follows_the_scale():
    """Per token the FP8 weight is made once per weight version; per channel once per scale tensor (each
    micro-batch's s), shared by that micro-batch's forward and backward and dropped after its backward."""
    h, w0, gy = _inputs()
    w = w0.clone().requires_grad_()  # one parameter across micro-batches, as in training
    for mode, refreshes in (("per_token", 1), ("per_channel", 3)):
        st, cache = FP8ScalingState(RECIPE), FP8WeightCache()
        for _ in range(3):
            y = smooth_swiglu_fp8_fc2(h.clone().requires_grad_(), w, st, RECIPE, per_token=mode == "per_token",
                                      weight_cache=cache)
            y.backward(gy)
        assert cache.refreshes == refreshes, mode
        assert (cache._entry is None) == (mode == "per_channel"), mode
    cache, st = FP8WeightCache(), FP8ScalingState(RECIPE)
    s = torch.ones(FFN)
    first = cache.get(w, RECIPE, lambda x: object(), s)
    assert cache.get(w, RECIPE, lambda x: object(), s) is first
    s.mul_(2)  # in place: a new version of the same tensor
    assert cache.get(w, RECIPE, lambda x: object(), s) is not first


def test_rejects_what_it_cannot_fuse():
    h, w, _ = _inputs()
    assert not fused_smooth_supported(FP8Recipe(), h)  # current scaling: the unfused path
    assert not fused_smooth_supported(FP8Recipe(granularity="row"), h)
    assert not fused_smooth_supported(RECIPE, h.float())
    with pytest.raises(ValueError, match="delayed scaling"):
        smooth_swiglu_fp8_fc2(h, w, None, FP8Recipe(), per_token=True, weight_cache=FP8WeightCache())
    with pytest.raises(ValueError, match="does not take the SwiGLU"):
        smooth_swiglu_fp8_fc2(h, w[:, :-16], FP8ScalingState(RECIPE), RECIPE, per_token=True,
                              weight_cache=FP8WeightCache())


def _tp_rank(rank, world_size):
    import torch.distributed as dist

    h_full, w_full, gy = _inputs(outlier=False)
    h_full[3, 1, FFN + 5 + rank] = 60.0 * (rank + 1)  # each rank's local up max differs: s must be all-reduced
    local = FFN // world_size
    cols = slice(rank * local, (rank + 1) * local)
    h = torch.cat([h_full[..., :FFN][..., cols], h_full[..., FFN:][..., cols]], dim=-1).contiguous()
    w_f, w_u = _param(w_full[:, cols]), _param(w_full[:, cols])
    group = dist.group.WORLD
    out = []
    for mode in MODES:
        st_f, st_u, cache_f, cache_u = (FP8ScalingState(RECIPE), FP8ScalingState(RECIPE), FP8WeightCache(),
                                        FP8WeightCache())
        for _ in range(2):
            y_u, _, dw_u, _, _ = _unfused(h, w_u, gy, st_u, mode, tp_group=group if mode == "per_token" else None,
                                          cache=cache_u)
            y_f, _, dw_f = _fused(h, w_f, gy, st_f, cache_f, mode, tp_group=group)
            out.append(torch.equal(y_f, y_u) and torch.equal(dw_f, dw_u) and _same_states(st_f, st_u))
    return out


@pytest.mark.dist
def test_tp2_per_token_scale_is_tp_global():
    from agoq.testing.dist import spawn_ranks

    results = spawn_ranks(2, _tp_rank)
    assert results == [[True] * 4, [True] * 4]


def test_outlier_injection_through_the_fused_op():
    """The FP8 paper's mechanism (tests/unit/test_swiglu_ref.py's outlier injection: aligned gate / up rows
    make one channel quadratic, two tokens pushed along it) through the fused op, judged on fc2's output for
    the normal tokens against fp32: the plain FP8 fc2 (per-tensor E4M3 of the SwiGLU output) squashes them
    (< 10 dB, the bound test_swiglu_ref argues); per-token smoothing keeps them (>= 22 dB: the E4M3 input floor
    of 25 dB there, less 3 dB for the weight's E4M3 cast). Per channel the outlier channel's s (~1e6) moves
    into fc2's weight, whose per-tensor E4M3 cast then squashes the other columns: at fc2's output it gains
    little here (measured 3.4 vs 1.0 dB), on the unfused path alike (its output is asserted equal)."""
    from tests.unit.test_swiglu_ref import OUTLIER_AMP, OUTLIER_TOKENS, _aligned_mlp

    h = _aligned_mlp(OUTLIER_AMP).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(64, h.shape[-1] // 2, generator=gen) / 16).to(torch.bfloat16)
    exact = swiglu_reference(h.float()) @ w.float().t()
    keep = torch.ones(h.shape[0], dtype=torch.bool)
    keep[list(OUTLIER_TOKENS)] = False

    def db(y):
        return sqnr_db(exact[keep], y.float()[keep])

    with torch.no_grad():
        plain = FP8LinearFunction.apply(swiglu_reference(h), w, FP8ScalingState(RECIPE), RECIPE, None, None, False,
                                        None)
        fused = {mode: smooth_swiglu_fp8_fc2(h, w, FP8ScalingState(RECIPE), RECIPE, per_token=mode == "per_token",
                                             weight_cache=FP8WeightCache()) for mode in MODES}
        glu = swiglu_reference(h)
        s = glu_smooth_scale(h, glu, "per_channel")
        unfused_channel = FP8LinearFunction.apply(glu / s.to(glu.dtype), w, FP8ScalingState(RECIPE), RECIPE, s, None,
                                                  False, None)
    assert db(plain) < 10.0, db(plain)
    assert db(fused["per_token"]) >= 22.0, db(fused["per_token"])
    assert db(fused["per_token"]) - db(plain) >= 15.0
    assert torch.equal(fused["per_channel"], unfused_channel)
