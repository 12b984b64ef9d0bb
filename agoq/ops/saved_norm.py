"""RMSNorm that stores only its quantized input for backward (AGoQ, arXiv 2605.00539: the norm is recomputed)
and hands the next linear a :class:`~agoq.ops.saved_act.RecomputeStash`, so that linear stores nothing.

Two implementations with the same stored bytes and the same gradient bits (tests/gpu/test_saved_act_gpu.py):
agoq's autograd function :class:`_RMSNormSavingInput` (public mechanisms only: ``ctx.save_for_backward`` and a
stash on ``ctx``; the default, and the only one off CUDA), and, opt-in on CUDA (``via_aten_node=True``),
``F.rms_norm``'s own ATen node (``FusedRmsNormBackward0``) with hooks on its two saved activations (no Python
autograd function per norm, docs/activations.md "Host cost"; it reaches the node's private ``_raw_saved_input`` /
``_raw_saved_rstd``, for which torch has no public equivalent).

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
    _Saved,
    default_saved_hooks_active,
    eager_under_compile,
    quantize_saved,
    unpack_saved,
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
                         counter: SavedBytesCounter | None = None, check_identity: bool = True, *,
                         via_aten_node: bool = False) -> tuple[torch.Tensor, RecomputeStash | None]:
    """RMSNorm with the same forward values as ``torch.nn.RMSNorm``; keeps ``fmt``-quantized x only.

    Returns (y, stash); stash is None when nothing needs saving (no grad). Pass the stash to the
    next linear's :func:`quantized_saves` so it stores nothing either (its input is recomputed from
    the same quantized x). ``check_identity=False`` skips checking that the CUDA norm node saved ``x_TH``
    itself (its node type is checked on every call): for callers that checked on their first call.
    ``via_aten_node=True`` hooks ATen's fused node on CUDA instead of agoq's function (``_hook_fused_norm_node``).
    """
    if not (torch.is_grad_enabled() and (x_TH.requires_grad or weight_H.requires_grad)):
        return F.rms_norm(x_TH, (x_TH.shape[-1],), weight_H, eps), None  # nothing is saved
    if torch.compiler.is_compiling():
        return _rmsnorm_saving_input_eager(x_TH, weight_H, eps, fmt, key, counter, check_identity,
                                           via_aten_node=via_aten_node)
    if via_aten_node and x_TH.is_cuda and not default_saved_hooks_active():
        y_TH = F.rms_norm(x_TH, (x_TH.shape[-1],), weight_H, eps)
        return y_TH, _hook_fused_norm_node(y_TH, x_TH, weight_H, eps, fmt, key, counter, check_identity)
    out: list = []
    y_TH = _RMSNormSavingInput.apply(x_TH, weight_H, eps, fmt, key, counter, out)
    return y_TH, out[0]


_rmsnorm_saving_input_eager = eager_under_compile(
    rmsnorm_saving_input, "RMSNorm saving its quantized input (byte counter, recompute stash for the next linear)")


# CUDA: F.rms_norm's own autograd node (ATen's fused RMSNorm, C++ backward) with hooks on the two saved
# activations, instead of the Python autograd function above: the same stored bytes and the same gradient
# bits (ATen's backward at x_hat with rstd(x_hat), as the function computes), without a Python
# Function's forward / backward per norm (docs/activations.md, "Host cost"). Opt-in: rmsnorm_saving_input's
# ``via_aten_node=True`` (the layers' ``SavePaths.norm_via_aten_node``); the default is the function.
_FUSED_NORM_NODE = "FusedRmsNormBackward0"
_NORM_RSTD_ATTRS = ("_raw_saved_rstd", "_raw_saved_result1")  # the name of its second output, by torch version


def _hook_fused_norm_node(y_TH, x_TH, weight_H, eps, fmt, key, counter, check_identity=True) -> RecomputeStash:
    """Make the node that computed ``y_TH`` store quantized x (for itself and the next linear) and take
    rstd from the linear's recompute in backward (or recompute it), not the forward's rstd(x)."""
    node = y_TH.grad_fn
    raw_x = getattr(node, "_raw_saved_input", None)
    raw_rstd = getattr(node, _NORM_RSTD_ATTRS[0], None) or getattr(node, _NORM_RSTD_ATTRS[1], None)
    if node is None or node.name() != _FUSED_NORM_NODE or raw_x is None or raw_rstd is None \
            or (check_identity and node._saved_input.data_ptr() != x_TH.data_ptr()):
        raise RuntimeError(
            f"agoq: F.rms_norm on CUDA made a {node.name() if node is not None else None} node, "
            "not ATen's fused RMSNorm "
            f"({_FUSED_NORM_NODE} saving input and rstd) that agoq hooks (torch {torch.__version__}); pass "
            "via_aten_node=False to rmsnorm_saving_input (agoq's layers: "
            "agoq_layer_spec(..., save_paths=SavePaths(norm_via_aten_node=False))) to use agoq's autograd "
            "function, and report it")
    stash = RecomputeStash(None, _norm_recompute(weight_H, eps))
    stash.output_ptr = y_TH.data_ptr()
    raw_x.register_hooks(_PackNormInput(stash, fmt, key, counter), unpack_saved)  # packs (quantizes) now
    raw_rstd.register_hooks(_PackNormRstd(stash, weight_H, eps), unpack_saved)
    return stash


class _PackNormInput:
    __slots__ = ("stash", "fmt", "key", "counter")

    def __init__(self, stash, fmt, key, counter):
        self.stash, self.fmt, self.key, self.counter = stash, fmt, key, counter

    def __call__(self, x_TH: torch.Tensor) -> _Saved:
        self.stash.q = quantize_saved(x_TH, self.fmt, self.key, self.counter)
        return _NormInputSave(self.stash)


class _NormInputSave(_Saved):
    """x for the norm's backward: the stash's x_hat (dequantized once, shared with the linear's
    recompute; freed with the node's saved tensors after its backward)."""

    __slots__ = ("stash",)

    def __init__(self, stash: RecomputeStash):
        self.stash = stash

    def materialize(self) -> torch.Tensor:
        return self.stash.dequantized()


class _PackNormRstd:
    __slots__ = ("stash", "weight", "eps")

    def __init__(self, stash, weight, eps):
        self.stash, self.weight, self.eps = stash, weight, eps

    def __call__(self, rstd: torch.Tensor) -> _Saved:  # the forward's rstd(x) is let go (T floats)
        return _NormRstdSave(self)


class _NormRstdSave(_Saved):
    """rstd for the norm's backward: rstd(x_hat) from the linear's recompute, else recomputed."""

    __slots__ = ("pack",)

    def __init__(self, pack: _PackNormRstd):
        self.pack = pack

    def materialize(self) -> torch.Tensor:
        stash = self.pack.stash
        rstd_T1 = stash.aux.pop("rstd", None)
        if rstd_T1 is None:
            x_hat = stash.dequantized()
            _, rstd_T1 = _fused_rms_norm(x_hat, [x_hat.shape[-1]], self.pack.weight, self.pack.eps)
        return rstd_T1
