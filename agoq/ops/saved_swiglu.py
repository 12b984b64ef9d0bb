"""SwiGLU that stores only its quantized input (the fc1 output) and recomputes in backward (AGoQ,
arXiv 2605.00539), with the Smooth-SwiGLU variant (FP8 paper, arXiv 2409.12517).

Its output can be handed to fc2 as a :class:`~agoq.ops.saved_act.RecomputeStash`, so fc2 stores nothing: its
input is rebuilt from the same quantized tensor. The norm half of the same idea is :mod:`agoq.ops.saved_norm`;
the shared pieces (quantized saves, the stash, byte accounting, device dispatch) are :mod:`agoq.ops.saved_act`.

Fused path (CUDA, no GLU offset, a shape :mod:`agoq.kernels.swiglu_quant` takes): one kernel writes the output
and the codes; the recompute and the backward read the codes directly. Elsewhere the reference ops of
:func:`swiglu_reference` run, with the quantization of :func:`agoq.ops.saved_act.quant_ops`.

Shape legend: T = tokens (any leading dims), F2 = 2 x FFN (SwiGLU input width).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from agoq.formats import QuantFormat
from agoq.ops.saved_act import Key, RecomputeStash, SavedBytesCounter, eager_under_compile, quantize_saved

__all__ = ["smooth_swiglu_saving_input", "swiglu_reference", "swiglu_saving_input"]


def swiglu_reference(h_TF2: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """Megatron's unfused gated linear unit for SwiGLU: silu(gate) * (up + offset), gate first."""
    gate, up = torch.chunk(h_TF2, 2, dim=-1)
    return F.silu(gate) * (up + offset if offset else up)  # no extra pass (and Megatron's -0.0) at offset 0


def _swiglu_fused(h_TF2: torch.Tensor, fmt: QuantFormat, offset: float, fuse: bool = True) -> bool:
    """``fuse``, CUDA, no GLU offset, and a shape / format agoq.kernels.swiglu_quant takes (its ``fusable``).
    ``fuse=False``: the unfused quantize + ATen SwiGLU path (benchmarks' A/B; tests)."""
    if not (fuse and h_TF2.is_cuda) or offset:
        return False
    from agoq.kernels.swiglu_quant import fusable

    return fusable(h_TF2, fmt)


_NO_GRADS = (None,) * 7  # _SwiGLUSavingInput.forward's arguments after h_TF2


class _SwiGLUSavingInput(torch.autograd.Function):
    """z = swiglu(h) [/ s], storing only quantized h (the fc1 output); backward recomputes SwiGLU.

    With Smooth-SwiGLU, ``scale_fn(h, swiglu(h)) -> s`` (no grad) is called once in forward; that s
    divides the output, is kept, and is the one used by the recompute and by backward (never
    recomputed from the dequantized h: the scale the forward applied is the one its gradient needs).

    Fused path (CUDA, :func:`_swiglu_fused`): the forward is one kernel that writes z (Megatron's
    values) and the codes of h (``swiglu_quantize``; with Smooth-SwiGLU the quantize is the plain one,
    s needs the SwiGLU output first); the recompute for fc2 and the backward read the codes directly
    (``dequant_swiglu_fwd`` / ``dequant_swiglu_bwd``), so no dequantized h is ever materialized."""

    @staticmethod
    def forward(ctx, h_TF2, offset, fmt, key, counter, scale_fn, out, fuse=True):
        fused = _swiglu_fused(h_TF2, fmt, offset, fuse)
        s = None
        if fused and scale_fn is None:
            from agoq.kernels.swiglu_quant import swiglu_quantize

            z_TF, q = swiglu_quantize(h_TF2, fmt)
            if counter is not None:
                counter.add(key, q)
        else:
            glu_TF = swiglu_reference(h_TF2, offset)
            s = None if scale_fn is None else scale_fn(h_TF2, glu_TF)
            z_TF = glu_TF if s is None else glu_TF / s.to(glu_TF.dtype)
            q = quantize_saved(h_TF2, fmt, key, counter)
        stash = RecomputeStash(q, _swiglu_recompute(offset, s, fused), from_codes=fused)
        stash.output_ptr = z_TF.data_ptr()
        out.append(stash)
        out.append(s)
        ctx.stash, ctx.offset, ctx.scale, ctx.fused = stash, offset, s, fused
        return z_TF

    @staticmethod
    def backward(ctx, grad_z_TF):
        stash, ctx.stash = ctx.stash, None
        if ctx.fused:
            from agoq.kernels.swiglu_quant import dequant_swiglu_bwd

            return dequant_swiglu_bwd(stash.consume_codes(), grad_z_TF, ctx.scale), *_NO_GRADS
        h_hat = stash.consume()
        if h_hat.is_cuda and not ctx.offset:
            # One fused pass (agoq.kernels.swiglu, fp32 math, its reference is ref_swiglu_bwd_scaled)
            # instead of autograd re-running chunk/silu/mul and their backwards and a cat.
            from agoq.kernels.swiglu import swiglu_bwd

            return swiglu_bwd(h_hat, grad_z_TF, ctx.scale), *_NO_GRADS
        with torch.enable_grad():
            h = h_hat.detach().requires_grad_(True)
            z = _smoothed(swiglu_reference(h, ctx.offset), ctx.scale)
            (grad_h,) = torch.autograd.grad(z, (h,), grad_z_TF)
        return grad_h, *_NO_GRADS


def _swiglu_recompute(offset: float, s: torch.Tensor | None, from_codes: bool) -> Callable:
    """fc2's input rebuilt in backward: from the codes in one pass (``dequant_swiglu_fwd``) on the fused
    path; else from the dequantized fc1 output with one Triton pass on CUDA (agoq.kernels.swiglu.swiglu_fwd,
    fp32 math), Megatron's ops elsewhere or with an offset."""
    if from_codes:
        from agoq.kernels.swiglu_quant import dequant_swiglu_fwd

        return lambda q: dequant_swiglu_fwd(q, s)

    def forward_fn(h_hat_TF2: torch.Tensor) -> torch.Tensor:
        if h_hat_TF2.is_cuda and not offset:
            from agoq.kernels.swiglu import swiglu_fwd

            return swiglu_fwd(h_hat_TF2, s)
        return _smoothed(swiglu_reference(h_hat_TF2, offset), s)

    return forward_fn


def _smoothed(glu: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """glu / s in glu's dtype (s a power of two: exact), or glu unchanged without a scale."""
    return glu if s is None else glu / s.to(glu.dtype)


def swiglu_saving_input(h_TF2: torch.Tensor, fmt: QuantFormat, key: Key, counter: SavedBytesCounter | None = None,
                        offset: float = 0.0, *, fuse: bool = True) -> tuple[torch.Tensor, RecomputeStash | None]:
    """SwiGLU with Megatron's forward values; keeps ``fmt``-quantized h only. Returns (z, stash).

    ``fuse=False`` takes the unfused quantize + ATen SwiGLU path on CUDA too (an A/B of benchmarks)."""
    if not (torch.is_grad_enabled() and h_TF2.requires_grad):
        return swiglu_reference(h_TF2, offset), None  # nothing is saved
    if torch.compiler.is_compiling():
        return _swiglu_saving_input_eager(h_TF2, fmt, key, counter, offset, fuse=fuse)
    out: list = []
    z_TF = _SwiGLUSavingInput.apply(h_TF2, offset, fmt, key, counter, None, out, fuse)
    return z_TF, out[0]


def smooth_swiglu_saving_input(h_TF2: torch.Tensor, scale_fn: Callable, fmt: QuantFormat, key: Key,
                               counter: SavedBytesCounter | None = None, *, fuse: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor, RecomputeStash | None]:
    """Smooth-SwiGLU z = swiglu(h) / s with s = ``scale_fn(h, swiglu(h))``, keeping ``fmt``-quantized h
    only (SwiGLU recomputed in backward with the forward's s). Returns (z, s, stash)."""
    if not (torch.is_grad_enabled() and h_TF2.requires_grad):
        with torch.no_grad():
            glu = swiglu_reference(h_TF2)
            s = scale_fn(h_TF2, glu)
        return _smoothed(glu, s), s, None
    if torch.compiler.is_compiling():
        return _smooth_swiglu_saving_input_eager(h_TF2, scale_fn, fmt, key, counter, fuse=fuse)
    out: list = []
    z_TF = _SwiGLUSavingInput.apply(h_TF2, 0.0, fmt, key, counter, scale_fn, out, fuse)
    return z_TF, out[1], out[0]


_swiglu_saving_input_eager = eager_under_compile(
    swiglu_saving_input, "SwiGLU saving its quantized input (byte counter, recompute stash for linear_fc2)")
_smooth_swiglu_saving_input_eager = eager_under_compile(
    smooth_swiglu_saving_input, "Smooth-SwiGLU saving its quantized input (byte counter, recompute stash)")
