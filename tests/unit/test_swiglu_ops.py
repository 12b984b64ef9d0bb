"""agoq.ops.smooth_swiglu: autograd Function == plain SwiGLU + fc2 in fp32 (fwd and bwd), the forward's
scale is the backward's, and TP=2 (gloo) equivalence of the per-token scale reduction."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from agoq.ops.smooth_swiglu import (
    SmoothSwiGLUFunction,
    fold_channel_scale,
    smooth_scale,
    smooth_swiglu,
    smooth_swiglu_bwd,
    unsmooth_fc2_output,
)
from agoq.ref.fp8 import ref_fp8_qdq
from agoq.ref.swiglu import ref_swiglu_bwd
from agoq.testing.dist import spawn_ranks

EPS32 = torch.finfo(torch.float32).eps
SEQ, BATCH, FFN, HIDDEN = 6, 2, 32, 16


def _inputs(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    mag = 10 ** ((torch.rand(SEQ, BATCH, 1, generator=gen) - 0.5) * 3)  # per-token magnitude spread
    fc1_out = torch.randn(SEQ, BATCH, 2 * FFN, generator=gen) * mag
    w = torch.randn(HIDDEN, FFN, generator=gen)
    return fc1_out.to(dtype), w.to(dtype)


def _plain(fc1_out, w):
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w)


def _smoothed(fc1_out, w, mode, pow2=True):
    z, s = smooth_swiglu(fc1_out, mode, pow2=pow2)
    if mode == "per_token":
        return unsmooth_fc2_output(F.linear(z, w), s)
    return F.linear(z, fold_channel_scale(w, s))


@pytest.mark.parametrize("mode", ["per_token", "per_channel"])
def test_smooth_swiglu_function_equals_plain_fwd_bwd_fp32(mode):
    """fp32, pow2 scales: the rescale is exact, but our SwiGLU evaluates silu(g) * u via the fp32
    reference while the oracle uses F.silu (the same formula; different kernels may round the last bit),
    so allow 4 eps relative to the magnitude of the terms."""
    fc1_out, w = _inputs()
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(2))
    results = []
    for fn in (_plain, lambda x, ww: _smoothed(x, ww, mode)):
        x, ww = fc1_out.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(x, ww)
        y.backward(g)
        results.append((y.detach(), x.grad, ww.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    z_abs = (F.silu(fc1_out[..., :FFN]) * fc1_out[..., FFN:]).abs()
    y_bound = 4 * EPS32 * (z_abs @ w.abs().t())
    assert ((y0 - y1).abs() <= y_bound).all()
    torch.testing.assert_close(dx1, dx0, rtol=4 * EPS32, atol=4 * EPS32 * dx0.abs().max().item())
    torch.testing.assert_close(dw1, dw0, rtol=4 * EPS32, atol=4 * EPS32 * dw0.abs().max().item())


@pytest.mark.parametrize("mode", ["per_token", "per_channel"])
def test_smooth_swiglu_function_gradcheck_fp64(mode):
    fc1_out, _ = _inputs(dtype=torch.float64)
    s = smooth_scale(fc1_out, mode, pow2=False)
    x = fc1_out.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: SmoothSwiGLUFunction.apply(t, s), (x,))


def test_backward_uses_the_forward_scale_under_lossy_activation_storage():
    """Activation storage that keeps fc1_out in FP8 (here via saved_tensors_hooks) must not change s:
    the gradient equals smooth_swiglu_bwd(dequantized fc1_out, g, s_forward), and differs from what a
    scale recomputed from the dequantized tensor would give (non-pow2 scales so the difference shows)."""
    fc1_out, _ = _inputs()
    s_fwd = smooth_scale(fc1_out, "per_token", pow2=False)
    stored = {}

    def pack(t):
        if t.shape == fc1_out.shape:
            stored["deq"] = ref_fp8_qdq(t, "e4m3", dim=-1)
            return ("fp8", stored["deq"])
        return ("raw", t)

    def unpack(packed):
        return packed[1]

    x = fc1_out.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        z = SmoothSwiGLUFunction.apply(x, s_fwd)
    g = torch.randn_like(z)
    z.backward(g)
    assert torch.equal(x.grad, smooth_swiglu_bwd(stored["deq"], g, s_fwd))
    s_recomputed = smooth_scale(stored["deq"], "per_token", pow2=False)
    assert not torch.equal(s_recomputed, s_fwd)
    assert not torch.equal(x.grad, smooth_swiglu_bwd(stored["deq"], g, s_recomputed))


def test_smooth_swiglu_bwd_is_swiglu_bwd_of_scaled_grad():
    fc1_out, _ = _inputs()
    s = smooth_scale(fc1_out, "per_channel")
    g = torch.randn(SEQ, BATCH, FFN)
    assert torch.equal(smooth_swiglu_bwd(fc1_out, g, s), ref_swiglu_bwd(fc1_out, g / s))


def test_bf16_input_keeps_dtype_and_scale_is_fp32():
    fc1_out, _ = _inputs(dtype=torch.bfloat16)
    z, s = smooth_swiglu(fc1_out, "per_token")
    assert z.dtype == torch.bfloat16 and s.dtype == torch.float32 and s.shape == (SEQ, BATCH, 1)


def test_errors_name_the_fix():
    fc1_out, w = _inputs()
    with pytest.raises(ValueError, match="per_token"):
        smooth_scale(fc1_out, "per_row")
    with pytest.raises(ValueError, match="smooth_scale"):
        SmoothSwiGLUFunction.apply(fc1_out, torch.ones(3))
    with pytest.raises(ValueError, match="float32"):
        SmoothSwiGLUFunction.apply(fc1_out, torch.ones(FFN, dtype=torch.float64))
    with pytest.raises(ValueError, match="sequence shard"):
        unsmooth_fc2_output(torch.ones(SEQ, BATCH, HIDDEN), torch.ones(SEQ // 2, BATCH, 2))
    with pytest.raises(ValueError, match="F_local"):
        fold_channel_scale(w, torch.ones(FFN + 1))


# --- TP = 2 (gloo) ---------------------------------------------------------------------------------

def _tp_rank(rank, world_size, fc1_out, w, g, reduce_scale, scale_before_reduce):
    """Row-parallel fc2 on a TP shard of the FFN: rank r holds gate/up columns and fc2 columns of its
    half. Returns (y, d fc1_out shard, d w shard)."""
    width = FFN // world_size
    cols = slice(rank * width, (rank + 1) * width)
    gate, up = fc1_out.chunk(2, dim=-1)
    x = torch.cat([gate[..., cols], up[..., cols]], dim=-1).clone().requires_grad_()
    w_r = w[:, cols].clone().requires_grad_()
    s = smooth_scale(x, "per_token", tp_group=dist.group.WORLD if reduce_scale else None)
    z = SmoothSwiGLUFunction.apply(x, s)
    partial = F.linear(z, w_r)
    if scale_before_reduce:
        partial = unsmooth_fc2_output(partial, s)
    y = _AllReduceSum.apply(partial)
    if not scale_before_reduce:
        y = unsmooth_fc2_output(y, s)
    y.backward(g)
    return y.detach(), x.grad, w_r.grad


class _AllReduceSum(torch.autograd.Function):
    """Megatron's row-parallel output reduction: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g


def _full_reference(fc1_out, w, g):
    x, ww = fc1_out.clone().requires_grad_(), w.clone().requires_grad_()
    y = _plain(x, ww)
    y.backward(g)
    return y.detach(), x.grad, ww.grad


@pytest.mark.dist
@pytest.mark.parametrize("reduce_scale,scale_before_reduce", [(True, False), (False, True)])
def test_tp2_per_token_smooth_swiglu_equals_unsharded_plain(reduce_scale, scale_before_reduce):
    """Both TP-correct placements (all-reduced max, or local max applied before the reduction) match the
    unsharded plain MLP: forward within the fp32 reassociation bound of a 2-way split sum (4 eps * sum
    of |terms|), gradients of each shard likewise."""
    fc1_out, w = _inputs()
    fc1_out[..., FFN // 2:FFN] *= 50.0  # rank 1's gate half larger: the local maxima then differ
    fc1_out[..., FFN + FFN // 2:] *= 50.0
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    results = spawn_ranks(2, _tp_rank, args=(fc1_out, w, g, reduce_scale, scale_before_reduce))
    y_ref, dx_ref, dw_ref = _full_reference(fc1_out, w, g)
    z_abs = (F.silu(fc1_out[..., :FFN]) * fc1_out[..., FFN:]).abs()
    y_bound = 4 * EPS32 * (z_abs @ w.abs().t())
    width = FFN // 2
    for rank, (y, dx, dw) in enumerate(results):
        assert ((y - y_ref).abs() <= y_bound).all()
        cols = slice(rank * width, (rank + 1) * width)
        dx_ref_r = torch.cat([dx_ref[..., :FFN][..., cols], dx_ref[..., FFN:][..., cols]], dim=-1)
        torch.testing.assert_close(dx, dx_ref_r, rtol=8 * EPS32, atol=8 * EPS32 * dx_ref.abs().max().item())
        torch.testing.assert_close(dw, dw_ref[:, cols], rtol=8 * EPS32, atol=8 * EPS32 * dw_ref.abs().max().item())


@pytest.mark.dist
def test_tp2_local_scale_after_reduction_is_wrong():
    """The caveat of the authors' code (TP = 1 only): local max, rescale after the all-reduce."""
    fc1_out, w = _inputs()
    fc1_out[..., FFN // 2:FFN] *= 50.0
    fc1_out[..., FFN + FFN // 2:] *= 50.0
    g = torch.randn(SEQ, BATCH, HIDDEN)
    results = spawn_ranks(2, _tp_rank, args=(fc1_out, w, g, False, False))
    y_ref, _, _ = _full_reference(fc1_out, w, g)
    rel = (results[0][0] - y_ref).norm() / y_ref.norm()
    assert rel > 0.1
