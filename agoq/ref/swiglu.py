"""Reference SwiGLU and Smooth-SwiGLU (FP8 paper, arXiv 2409.12517), plain PyTorch.

Layout as in Megatron's fused fc1: ``fc1_out = [gate | up]`` along the last dimension (2F wide);
``swiglu(fc1_out) = silu(gate) * up`` (F wide) is the input of fc2 (weight [H, F], y = z @ W.T).
Legend: T = tokens (all leading dimensions), F = FFN hidden width (per TP rank), H = model width.

Smooth-SwiGLU divides the SwiGLU output by a scale ``s`` before fc2's FP8 cast and undoes it after,
so the function is unchanged (exactly, in fp32, when s is a power of two; default):

  per_token    (authors' code, ``ScaledSwiglu``): s_T1 = max_f |up[t, f]| (one scale per token);
               z = swiglu / s, and fc2's output is multiplied by s (a per-token factor commutes
               with the GEMM over F).
  per_channel  (paper text): s_F = max_t |swiglu[t, i]| (one scale per FFN channel); z = swiglu / s,
               and column i of fc2's weight is multiplied by s_i (W' = W * s), the contraction
               dimension, so z @ W'.T = swiglu @ W.T.

The paper leaves the exact per-channel rule open (arXiv 2409.12517); we normalise the quantity
that is cast (the SwiGLU output), so each channel's max maps to at most 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from agoq.ref.fp8 import FORWARD_VARIANT, ref_fp8_qdq

__all__ = [
    "SMOOTH_MODES",
    "ref_swiglu",
    "ref_swiglu_bwd",
    "ref_swiglu_bwd_scaled",
    "ref_swiglu_scaled",
    "pow2_ceil",
    "finish_smooth_scale",
    "smooth_scale_per_token",
    "smooth_scale_per_channel",
    "ref_smooth_swiglu_per_token",
    "ref_smooth_swiglu_per_channel",
    "ref_fp8_qdq_fc2_input",
    "ref_smooth_swiglu_fc2",
]

SMOOTH_MODES = ("none", "per_token", "per_channel")


def _split(fc1_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if fc1_out.shape[-1] % 2:
        raise ValueError(f"fc1 output width {fc1_out.shape[-1]} is odd; SwiGLU needs [gate | up] of equal widths")
    gate, up = fc1_out.chunk(2, dim=-1)
    return gate, up


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (so gradcheck can run on the references)."""
    return torch.promote_types(x.dtype, torch.float32)


def ref_swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 (fp64 for fp64 input) and returned in fc1_out's dtype."""
    gate, up = _split(fc1_out.to(_compute_dtype(fc1_out)))
    return (F.silu(gate) * up).to(fc1_out.dtype)


def ref_swiglu_bwd(fc1_out: torch.Tensor, grad_z: torch.Tensor) -> torch.Tensor:
    """d loss / d fc1_out for z = swiglu(fc1_out): [grad * up * silu'(gate) | grad * silu(gate)].

    silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
    """
    gate, up = _split(fc1_out.to(_compute_dtype(fc1_out)))
    g32 = grad_z.to(gate.dtype)
    sig = torch.sigmoid(gate)
    d_gate = g32 * up * sig * (1 + gate * (1 - sig))
    d_up = g32 * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(fc1_out.dtype)


def ref_swiglu_scaled(fc1_out: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """z = silu(gate) * up / s in fp32 (fp64 for fp64), one rounding to fc1_out's dtype; s as in
    ref_swiglu_bwd_scaled. The executable spec of agoq.kernels.swiglu.swiglu_fwd."""
    gate, up = _split(fc1_out.to(_compute_dtype(fc1_out)))
    z = F.silu(gate) * up
    if s is not None:
        z = z / s.to(z.dtype)
    return z.to(fc1_out.dtype)


def ref_swiglu_bwd_scaled(fc1_out: torch.Tensor, grad_z: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d fc1_out for z = swiglu(fc1_out) / s (s: None, per-token [T.., 1] or per-channel [F], fp32).

    The executable spec of agoq.kernels.swiglu.swiglu_bwd: all math in fp32 from the stored dtypes
    (grad_z / s first, then ref_swiglu_bwd's formula), one rounding to fc1_out's dtype at the end.
    """
    g32 = grad_z.to(_compute_dtype(grad_z))
    if s is not None:
        g32 = g32 / s.to(g32.dtype)
    return ref_swiglu_bwd(fc1_out, g32)


def pow2_ceil(x_f32: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (elementwise, x > 0, fp32 exact via frexp); 0 -> 1; inf/NaN kept."""
    x = x_f32.to(torch.float32)
    mantissa, exponent = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    out = torch.ldexp(torch.ones_like(x), exponent)
    out = torch.where(torch.isfinite(x), out, x)
    return torch.where(x == 0, torch.ones_like(x), out)


def finish_smooth_scale(amax_f32: torch.Tensor, pow2: bool) -> torch.Tensor:
    """Scale from a max: pow2 ceil (exact rescale) or the max itself; an all-zero max gives 1."""
    if pow2:
        return pow2_ceil(amax_f32)
    return torch.where(amax_f32 == 0, torch.ones_like(amax_f32), amax_f32)


def smooth_scale_per_token(fc1_out: torch.Tensor, pow2: bool = True) -> torch.Tensor:
    """Per-token scale [..., 1] (fp32): max |up| over the (local) FFN dimension, as the authors' code."""
    _, up = _split(fc1_out.detach())
    return finish_smooth_scale(up.abs().amax(dim=-1, keepdim=True).to(torch.float32), pow2)


def smooth_scale_per_channel(fc1_out: torch.Tensor, pow2: bool = True) -> torch.Tensor:
    """Per-channel scale [F] (fp32): max |swiglu| over all tokens (every leading dimension)."""
    z = ref_swiglu(fc1_out.detach().to(torch.float32))
    return finish_smooth_scale(z.reshape(-1, z.shape[-1]).abs().amax(dim=0), pow2)


def ref_smooth_swiglu_per_token(fc1_out: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, s): z = swiglu / s in fc1_out's dtype, s [..., 1] fp32; fc2's output must be multiplied by s."""
    s = smooth_scale_per_token(fc1_out, pow2)
    return (ref_swiglu(fc1_out.to(torch.float32)) / s).to(fc1_out.dtype), s


def ref_smooth_swiglu_per_channel(fc1_out: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, s): z = swiglu / s in fc1_out's dtype, s [F] fp32; fc2's weight columns must be multiplied by s."""
    s = smooth_scale_per_channel(fc1_out, pow2)
    return (ref_swiglu(fc1_out.to(torch.float32)) / s).to(fc1_out.dtype), s


def ref_fp8_qdq_fc2_input(z: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize of fc2's input with per-tensor current scaling (fp32 result)."""
    return ref_fp8_qdq(z, FORWARD_VARIANT)


def ref_smooth_swiglu_fc2(fc1_out: torch.Tensor, fc2_weight: torch.Tensor, mode: str,
                          fc2_input_qdq: Callable[[torch.Tensor], torch.Tensor] | None = None,
                          pow2: bool = True) -> torch.Tensor:
    """fc2(swiglu(fc1_out)) in fp32 with the given smoothing ``mode``; ``fc2_input_qdq`` (e.g.
    :func:`ref_fp8_qdq_fc2_input`) is applied to the tensor fc2 actually consumes (z)."""
    if mode not in SMOOTH_MODES:
        raise ValueError(f"smoothing mode {mode!r}: use one of {SMOOTH_MODES}")
    qdq = fc2_input_qdq if fc2_input_qdq is not None else (lambda t: t)
    x32, w32 = fc1_out.to(torch.float32), fc2_weight.to(torch.float32)
    if mode == "none":
        return qdq(ref_swiglu(x32)) @ w32.t()
    if mode == "per_token":
        z, s = ref_smooth_swiglu_per_token(x32, pow2)
        return (qdq(z) @ w32.t()) * s
    z, s = ref_smooth_swiglu_per_channel(x32, pow2)
    return qdq(z) @ (w32 * s).t()
