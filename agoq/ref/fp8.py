"""Reference FP8 casting and a simulated (quantize-dequantize) FP8 linear, in plain PyTorch.

This is the executable spec of :mod:`agoq.ops.fp8_linear`: the same casts, the same scales, but
the GEMMs run on the dequantized values in fp32 instead of ``torch._scaled_mm``. It runs on CPU.

Conventions (as Transformer Engine and torchao): a **scale** multiplies the high-precision tensor
into the FP8 range, ``x_fp8 = sat(RNE(x * scale))``; its inverse ``1 / scale`` is what
``torch._scaled_mm`` takes as ``scale_a`` / ``scale_b``. Recipe of the FP8 paper (arXiv
2409.12517): E4M3 for the forward operands (input, weight), E5M2 for the output gradient.

Granularity:
  tensor  one fp32 scale per tensor (0-dim).
  row     one scale per row of the GEMM operand along the contraction dimension: forward x [M,1]
          and w [N,1]; backward dgrad needs g per row [M,1] and w per *column* [1,K], wgrad needs
          g per column [1,N] and x per column [1,K] (the contraction dimension changes, so each
          operand is cast again along the other axis; torchao's rowwise recipe does the same).

Scale from amax: ``scale = FP8_MAX / amax / 2**margin`` (optionally rounded down to a power of two,
as the FP8 paper's code does); ``amax == 0`` gives scale 1 (the tensor is all zeros); a non-finite
amax gives a NaN scale so the NaN reaches the output (nothing silent, docs/numerics.md).
"""

from __future__ import annotations

import torch

from agoq.formats import FP8_MAX

__all__ = [
    "FP8_DTYPES",
    "fp8_scale_from_amax",
    "fp8_amax",
    "ref_fp8_cast",
    "ref_fp8_qdq",
    "ref_fp8_linear",
    "ref_fp8_linear_fwd",
    "ref_fp8_linear_bwd",
    "ref_fp8_amax_2d",
    "ref_fp8_scales",
    "ref_fp8_cast_2d",
    "ref_fp8_history_update",
    "ref_fp8_cast_delayed_2d",
    "ref_fp8_cast_current_2d",
]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORWARD_VARIANT = "e4m3"  # the FP8 paper's recipe: E4M3 forward (weights and activations)
BACKWARD_VARIANT = "e5m2"  # the FP8 paper's recipe: E5M2 backward (gradients)
GRANULARITIES = ("tensor", "row")


def fp8_scale_from_amax(amax_f32: torch.Tensor, variant: str, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """fp32 scale(s) mapping |x| <= amax onto the FP8 range (any shape; elementwise)."""
    if variant not in FP8_DTYPES:
        raise ValueError(f"FP8 variant {variant!r} unknown; use one of {sorted(FP8_DTYPES)}")
    amax = amax_f32.to(torch.float32)
    ratio = torch.full_like(amax, FP8_MAX[variant] / 2.0**margin) / amax
    if pow2:
        mantissa, exponent = torch.frexp(ratio)  # ratio = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
        ratio = torch.where(torch.isfinite(ratio) & (ratio > 0), torch.ldexp(torch.ones_like(mantissa), exponent - 1),
                            ratio)
    scale = torch.where(amax == 0, torch.ones_like(ratio), ratio)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def fp8_amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| as fp32: over everything (0-dim) or along ``dim`` (kept as a size-1 dimension).

    The inf-norm is one reduction kernel without an |x| temporary, and exact (a max of magnitudes).
    """
    amax = torch.linalg.vector_norm(x.detach(), float("inf"), dim=dim, keepdim=dim is not None)
    return amax.to(torch.float32)


def ref_fp8_cast(x: torch.Tensor, scale_f32: torch.Tensor, variant: str) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of ``x * scale`` (fp32 product) to the FP8 dtype.

    The clamp matters: torch's cast does not saturate in general (e5m2 overflows to inf), while
    delayed scaling expects saturation (an amax that grew since the scale was chosen).
    A 0-dim scale is viewed as 1-element so type promotion makes the product fp32 in one kernel
    (a 0-dim fp32 tensor would leave a bf16 product) and the clamp runs in place.
    """
    fmax = FP8_MAX[variant]
    scale = scale_f32.reshape(1) if scale_f32.dim() == 0 else scale_f32
    product_f32 = x * scale.to(torch.float32)
    if product_f32.dtype != torch.float32:  # fp64 x: keep the fp32 product semantics
        product_f32 = product_f32.to(torch.float32)
    return product_f32.clamp_(-fmax, fmax).to(FP8_DTYPES[variant])


def ref_fp8_qdq(x: torch.Tensor, variant: str, dim: int | None = None, scale_f32: torch.Tensor | None = None,
                margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """Quantize-dequantize to FP8 (fp32 result): current scaling from amax over all (dim=None) or per ``dim``."""
    if scale_f32 is None:
        scale_f32 = fp8_scale_from_amax(fp8_amax(x, dim), variant, margin, pow2)
    return ref_fp8_cast(x, scale_f32, variant).to(torch.float32) / scale_f32


# ------------------------------------------------------------------ twins of agoq.kernels.fp8 ----
# The fused Triton casts of agoq/kernels/fp8.py have these exact signatures and results (codes equal
# on GPU; see tests/kernels/test_fp8_kernels.py). x2d is a 2-D [M, N] tensor (bf16/fp16/fp32).


def ref_fp8_amax_2d(x2d: torch.Tensor, rowcol: bool = False):
    """max |x| as fp32: ``rowcol=False`` one value (0-dim); ``rowcol=True`` (per row [M], per column [N]).

    NaN anywhere in the reduced set gives NaN (nothing silent); an empty set gives 0.
    """
    if x2d.dim() != 2:
        raise ValueError(f"ref_fp8_amax_2d takes a 2-D tensor, got shape {tuple(x2d.shape)}")
    if not rowcol:
        return fp8_amax(x2d) if x2d.numel() else torch.zeros((), dtype=torch.float32, device=x2d.device)
    m, n = x2d.shape
    if x2d.numel() == 0:
        return (torch.zeros(m, dtype=torch.float32, device=x2d.device),
                torch.zeros(n, dtype=torch.float32, device=x2d.device))
    return fp8_amax(x2d, dim=1).reshape(m), fp8_amax(x2d, dim=0).reshape(n)


def ref_fp8_scales(amax_f32: torch.Tensor, variant: str, margin: int = 0,
                   pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale) from amax (any shape): :func:`fp8_scale_from_amax` and its reciprocal, the
    inverse scale ``torch._scaled_mm`` takes."""
    scale = fp8_scale_from_amax(amax_f32, variant, margin, pow2)
    return scale, scale.reciprocal()


def ref_fp8_cast_2d(x2d: torch.Tensor, variant: str, scale_f32: torch.Tensor, scale_t_f32: torch.Tensor | None = None,
                    *, rowmajor: bool = True, transposed: bool = False, record_amax: bool = False,
                    amax_out: torch.Tensor | None = None):
    """Cast x2d [M, N] to FP8 in the layouts a GEMM needs: ``(out, out_t, amax)``.

    out    [M, N] = sat(RNE(x * scale)), scale 0-dim or per row [M, 1]      (None unless rowmajor)
    out_t  [N, M] = sat(RNE(x * scale_t)).T, contiguous, scale_t 0-dim or per column [1, N]
           (None unless transposed; scale_t None means scale, which must then be 0-dim)
    amax   max |x| (0-dim fp32, :func:`ref_fp8_amax_2d`) when record_amax (delayed scaling records
           the amax of the tensor it casts with an older scale), else None. With ``amax_out`` (a 0-dim
           fp32 accumulator, >= 0 or NaN) the amax is max-accumulated into it in place and returned.
    """
    if x2d.dim() != 2:
        raise ValueError(f"ref_fp8_cast_2d takes a 2-D tensor, got shape {tuple(x2d.shape)}")
    m, n = x2d.shape
    if scale_t_f32 is None:
        if scale_f32.dim() != 0:
            raise ValueError("scale_t is required when scale is per row (the transposed copy is scaled per column)")
        scale_t_f32 = scale_f32
    if scale_f32.shape not in ((), (m, 1)) or scale_t_f32.shape not in ((), (1, n)):
        raise ValueError(f"scale {tuple(scale_f32.shape)} must be () or ({m}, 1) and scale_t "
                         f"{tuple(scale_t_f32.shape)} () or (1, {n}) for x {tuple(x2d.shape)}")
    if amax_out is not None and (not record_amax or amax_out.shape != () or amax_out.dtype != torch.float32):
        raise ValueError("amax_out must be a 0-dim float32 accumulator and needs record_amax=True")
    out = ref_fp8_cast(x2d, scale_f32, variant) if rowmajor else None
    out_t = ref_fp8_cast(x2d, scale_t_f32, variant).t().contiguous() if transposed else None
    amax = ref_fp8_amax_2d(x2d) if record_amax else None
    if amax_out is not None:
        amax = amax_out.copy_(torch.maximum(amax_out, amax))  # NaN-propagating, as the kernel's bit max
    return out, out_t, amax


def ref_fp8_history_update(history_f32: torch.Tensor, amax_f32: torch.Tensor, variant: str, margin: int = 0,
                           pow2: bool = False, reset_amax: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delayed scaling: push ``amax`` into the history (newest first, oldest dropped) and return
    ``(new_history, scale, 1 / scale)`` with scale from the new history's max |.| (NaN-propagating).
    New tensors; only ``reset_amax`` writes (zeroes the amax accumulator for its next use)."""
    if history_f32.dim() != 1 or history_f32.numel() < 1 or amax_f32.numel() != 1:
        raise ValueError(f"history must be 1-D non-empty and amax one value, got {tuple(history_f32.shape)} "
                         f"and {tuple(amax_f32.shape)}")
    if reset_amax and amax_f32.dtype != torch.float32:
        raise ValueError("reset_amax needs the amax accumulator itself (contiguous float32), not a converted copy")
    new = torch.cat([amax_f32.reshape(1).to(torch.float32), history_f32[:-1].to(torch.float32)])
    if reset_amax:
        amax_f32.zero_()
    scale = fp8_scale_from_amax(new.abs().amax(), variant, margin, pow2)
    return new, scale, scale.reciprocal()


# ----------------------------------------------------------- twins of agoq.kernels.fp8_fused ----
# One fp32 vector per tensor slot, ``meta = [scale_inv, scale, 0, 0, amax_history (L, newest first)]``
# (current scaling: L = 1, the tensor's own amax); see agoq/kernels/fp8_fused.py.
META_HEADER = 4


def _meta(scale: torch.Tensor, scale_inv: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros(2, dtype=torch.float32, device=history.device)
    return torch.cat([scale_inv.reshape(1), scale.reshape(1), zero, history.reshape(-1).to(torch.float32)])


def ref_fp8_cast_delayed_2d(x2d: torch.Tensor, variant: str, meta: torch.Tensor, workspace: torch.Tensor,
                            margin: int = 0, pow2: bool = False, *, rowmajor: bool = True, transposed: bool = False,
                            mul: torch.Tensor | None = None):
    """Delayed scaling in one call: cast x2d with ``meta[1]`` (the scale from the previous amaxes) and
    push its amax: ``(out, out_t, new_meta)``, ``new_meta = [1 / scale', scale', 0, 0, amax,
    history[:-1]]`` (:func:`ref_fp8_history_update`). ``meta`` is not modified; ``workspace`` (the
    kernel's int32 [2] accumulator, zero between calls) is not used here. ``mul`` (fp32 [M, 1] per row
    or [1, N] per column): cast and record ``x * mul`` (the fp32 product) instead of x."""
    if meta.dim() != 1 or meta.numel() <= META_HEADER:
        raise ValueError(f"meta must be an fp32 [4 + L] vector (L >= 1), got {tuple(meta.shape)}")
    if mul is not None:
        if mul.dtype != torch.float32 or mul.shape not in ((x2d.shape[0], 1), (1, x2d.shape[1])):
            raise ValueError(f"mul must be fp32 ({x2d.shape[0]}, 1) or (1, {x2d.shape[1]}), got {mul.dtype} "
                             f"{tuple(mul.shape)}")
        x2d = x2d.to(torch.float32) * mul
    out, out_t, amax = ref_fp8_cast_2d(x2d, variant, meta[1].to(torch.float32), rowmajor=rowmajor,
                                       transposed=transposed, record_amax=True)
    history, scale, scale_inv = ref_fp8_history_update(meta[META_HEADER:], amax, variant, margin, pow2)
    return out, out_t, _meta(scale, scale_inv, history)


def ref_fp8_cast_current_2d(x2d: torch.Tensor, variant: str, margin: int = 0, pow2: bool = False, *,
                            rowmajor: bool = True, transposed: bool = False):
    """Current scaling in one call: ``(out, out_t, meta)`` with ``meta = [scale_inv, scale, 0, 0, amax]``
    from x2d's own amax (:func:`ref_fp8_amax_2d`, :func:`ref_fp8_scales`, :func:`ref_fp8_cast_2d`)."""
    amax = ref_fp8_amax_2d(x2d)
    scale, scale_inv = ref_fp8_scales(amax, variant, margin, pow2)
    out, out_t, _ = ref_fp8_cast_2d(x2d, variant, scale, rowmajor=rowmajor, transposed=transposed)
    return out, out_t, _meta(scale, scale_inv, amax)


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}: use one of {GRANULARITIES}")


def ref_fp8_linear_fwd(x: torch.Tensor, weight: torch.Tensor, granularity: str = "tensor",
                       x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                       margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """y = Q(x) @ Q(w).T in fp32 (E4M3), returned in x's dtype; x [..., K], weight [N, K].

    Scales: given (per-tensor delayed scaling) or current (None). Row granularity: x per token,
    w per output channel (current scaling only).
    """
    _check_granularity(granularity)
    x2 = x.reshape(-1, x.shape[-1])
    dim = 1 if granularity == "row" else None
    xq = ref_fp8_qdq(x2, FORWARD_VARIANT, dim, x_scale, margin, pow2)
    wq = ref_fp8_qdq(weight, FORWARD_VARIANT, dim, w_scale, margin, pow2)
    return (xq @ wq.t()).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def ref_fp8_linear_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, granularity: str = "tensor",
                       x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                       g_scale: torch.Tensor | None = None, margin: int = 0,
                       pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the FP8 linear: dx = Q5(g) @ Q4(w), dw = Q5(g).T @ Q4(x), fp32 GEMMs.

    tensor: the forward's x / w scales are reused (the op saves x_fp8 and re-casts w with the same
    scale); row: each operand is scaled along the backward GEMM's contraction dimension.
    """
    _check_granularity(granularity)
    g2 = grad_y.reshape(-1, grad_y.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if granularity == "tensor":
        gq = ref_fp8_qdq(g2, BACKWARD_VARIANT, None, g_scale, margin, pow2)
        xq = ref_fp8_qdq(x2, FORWARD_VARIANT, None, x_scale, margin, pow2)
        wq = ref_fp8_qdq(weight, FORWARD_VARIANT, None, w_scale, margin, pow2)
        dx, dw = gq @ wq, gq.t() @ xq
    else:
        dx = ref_fp8_qdq(g2, BACKWARD_VARIANT, 1, None, margin, pow2) @ ref_fp8_qdq(
            weight, FORWARD_VARIANT, 0, None, margin, pow2)
        dw = ref_fp8_qdq(g2, BACKWARD_VARIANT, 0, None, margin, pow2).t() @ ref_fp8_qdq(
            x2, FORWARD_VARIANT, 0, None, margin, pow2)
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype)


class _RefFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, granularity, x_scale, w_scale, g_scale, margin, pow2):
        if granularity == "tensor":  # fix the current scales now so backward reuses the forward's
            x_scale = fp8_scale_from_amax(fp8_amax(x), FORWARD_VARIANT, margin, pow2) if x_scale is None else x_scale
            w_scale = (fp8_scale_from_amax(fp8_amax(weight), FORWARD_VARIANT, margin, pow2)
                       if w_scale is None else w_scale)
        ctx.save_for_backward(x, weight)
        ctx.args = (granularity, x_scale, w_scale, g_scale, margin, pow2)
        return ref_fp8_linear_fwd(x, weight, granularity, x_scale, w_scale, margin, pow2)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        granularity, x_scale, w_scale, g_scale, margin, pow2 = ctx.args
        dx, dw = ref_fp8_linear_bwd(grad_y, x, weight, granularity, x_scale, w_scale, g_scale, margin, pow2)
        return dx, dw, None, None, None, None, None, None


def ref_fp8_linear(x: torch.Tensor, weight: torch.Tensor, granularity: str = "tensor",
                   x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                   g_scale: torch.Tensor | None = None, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """Differentiable simulated FP8 linear (no bias): forward :func:`ref_fp8_linear_fwd`, backward
    :func:`ref_fp8_linear_bwd`. Scales None mean current scaling; row granularity takes no scales."""
    _check_granularity(granularity)
    if granularity == "row" and any(s is not None for s in (x_scale, w_scale, g_scale)):
        raise ValueError("row granularity uses current scaling only; pass no x_scale / w_scale / g_scale")
    return _RefFP8Linear.apply(x, weight, granularity, x_scale, w_scale, g_scale, margin, pow2)
