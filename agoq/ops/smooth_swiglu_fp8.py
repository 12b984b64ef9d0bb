"""(Smooth-)SwiGLU + FP8 fc2 as one autograd op, under per-tensor delayed scaling.

``smooth_swiglu_fp8_fc2(h, weight, state, recipe, per_token=..., ...)`` computes fc2's (TP-partial) output
from the fc1 output h [T.., 2F] = [gate | up] directly::

    per token    y = (Q(z) @ Q(W).T) * s,  z = swiglu(h) / s, s [T] = pow2_ceil(max_f |up|)  (TP-global)
    per channel  y =  Q(z) @ Q(W * s).T,   z = swiglu(h) / s, s [F] = pow2_ceil(max_t |swiglu|)
    plain        y =  Q(z) @ Q(W).T,       z = swiglu(h)     (swiglu_fp8_fc2: s = 1, no smoothing)

the math of agoq.ops.smooth_swiglu and agoq.megatron.mlp.AgoqMLP._smooth_forward with fc2 an
agoq.ops.fp8_linear FP8 linear, in fewer passes:

* forward: the smoothing amax (one read of h, or of its up half), then one kernel that computes the
  SwiGLU, divides by s, casts z to E4M3 with fc2's delayed scale (both GEMM layouts) and pushes the amax
  history (agoq.kernels.smooth_swiglu_fp8). z in the model dtype is never materialised.
* plain (``swiglu_fp8_fc2``, the plain FP8 MLP's fc2): the same cast kernel without smoothing (``amax=None``):
  no amax launch, no division, fc2's tensor-wise GEMM as agoq.ops.fp8_linear runs it; codes, scales and
  histories are those of Megatron's unfused SwiGLU followed by the FP8 linear (docs/numerics.md). TP needs nothing:
  per-tensor delayed scaling keeps one history per rank, as the unfused FP8 linear does.
* per token, the un-smoothing is fc2's GEMM itself: row-wise ``torch._scaled_mm`` with ``scale_a = s *
  scale_inv_z`` [T, 1] (written by the cast kernel) and ``scale_b`` = the weight's inverse scale as [1, N]
  (kept with the weight cache entry). s is a power of two, so this is the unfused ``fc2(z) * s`` up to
  the GEMM's fp32 epilogue rounding order (docs/numerics.md, "Smooth-SwiGLU"). The row-wise GEMM returns bf16
  only, so fp16 models (and ``unsmooth="epilogue"``) use the tensor-wise GEMM and ``y *= s``.
* per channel, s goes into fc2's FP8 weight: one cast of W * s (both layouts, the multiply inside the
  cast kernel) per (weight version, scale tensor), through an FP8WeightCache keyed on both, shared by the
  micro-batch's forward and backward and released after that backward. No W * s bf16 temporaries.
* backward: per token, fc2's gradient is cast as g * s (the un-smoothing's gradient) inside the E5M2 cast
  (``mul``); dgrad and wgrad as agoq.ops.fp8_linear; the SwiGLU backward is one kernel with the forward's s
  (agoq.kernels.swiglu.swiglu_bwd; no s in the plain mode); per channel dW = dW' * s per column, for a bf16
  weight inside the wgrad GEMM as its row-wise ``scale_b`` (no extra pass over dW).

Saved for backward: h (bf16), or with activation storage (``store=(fmt, key, counter)``) only its quantized
copy; s (fp32, 4 B per token or channel); z's transposed FP8 copy for wgrad when h is kept as is (with
storage, z is recomputed from the dequantized h with the forward's s and re-cast with the forward's scale,
as agoq.ops.saved_swiglu does). TP: the per-token amax is all-reduced (MAX) before the cast, so every rank
uses the TP-global s and the row-parallel all-reduce of y is exact (s a power of two).

Savings (vs the unfused Smooth-SwiGLU on FP8): 2 B per token and FFN channel (the silu output autograd
kept) with h kept in bf16; plain (vs Megatron's SwiGLU then the FP8 linear): 4 B per token and FFN channel
(the silu output and Megatron's ``x_linear + 0`` tensor). Caveats: per-tensor delayed scaling only
(``fused_smooth_supported``, the rule for every mode; current and row-wise scaling run the unfused path); per
channel each micro-batch in flight holds its FP8 W * s (2 B per fc2 parameter) until its backward.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist

from agoq.formats import QuantFormat
from agoq.ops.fp8_linear import _gemm, _recast_t, _weight_fp8, _wgrad_dtype, fp8_cast_ops
from agoq.ops.fp8_scaling import SLOT_VARIANTS, FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache
from agoq.ops.saved_act import Key, SavedBytesCounter, _dequantize, quantize_saved

__all__ = ["smooth_swiglu_fp8_fc2", "swiglu_fp8_fc2", "fused_smooth_supported", "SmoothSwiGLUFP8Fc2", "SMOOTHING",
           "UNSMOOTH_MODES"]

# The op's modes: Smooth-SwiGLU per token / per channel, or plain SwiGLU (s = 1) for a plain FP8 fc2.
SMOOTHING = ("per_token", "per_channel", "none")

# Where the per-token un-smoothing y = (z @ W.T) * s happens (``smooth_swiglu_fp8_fc2(..., unsmooth=)``): "gemm" (the
# default, what agoq's MLP runs): fc2's forward GEMM is the row-wise torch._scaled_mm with scale_a = s * scale_inv
# (CUTLASS on sm_90, no extra pass); "epilogue": the tensor-wise GEMM (cuBLAS, as plain FP8) then y *= s in place (one
# pass over fc2's output; benchmarks/bench_fp8.py's A/B). Both exact for a power-of-two s up to the GEMM's rounding
# order; fp16 models always take "epilogue" (the row-wise GEMM returns bf16 only).
UNSMOOTH_MODES = ("gemm", "epilogue")


def fused_smooth_supported(recipe: FP8Recipe | None, h: torch.Tensor) -> bool:
    """The rule for the fused path (every mode, plain included): per-tensor delayed scaling and an fc1 output the
    kernels take (bf16 / fp16, contiguous, even width). Anything else runs the unfused (Smooth-)SwiGLU and FP8
    linear (the same math)."""
    if recipe is None or recipe.granularity != "tensor" or recipe.scaling != "delayed":
        return False
    width = h.shape[-1] if h.dim() else 0
    return h.dtype in (torch.bfloat16, torch.float16) and width > 0 and width % 2 == 0


@functools.lru_cache(maxsize=8)
def _impl(kind: str) -> SimpleNamespace:
    """amax / cast of agoq.kernels.smooth_swiglu_fp8 and the SwiGLU recompute / backward (Triton on CUDA; the
    agoq.ref twins elsewhere: identical signatures)."""
    if kind == "cuda":
        from agoq.kernels import smooth_swiglu_fp8 as k
        from agoq.kernels.swiglu import swiglu_bwd, swiglu_fwd

        return SimpleNamespace(amax=k.smooth_swiglu_amax, cast=k.smooth_swiglu_cast_delayed, fwd=swiglu_fwd,
                               bwd=swiglu_bwd)
    from agoq.ref import smooth_swiglu_fp8 as r
    from agoq.ref.swiglu import ref_swiglu_bwd_scaled, ref_swiglu_scaled

    return SimpleNamespace(amax=r.ref_smooth_swiglu_amax, cast=r.ref_smooth_swiglu_cast_delayed,
                           fwd=ref_swiglu_scaled, bwd=ref_swiglu_bwd_scaled)


class _SmoothCastOps:
    """``cast_ops`` for FP8ScalingState.cast_meta (slot x of fc2) whose "x" is the fc1 output: the fused
    smooth cast (``amax`` None: plain, s = 1); the first call of the slot (no history yet) bootstraps with
    current scaling of z."""

    def __init__(self, impl, base, amax: torch.Tensor, per_token: bool):
        self.impl, self.base, self.amax, self.per_token = impl, base, amax, per_token
        self.s = self.scale_a = None

    def cast_delayed(self, h, variant, meta, ws, margin, pow2, rowmajor, transposed, t_colmajor=False, new_meta=None):
        out, out_t, new, self.s, self.scale_a = self.impl.cast(
            h, self.amax, variant, meta, ws, margin, pow2, per_token=self.per_token, rowmajor=rowmajor,
            transposed=transposed, t_colmajor=t_colmajor, new_meta=new_meta)
        return out, out_t, new

    def cast_current(self, h, variant, margin, pow2, rowmajor, transposed, t_colmajor=False):
        from agoq.ref.smooth_swiglu_fp8 import ref_megatron_glu
        from agoq.ref.swiglu import pow2_ceil

        z = ref_megatron_glu(h)
        if self.amax is not None:
            self.s = pow2_ceil(self.amax)
            z = (z.float() / (self.s[:, None] if self.per_token else self.s[None, :])).to(h.dtype)
        out, out_t, meta = self.base.cast_current(z, variant, margin, pow2, rowmajor, transposed, t_colmajor)
        self.scale_a = (self.s * meta[0]).reshape(-1, 1) if self.per_token else None
        return out, out_t, meta


class _MulCastOps:
    """``cast_ops`` that cast x * mul (fp32 [R, 1] or [1, C]): fc2's gradient times the per-token s, or
    fc2's weight times the per-channel s (agoq.kernels.fp8_fused's ``mul``)."""

    def __init__(self, base, mul: torch.Tensor):
        self.base, self.mul = base, mul

    def cast_delayed(self, x, variant, meta, ws, margin, pow2, rowmajor, transposed, t_colmajor=False, new_meta=None):
        return self.base.cast_delayed(x, variant, meta, ws, margin, pow2, rowmajor, transposed, t_colmajor, new_meta,
                                      mul=self.mul)

    def cast_current(self, x, variant, margin, pow2, rowmajor, transposed, t_colmajor=False):
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32) * self.mul  # exact: mul is a power of two
        return self.base.cast_current(x2, variant, margin, pow2, rowmajor, transposed, t_colmajor)


class _WeightEntry:
    """fc2's FP8 weight for the fused op: agoq.ops.fp8_linear's _WeightFP8 (both layouts) and, per token,
    the forward GEMM's row-wise ``scale_b`` (the tensor inverse scale as [1, N])."""

    __slots__ = ("w", "row_scale_b")

    def __init__(self, w, row_scale_b):
        self.w, self.row_scale_b = w, row_scale_b


def _make_entry(weight, recipe, state, base, per_token: bool, s: torch.Tensor | None) -> _WeightEntry:
    ops = base if s is None else _MulCastOps(base, s.reshape(1, -1))  # W * s over W's input columns
    w = _weight_fp8(weight, recipe, state, ops, True)
    row_b = w.fwd_scale_inv.reshape(1, 1).expand(1, weight.shape[0]).contiguous() if per_token else None
    return _WeightEntry(w, row_b)


class SmoothSwiGLUFP8Fc2(torch.autograd.Function):
    """The op of :func:`smooth_swiglu_fp8_fc2` and :func:`swiglu_fp8_fc2` (module docstring); ``apply(h, weight,
    state, recipe, mode, tp_group, store, weight_cache, grad_enabled, unsmooth)``, ``mode`` one of :data:`SMOOTHING`,
    ``unsmooth`` one of :data:`UNSMOOTH_MODES`."""

    @staticmethod
    def forward(ctx, h, weight, state, recipe, mode, tp_group, store, weight_cache, grad_enabled, unsmooth="gemm"):
        h = h if h.is_contiguous() else h.contiguous()
        impl, base = _impl(h.device.type), fp8_cast_ops(h.device)
        per_token = mode == "per_token"
        amax = None if mode == "none" else impl.amax(h, per_token)
        if per_token and tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)  # TP-global s (exact un-smoothing)
        needs_wgrad = grad_enabled and ctx.needs_input_grad[1]
        keep_z = needs_wgrad and store is None
        smooth = _SmoothCastOps(impl, base, amax, per_token)
        z8, z8_t, meta_x, sx_inv = state.cast_meta("x", h, smooth, True, keep_z, True)
        s = smooth.s  # None in the plain mode
        col = s if mode == "per_channel" else None
        entry = weight_cache.get(weight, recipe, lambda w: _make_entry(w, recipe, state, base, per_token, col), col)
        out_shape = (*h.shape[:-1], weight.shape[0])
        # y = (z @ W.T) * s through the row-wise scale_a = s * scale_inv_z; it returns bf16 only, so an fp16 model
        # un-smooths after the tensor-wise GEMM (fp16 out, as the unfused path)
        if per_token and unsmooth == "gemm" and h.dtype == torch.bfloat16:
            y = _gemm(z8, entry.w.fwd_b, smooth.scale_a, entry.row_scale_b, torch.bfloat16,
                      recipe.fast_accum_forward, out_shape)
        else:  # the tensor-wise GEMM (per token then y *= s: a power of two, exact in the model dtype)
            y = _gemm(z8, entry.w.fwd_b, sx_inv, entry.w.fwd_scale_inv, h.dtype, recipe.fast_accum_forward, out_shape)
            if per_token:
                y.mul_(s.view(*out_shape[:-1], 1).to(y.dtype))
        if grad_enabled:
            saved_h = h
            if store is not None:
                fmt, key, counter = store
                ctx.h_q, saved_h = quantize_saved(h, fmt, key, counter), None
            ctx.state, ctx.recipe, ctx.base, ctx.impl, ctx.mode = state, recipe, base, impl, mode
            ctx.entry, ctx.cache, ctx.x_scales = entry, weight_cache, (sx_inv, meta_x)
            ctx.h_dtype, ctx.h_shape = h.dtype, h.shape
            ctx.save_for_backward(saved_h, weight, s, z8_t if keep_z else None)
        return y if y.dtype == h.dtype else y.to(h.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        h, weight, s, z_cm = ctx.saved_tensors
        state, recipe, base, impl, mode = ctx.state, ctx.recipe, ctx.base, ctx.impl, ctx.mode
        per_token = mode == "per_token"
        entry, ctx.entry = ctx.entry, None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = grad_y if grad_y.is_contiguous() else grad_y.contiguous()
        ops = _MulCastOps(base, s.reshape(-1, 1)) if per_token else base  # per token: cast g * s (un-smoothing)
        g8, g8_t, _, sg_inv = state.cast_meta("g", g, ops, need_dh, need_dw, False)
        h_shape = ctx.h_shape
        scale = s.reshape(*h_shape[:-1], 1) if per_token else s  # the forward's s, never recomputed (plain: None)
        swiglu_fwd, swiglu_bwd, src = impl.fwd, impl.bwd, h
        if h is None:  # activation storage: read the codes (one pass each) or dequantize once
            q, ctx.h_q = ctx.h_q, None
            swiglu_fwd, swiglu_bwd, src = _stored_swiglu(q, g.device.type, impl)
        dh = dw = None
        if need_dh:
            w = entry.w
            grad_z = _gemm(g8, w.dgrad_b, sg_inv, w.dgrad_scale_inv, g.dtype, False, None)
            dh = swiglu_bwd(src, grad_z.view(*h_shape[:-1], grad_z.shape[-1]), scale)
        if need_dw:
            sx_inv, meta_x = ctx.x_scales
            if z_cm is None:  # activation storage: z rebuilt from the stored h with the forward's s
                z_hat = swiglu_fwd(src, scale).reshape(-1, h_shape[-1] // 2).contiguous()
                z_cm = _recast_t(z_hat, "x", recipe, base, meta_x).t()
            dw = _wgrad(g8_t, z_cm, sg_inv, sx_inv, s if mode == "per_channel" else None, weight)
        if mode == "per_channel":
            ctx.cache.release(entry)  # this micro-batch's W * s: no later use
        return dh, dw, None, None, None, None, None, None, None, None


def _stored_swiglu(q, kind: str, impl):
    """(swiglu_fwd, swiglu_bwd, source) for a quantized fc1 output: the kernels that read the codes
    (agoq.kernels.swiglu_quant's dequant_swiglu_*, their agoq.ref twins on CPU) where the format and width
    allow, else the dequantized h (one [T, 2F] temporary) with the plain SwiGLU kernels."""
    width = q.shape[-1]
    if kind == "cuda":
        from agoq.kernels import swiglu_quant as k

        if q.dtype in k.DTYPES and q.fmt.kind in k.FUSED_KINDS and (width // 2) % q.fmt.block == 0:
            return k.dequant_swiglu_fwd, k.dequant_swiglu_bwd, q
        return impl.fwd, impl.bwd, _dequantize(q).reshape(q.shape).to(q.dtype)
    from agoq.ref.swiglu_quant import ref_dequant_swiglu_bwd, ref_dequant_swiglu_fwd

    return ref_dequant_swiglu_fwd, ref_dequant_swiglu_bwd, q


def _wgrad(g8_t, z_cm, sg_inv, sx_inv, col_scale, weight):
    """dW = Q(g).T @ Q(z) (scaled), times the per-channel s per input column when ``col_scale`` is given
    (d(W * s)/dW = s): for a bf16 weight inside the GEMM, as its row-wise ``scale_b = s * scale_inv_z``
    [1, F] (no pass over dW); else as the unfused op does (an fp32 product)."""
    if col_scale is None:
        dw = _gemm(g8_t, z_cm, sg_inv, sx_inv, _wgrad_dtype(weight), False, None)
    elif weight.dtype == torch.bfloat16:  # row-wise scaled_mm returns bf16 only
        scale_a = sg_inv.reshape(1, 1).expand(g8_t.shape[0], 1).contiguous()
        dw = _gemm(g8_t, z_cm, scale_a, (col_scale * sx_inv).reshape(1, -1), torch.bfloat16, False, None)
    else:
        dw = _gemm(g8_t, z_cm, sg_inv, sx_inv, _wgrad_dtype(weight), False, None).to(torch.float32) * col_scale
    return dw if dw.dtype == weight.dtype else dw.to(weight.dtype)


def smooth_swiglu_fp8_fc2(h: torch.Tensor, weight: torch.Tensor, state: FP8ScalingState, recipe: FP8Recipe, *,
                          per_token: bool, weight_cache: FP8WeightCache, tp_group: dist.ProcessGroup | None = None,
                          store: tuple[QuantFormat, Key, SavedBytesCounter | None] | None = None,
                          unsmooth: str = "gemm") -> torch.Tensor:
    """fc2's output (before its TP all-reduce) of Smooth-SwiGLU on the fc1 output ``h`` [T.., 2F] (module
    docstring). ``state``: fc2's delayed-scaling state (slots x = z, w, g); ``weight_cache``: an
    FP8WeightCache for this op only (its entries carry the row-wise scale / the folded per-channel s);
    ``tp_group``: the per-token amax is all-reduced over it; ``store``: keep only h quantized to
    ``fmt`` (activation storage) instead of h itself; ``unsmooth``: where the per-token un-smoothing runs
    (:data:`UNSMOOTH_MODES`; agoq's MLP runs the default)."""
    mode = "per_token" if per_token else "per_channel"
    return _apply(h, weight, state, recipe, mode, weight_cache, tp_group, store, unsmooth)


def swiglu_fp8_fc2(h: torch.Tensor, weight: torch.Tensor, state: FP8ScalingState, recipe: FP8Recipe, *,
                   weight_cache: FP8WeightCache,
                   store: tuple[QuantFormat, Key, SavedBytesCounter | None] | None = None) -> torch.Tensor:
    """fc2's output (before its TP all-reduce) of plain SwiGLU on the fc1 output ``h`` [T.., 2F]: Megatron's SwiGLU
    then the FP8 linear (agoq.ops.fp8_linear, delayed scaling) in one op, without smoothing (module docstring).
    ``state``, ``weight_cache``, ``store`` as :func:`smooth_swiglu_fp8_fc2` (``weight_cache`` for this op only:
    its entries are not agoq.ops.fp8_linear's); no TP reduction (one history per rank, as the FP8 linear)."""
    return _apply(h, weight, state, recipe, "none", weight_cache, None, store)


def _apply(h, weight, state, recipe, mode, weight_cache, tp_group, store, unsmooth: str = "gemm") -> torch.Tensor:
    if unsmooth not in UNSMOOTH_MODES:
        raise ValueError(f"un-smoothing mode {unsmooth!r}: use one of {UNSMOOTH_MODES}")
    if not fused_smooth_supported(recipe, h):
        unfused = "agoq.ops.smooth_swiglu" if mode != "none" else "Megatron's SwiGLU"
        raise ValueError(f"the fused SwiGLU + FP8 fc2 op ({mode}) needs per-tensor delayed scaling and a bf16/fp16 "
                         f"fc1 output with an even width, got {recipe} and {h.dtype} {tuple(h.shape)}; use the "
                         f"unfused {unfused} with agoq.ops.fp8_linear")
    if weight.dim() != 2 or 2 * weight.shape[1] != h.shape[-1]:
        raise ValueError(f"fc2 weight {tuple(weight.shape)} does not take the SwiGLU of fc1 output {tuple(h.shape)} "
                         "(expected [H, F] for h [..., 2F])")
    state.check_device(h)
    if SLOT_VARIANTS["x"] != "e4m3":
        raise AssertionError("fc2's input slot must be E4M3 (the row-wise GEMM's operand b)")
    grad_enabled = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return SmoothSwiGLUFP8Fc2.apply(h, weight, state, recipe, mode, tp_group, store, weight_cache, grad_enabled,
                                    unsmooth)
