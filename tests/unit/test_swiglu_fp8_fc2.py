"""agoq.ops.smooth_swiglu_fp8.swiglu_fp8_fc2 (plain SwiGLU + FP8 fc2 as one op, s = 1) on CPU, where it runs the
agoq.ref twins of its kernels and CPU ``torch._scaled_mm``, against the unfused path it replaces in the plain FP8
MLP: Megatron's SwiGLU (megatron.core.transformer.mlp's ``glu``: ``silu(x_glu) * (x_linear + 0.0)``, autograd of
bf16 ops) then the FP8 linear (FP8LinearFunction with fc2's weight cache).

Equal bit for bit (the same codes cast with the same scales, the same tensor-wise GEMMs): fc2's output, fc2's
weight gradient and all three delayed-scaling histories, at TP=1 and on each rank at TP=2 (per-tensor delayed
scaling keeps one history per rank on both paths: nothing is reduced). The E4M3 codes of z are equal wherever
Megatron's ``x_linear + 0.0`` is a no-op, i.e. everywhere but an up of -0.0, which Megatron turns into +0.0 (the
product's zero then has the other sign: code 0x80 vs 0x00, both zero, test below). The fc1-output gradient is
agoq.ref.swiglu.ref_swiglu_bwd_scaled of the unfused path's own grad_z (one fp32 rounding; the unfused autograd
rounds after silu, its backward and each product): tests/unit/test_smooth_swiglu_fp8.py's bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agoq.formats import parse_format
from agoq.ops.fp8_linear import FP8LinearFunction
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache
from agoq.ops.saved_act import SavedBytesCounter, saved_input_handle
from agoq.ops.saved_swiglu import swiglu_saving_input
from agoq.ops.smooth_swiglu_fp8 import swiglu_fp8_fc2
from agoq.ref.swiglu import ref_swiglu_bwd_scaled
from agoq.testing.numerics import sqnr_db
from tests.unit.test_smooth_swiglu_fp8 import (
    DH_UNFUSED_ATOL,
    FFN,
    RECIPE,
    STORE_FLOOR_DB,
    _inputs,
    _param,
    _same_states,
)

STORE_FMT = "int8_b64"
# Both storage paths keep the same int8 h and take the same output gradient; their wgrad operand z is rebuilt from
# the dequantized h, on CPU by Megatron's two bf16 roundings (unfused) or in fp32 with one (fused, as agoq's CUDA
# recompute kernels): a bf16 ulp here and there before the E4M3 re-cast, which flips a few codes (~2**-4 of
# them, each by one E4M3 step of 2**-3): noise ~2**-4 * 2**-6 = 2**-10 of the power, 30 dB; floor 25 dB.
STORE_WGRAD_FLOOR_DB = 25.0


def _megatron_glu(h):
    """megatron.core.transformer.mlp.MLP.forward's unfused ``glu`` (no clamp, glu_linear_offset 0)."""
    x_glu, x_linear = torch.chunk(h, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


def _unfused(h0, w, gy, state, cache, store=None):
    """Megatron's SwiGLU then agoq's FP8 linear, as the plain FP8 MLP ran before the fused path (with
    ``store=(fmt, key, counter)``: agoq's SwiGLU storing quantized h and fc2 rebuilding its input from the stash,
    agoq.megatron.layers' recompute path)."""
    h = h0.clone().requires_grad_()
    w.grad = None
    saver = None
    if store is None:
        z = _megatron_glu(h)
    else:
        fmt, key, counter = store
        z, stash = swiglu_saving_input(h, fmt, key, counter)
        saver = lambda x2: saved_input_handle(z, stash=stash, key=key)  # noqa: E731
    grads = {}
    z.register_hook(lambda grad: grads.setdefault("z", grad))
    y = FP8LinearFunction.apply(z, w, state, RECIPE, None, saver, True, cache)
    y.backward(gy)
    return y.detach(), h.grad, w.grad, grads["z"]


def _fused(h0, w, gy, state, cache, **kw):
    h = h0.clone().requires_grad_()
    w.grad = None
    y = swiglu_fp8_fc2(h, w, state, RECIPE, weight_cache=cache, **kw)
    y.backward(gy)
    return y.detach(), h.grad, w.grad


def test_plain_fused_equals_unfused_over_delayed_steps():
    """Three micro-batches of one weight version: the first bootstraps every slot (current scaling), later ones
    use the history; fc2's FP8 weight is made once (the entry persists across micro-batches, as fp8_linear's)."""
    st_f, st_u, cache_f, cache_u = FP8ScalingState(RECIPE), FP8ScalingState(RECIPE), FP8WeightCache(), FP8WeightCache()
    _, w0, _ = _inputs()
    w_f, w_u = _param(w0), _param(w0)
    for step in range(3):
        h, _, gy = _inputs(seed=step)
        y_u, dh_u, dw_u, grad_z = _unfused(h, w_u, gy, st_u, cache_u)
        y_f, dh_f, dw_f = _fused(h, w_f, gy, st_f, cache_f)
        assert torch.equal(y_f, y_u) and torch.equal(dw_f, dw_u), step
        assert _same_states(st_f, st_u), step
        assert torch.equal(dh_f, ref_swiglu_bwd_scaled(h, grad_z)), step
        bound = DH_UNFUSED_ATOL * dh_u.float().abs().max()
        assert (dh_f.float() - dh_u.float()).abs().max() <= bound, step
    assert cache_f.refreshes == cache_u.refreshes == 1 and cache_f._entry is not None


def test_plain_codes_equal_megatrons_but_for_the_sign_of_a_negative_zero_up():
    """The one place the fused SwiGLU values differ from Megatron's: an up of -0.0 (Megatron's ``x_linear + 0.0``
    makes it +0.0, agoq's SwiGLU keeps it), so the zero product has the other sign. Its E4M3 code differs in the
    sign bit only, and fc2's output is the same."""
    from agoq.ref.fp8 import ref_fp8_cast_delayed_2d
    from agoq.ref.smooth_swiglu_fp8 import ref_smooth_swiglu_cast_delayed

    h, w0, _ = _inputs()
    h[2, 0, FFN + 3] = -0.0
    h[5, 1, FFN + 7] = -0.0
    h2 = h.reshape(-1, 2 * FFN)
    meta = torch.tensor([1 / 8, 8.0, 0.0, 0.0, 4.0, 0.0], dtype=torch.float32)
    ws = torch.zeros(2, dtype=torch.int32)
    fused, _, _, _, _ = ref_smooth_swiglu_cast_delayed(h2, None, "e4m3", meta, ws, per_token=False)
    megatron, _, _ = ref_fp8_cast_delayed_2d(_megatron_glu(h2), "e4m3", meta, ws)
    differ = fused.view(torch.uint8) != megatron.view(torch.uint8)
    assert differ.sum() >= 1 and torch.equal(differ, (h2[:, FFN:] == 0) & torch.signbit(h2[:, FFN:]) & differ)
    assert torch.equal(fused.view(torch.uint8)[differ] ^ megatron.view(torch.uint8)[differ],
                       torch.full((int(differ.sum()),), 0x80, dtype=torch.uint8))
    with torch.no_grad():
        y_u = FP8LinearFunction.apply(_megatron_glu(h), w0, FP8ScalingState(RECIPE), RECIPE, None, None, False, None)
        y_f = swiglu_fp8_fc2(h, w0, FP8ScalingState(RECIPE), RECIPE, weight_cache=FP8WeightCache())
    assert torch.equal(y_f, y_u)


def test_plain_fused_with_activation_storage():
    """store=(fmt, key, counter): the fused op keeps the same quantized h as the unfused storage path (same bytes
    counted), gives the same output, and its gradients come from that h (wgrad re-casts z with the forward's
    scale, as the unfused FP8 linear does from its recompute stash)."""
    fmt = parse_format(STORE_FMT)
    key = (3, "mlp.swiglu_input")
    h, w0, gy = _inputs()
    c_f, c_u = SavedBytesCounter(), SavedBytesCounter()
    y_ref, dh_ref, dw_ref = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache())
    y_u, dh_u, dw_u, _ = _unfused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), (fmt, key, c_u))
    y_f, dh_f, dw_f = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache(), store=(fmt, key, c_f))
    assert torch.equal(y_f, y_ref) and torch.equal(y_f, y_u)
    assert c_f.packed == c_u.packed and c_f.total() > 0
    assert sqnr_db(dw_u.float(), dw_f.float()) >= STORE_WGRAD_FLOOR_DB
    assert sqnr_db(dh_ref.float(), dh_f.float()) >= STORE_FLOOR_DB
    assert sqnr_db(dw_ref.float(), dw_f.float()) >= STORE_FLOOR_DB
    assert (dh_f.float() - dh_u.float()).abs().max() <= DH_UNFUSED_ATOL * dh_u.float().abs().max()


def test_plain_fp16_model_equals_unfused():
    h, w0, gy = (t.to(torch.float16) for t in _inputs())
    y_u, _, dw_u, _ = _unfused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache())
    y_f, _, dw_f = _fused(h, _param(w0), gy, FP8ScalingState(RECIPE), FP8WeightCache())
    assert y_f.dtype == torch.float16 and torch.equal(y_f, y_u) and torch.equal(dw_f, dw_u)


def test_plain_no_grad_forward_keeps_nothing():
    h, w, gy = _inputs()
    with torch.no_grad():
        y = swiglu_fp8_fc2(h, w, FP8ScalingState(RECIPE), RECIPE, weight_cache=FP8WeightCache())
    y_grad, _, _ = _fused(h, _param(w), gy, FP8ScalingState(RECIPE), FP8WeightCache())
    assert y.grad_fn is None and torch.equal(y, y_grad)


@pytest.mark.parametrize("recipe", [FP8Recipe(), FP8Recipe(granularity="row")], ids=["current", "rowwise"])
def test_plain_rejects_what_it_cannot_fuse(recipe):
    h, w, _ = _inputs()
    with pytest.raises(ValueError, match="Megatron's SwiGLU"):
        swiglu_fp8_fc2(h, w, None, recipe, weight_cache=FP8WeightCache())
    with pytest.raises(ValueError, match="Megatron's SwiGLU"):
        swiglu_fp8_fc2(h.float(), w.float(), FP8ScalingState(RECIPE), RECIPE, weight_cache=FP8WeightCache())


def _tp_rank(rank, world_size):
    """fc2 row-parallel: each rank holds F / TP channels; no amax is reduced on either path (one delayed-scaling
    history per rank and linear), so each rank's partial output and weight gradient equal the unfused path's, and
    the ranks' histories differ where their local amaxes do."""
    h_full, w_full, gy = _inputs(outlier=False)
    h_full[3, 1, FFN + 5 + rank] = 60.0 * (rank + 1)  # each rank's local SwiGLU max differs
    local = FFN // world_size
    cols = slice(rank * local, (rank + 1) * local)
    h = torch.cat([h_full[..., :FFN][..., cols], h_full[..., FFN:][..., cols]], dim=-1).contiguous()
    w_f, w_u = _param(w_full[:, cols]), _param(w_full[:, cols])
    st_f, st_u, cache_f, cache_u = FP8ScalingState(RECIPE), FP8ScalingState(RECIPE), FP8WeightCache(), FP8WeightCache()
    out = []
    for _ in range(2):
        y_u, _, dw_u, _ = _unfused(h, w_u, gy, st_u, cache_u)
        y_f, _, dw_f = _fused(h, w_f, gy, st_f, cache_f)
        out.append(torch.equal(y_f, y_u) and torch.equal(dw_f, dw_u) and _same_states(st_f, st_u))
    return out, st_f.amax_history("x")[0].item()


@pytest.mark.dist
def test_tp2_plain_keeps_per_rank_histories():
    from agoq.testing.dist import spawn_ranks

    (ok0, amax0), (ok1, amax1) = spawn_ranks(2, _tp_rank)
    assert ok0 == ok1 == [True, True] and amax0 != amax1
