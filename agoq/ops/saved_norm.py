"""RMSNorm that stores only its quantized input for backward (AGoQ, arXiv 2605.00539: the norm is recomputed)
and hands the next linear a :class:`~agoq.ops.saved_act.RecomputeStash`, so that linear stores nothing.

One implementation, agoq's autograd function :class:`_RMSNormSavingInput` (public mechanisms only:
``ctx.save_for_backward`` and a stash on ``ctx``). A variant hooking ``F.rms_norm``'s own ATen node through its private
``_raw_saved_*`` attributes measured within noise of it in whole steps and was deleted.

Shape legend: T = tokens (any leading dims), H = hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from agoq.formats import QuantFormat
from agoq.ops.saved_act import (
    Key,
    RecomputeStash,
    SavedBytesCounter,
    eager_under_compile,
    quantize_saved,
)

__all__ = ["rmsnorm_saving_input", "rmsnorm_backward", "rmsnorm_recompute"]

# ATen's fused RMSNorm, called without the Python dispatch of torch.ops where torch exposes a binding
_fused_rms_norm = getattr(torch, "_fused_rms_norm", None) or torch.ops.aten._fused_rms_norm
_fused_rms_norm_backward = torch.ops.aten._fused_rms_norm_backward.default  # the overload, resolved once


class _RMSNormSavingInput(torch.autograd.Function):
    """y = rms_norm(x) * w, storing only quantized x; backward recomputes the norm from x_hat."""

    @staticmethod
    def forward(ctx, x_TH, weight_H, eps, fmt, key, counter, out):
        y_TH = F.rms_norm(x_TH, (x_TH.shape[-1],), weight_H, eps)
        # the recompute runs under no_grad: the weight itself (no detach call) builds no graph
        stash = RecomputeStash(quantize_saved(x_TH, fmt, key, counter), _norm_recompute(weight_H, eps))
        stash.output_ptr = y_TH.data_ptr()
        out.append(stash)
        ctx.stash, ctx.eps = stash, eps
        ctx.save_for_backward(weight_H)  # a parameter: no activation memory
        return y_TH

    @staticmethod
    def backward(ctx, grad_y_TH):
        (weight_H,) = ctx.saved_tensors
        stash, ctx.stash = ctx.stash, None
        rstd_T1 = stash.aux.pop("rstd", None)  # kept when the next linear recomputed the output
        x_hat = stash.consume()
        grad_x, grad_w = rmsnorm_backward(grad_y_TH, x_hat, rstd_T1, weight_H, ctx.eps, ctx.needs_input_grad[:2])
        return grad_x, grad_w, None, None, None, None, None


def rmsnorm_backward(grad_y_TH: torch.Tensor, x_hat_TH: torch.Tensor, rstd_T1: torch.Tensor | None,
                     weight_H: torch.Tensor, eps: float, needs_input_grad) -> tuple:
    """(grad_x, grad_weight) of ``y = rms_norm(x) * weight`` at ``x_hat`` (None where ``needs_input_grad`` is
    False). CUDA: ATen's fused RMSNorm backward straight from x_hat (what autograd of F.rms_norm runs on CUDA, so
    the gradients are the same bits), with ``rstd_T1`` when a recompute computed it (else recomputed), without a
    re-entrant autograd.grad (host cost); elsewhere: autograd of F.rms_norm at x_hat."""
    if x_hat_TH.is_cuda:
        width = [x_hat_TH.shape[-1]]
        if rstd_T1 is None:
            _, rstd_T1 = _fused_rms_norm(x_hat_TH, width, weight_H, eps)
        grad_x, grad_w = _fused_rms_norm_backward(grad_y_TH.contiguous(), x_hat_TH, width, rstd_T1, weight_H,
                                                  list(needs_input_grad))
        return grad_x, grad_w
    with torch.enable_grad():
        x = x_hat_TH.detach().requires_grad_(needs_input_grad[0])
        w = weight_H.detach().requires_grad_(needs_input_grad[1])
        y = F.rms_norm(x, (x.shape[-1],), w, eps)
        inputs = [t for t in (x, w) if t.requires_grad]
        grads = iter(torch.autograd.grad(y, inputs, grad_y_TH)) if inputs else iter(())
    grad_x = next(grads) if needs_input_grad[0] else None
    grad_w = next(grads) if needs_input_grad[1] else None
    return grad_x, grad_w


def _norm_recompute(weight_H: torch.Tensor, eps: float) -> Callable:
    """The norm's forward for RecomputeStash: on CUDA through ATen's fused op, keeping its rstd in the
    stash's ``aux`` for the norm's own backward (one recompute serves the linear and the norm)."""

    def forward_fn(x_hat_TH: torch.Tensor, aux: dict) -> torch.Tensor:
        y_TH, rstd_T1 = rmsnorm_recompute(x_hat_TH, weight_H, eps)
        if rstd_T1 is not None:
            aux["rstd"] = rstd_T1
        return y_TH

    forward_fn.takes_aux = True
    return forward_fn


def rmsnorm_recompute(x_hat_TH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> tuple:
    """(y, rstd) of the norm at x_hat, for a backward: on CUDA ATen's fused op, whose rstd serves the norm's own
    backward (one recompute for the linear and the norm); elsewhere ``F.rms_norm`` and rstd None."""
    if x_hat_TH.is_cuda:
        return _fused_rms_norm(x_hat_TH, [x_hat_TH.shape[-1]], weight_H, eps)
    return F.rms_norm(x_hat_TH, (x_hat_TH.shape[-1],), weight_H, eps), None


def rmsnorm_saving_input(x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float, fmt: QuantFormat, key: Key,
                         counter: SavedBytesCounter | None = None) -> tuple[torch.Tensor, RecomputeStash | None]:
    """RMSNorm with the same forward values as ``torch.nn.RMSNorm``; keeps ``fmt``-quantized x only.

    Returns (y, stash); stash is None when nothing needs saving (no grad). Pass the stash to the
    next linear's :func:`quantized_saves` so it stores nothing either (its input is recomputed from
    the same quantized x).
    """
    if not (torch.is_grad_enabled() and (x_TH.requires_grad or weight_H.requires_grad)):
        return F.rms_norm(x_TH, (x_TH.shape[-1],), weight_H, eps), None  # nothing is saved
    if torch.compiler.is_compiling():
        return _rmsnorm_saving_input_eager(x_TH, weight_H, eps, fmt, key, counter)
    out: list = []
    y_TH = _RMSNormSavingInput.apply(x_TH, weight_H, eps, fmt, key, counter, out)
    return y_TH, out[0]


_rmsnorm_saving_input_eager = eager_under_compile(
    rmsnorm_saving_input, "RMSNorm saving its quantized input (byte counter, recompute stash for the next linear)")
