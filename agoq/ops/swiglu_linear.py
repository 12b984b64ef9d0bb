"""SwiGLU -> fc2 as one autograd node that stores only SwiGLU's quantized input, the fc1 output (AGoQ's SwiGLU
recompute, arXiv 2605.00539), for the host cost of small micro-batches (docs/numerics.md,
"Host cost"). The MLP's half of what :mod:`agoq.ops.norm_linear` does for the pre-norms.

The two-node path (:func:`agoq.ops.saved_swiglu.swiglu_saving_input`, a Python autograd function, handing a
:class:`~agoq.ops.saved_act.RecomputeStash` to fc2, whose saved input Megatron's linear function stores through a
``saved_tensors_hooks`` scope) stores the same bytes, but per MLP and micro-batch it runs SwiGLU's autograd
function, a hook scope, two pack and two unpack calls (one for the weight), the stash's bookkeeping and Megatron's
Python linear function. Here the MLP computes SwiGLU without a graph (:func:`swiglu_no_graph`: on CUDA the fused
kernel that writes the output and the codes, ``swiglu_quantize``) and fc2 is one :class:`_SwiGLULinear` node from
the fc1 output and fc2's weight to fc2's output: forward ``out = z @ W^T (+ b)`` with ``z`` already computed;
backward rebuilds ``z`` once from the codes (``dequant_swiglu_fwd``; elsewhere SwiGLU at the dequantized fc1
output), runs Megatron's linear backward math (agoq.ops.linear_math) and then SwiGLU's backward from the same
codes (``dequant_swiglu_bwd``), the ops of the two-node path in its order, so the gradients are the same bits
(tests/megatron/test_activations.py, tests/megatron/test_layouts.py at TP=2, tests/gpu/test_norm_linear_gpu.py).

fc2 is row-parallel: its input-gradient needs no all-reduce, and the output's all-reduce (or a bias) follows in
Megatron's ``RowParallelLinear.forward``. Plain SwiGLU only (no Smooth-SwiGLU scale, no FP8 fc2); gradient-
accumulation fusion and wgrad deferral are not implemented here: the Megatron layer keeps the two-node path there
(agoq.megatron.layers ``_takes_swiglu_feed``).

Shape legend: T = tokens (any leading dims), F2 = 2 x FFN per rank (the fc1 output), F = FFN per rank, O = fc2's
output features (hidden).
"""

from __future__ import annotations

import torch

from agoq.formats import QuantFormat
from agoq.ops.linear_math import amp_bwd, amp_fwd, frozen_linear_backward, linear_backward, linear_forward, take_codes
from agoq.ops.saved_act import Key, SavedBytesCounter, _dequantize, quantize_saved
from agoq.ops.saved_swiglu import _swiglu_fused, swiglu_reference
from agoq.ref.quant import QuantizedTensor

__all__ = ["SwiGLUFeed", "swiglu_linear", "swiglu_no_graph"]


class SwiGLUFeed:
    """What a SwiGLU that skipped its own autograd node hands to fc2: its input (the fc1 output ``h``), output
    (``z``, made without a graph), the quantized ``h`` (``q``: the codes, counted under ``key`` when it was made),
    the GLU offset and whether ``q`` came from the fused kernel (its codes feed the fused recompute / backward)."""

    __slots__ = ("h", "z", "q", "offset", "fused", "key")

    def __init__(self, h: torch.Tensor, z: torch.Tensor, q: QuantizedTensor, offset: float, fused: bool, key: Key):
        self.h, self.z, self.q, self.offset, self.fused, self.key = h, z, q, offset, fused, key

    def check_feeds(self, target: torch.Tensor) -> None:
        """Raise unless ``target`` (fc2's input) is this SwiGLU's output ``z`` (same memory and shape)."""
        z = self.z
        if target is not z and (target.data_ptr() != z.data_ptr() or target.shape != z.shape):
            raise RuntimeError(
                "agoq: this linear's input is not the output of the recomputable op before it (the SwiGLU "
                f"{self.key}); the MLP's forward order changed. Use a bf16 policy for this role or report it.")


def swiglu_no_graph(h_TF2: torch.Tensor, fmt: QuantFormat, key: Key, counter: SavedBytesCounter | None,
                    offset: float = 0.0, *, fuse: bool = True) -> SwiGLUFeed:
    """SwiGLU's forward values (Megatron's unfused ``glu``) and the quantized fc1 output, without an autograd node,
    as :func:`agoq.ops.saved_swiglu.swiglu_saving_input` computes them (fused kernel on CUDA where it applies,
    ``fuse=False``: quantize + ATen SwiGLU); the node comes with fc2 (:func:`swiglu_linear`)."""
    fused = _swiglu_fused(h_TF2, fmt, offset, fuse)
    with torch.no_grad():
        if fused:
            from agoq.kernels.swiglu_quant import swiglu_quantize

            z_TF, q = swiglu_quantize(h_TF2, fmt)
            if counter is not None:
                counter.add(key, q)
        else:
            z_TF = swiglu_reference(h_TF2, offset)
            q = quantize_saved(h_TF2, fmt, key, counter)
    return SwiGLUFeed(h_TF2, z_TF, q, offset, fused, key)


class _SwiGLULinear(torch.autograd.Function):
    """out = swiglu(h) @ W^T (+ b) from z = swiglu(h) computed before; stores quantized h."""

    @staticmethod
    @amp_fwd
    def forward(ctx, h_TF2, weight_OF, bias_O, feed: SwiGLUFeed):
        out_TO = linear_forward(feed.z, weight_OF, bias_O)
        ctx.q, ctx.offset, ctx.fused, ctx.use_bias = feed.q, feed.offset, feed.fused, bias_O is not None
        feed.q = None  # the node holds the codes from here on
        ctx.save_for_backward(weight_OF)  # a parameter: no activation memory
        return out_TO

    @staticmethod
    @amp_bwd
    def backward(ctx, grad_out_TO):
        (weight_OF,) = ctx.saved_tensors
        q = take_codes(ctx, "SwiGLU + linear node")
        h_hat_TF2 = None if ctx.fused else _dequantize(q)
        if ctx.needs_input_grad[1]:
            z_hat_TF = _recompute(q, h_hat_TF2, ctx.offset)
            grad_z_TF, grad_weight, grad_bias = linear_backward(grad_out_TO, z_hat_TF, weight_OF, None,
                                                                ctx.use_bias and ctx.needs_input_grad[2])
            del z_hat_TF
        else:  # a frozen weight needs no recomputed input
            grad_z_TF = frozen_linear_backward(grad_out_TO, weight_OF, None)
            grad_weight = grad_bias = None
        grad_h = _swiglu_backward(q, h_hat_TF2, grad_z_TF, ctx.offset) if ctx.needs_input_grad[0] else None
        return grad_h, grad_weight, grad_bias, None


def _recompute(q: QuantizedTensor, h_hat_TF2: torch.Tensor | None, offset: float) -> torch.Tensor:
    """fc2's input rebuilt as the two-node path's stash rebuilds it (agoq.ops.saved_swiglu._swiglu_recompute):
    from the codes in one pass on the fused path; one Triton pass at the dequantized h on CUDA; Megatron's ops
    elsewhere or with an offset."""
    if h_hat_TF2 is None:
        from agoq.kernels.swiglu_quant import dequant_swiglu_fwd

        return dequant_swiglu_fwd(q, None)
    if h_hat_TF2.is_cuda and not offset:
        from agoq.kernels.swiglu import swiglu_fwd

        return swiglu_fwd(h_hat_TF2, None)
    return swiglu_reference(h_hat_TF2, offset)


def _swiglu_backward(q: QuantizedTensor, h_hat_TF2: torch.Tensor | None, grad_z_TF: torch.Tensor,
                     offset: float) -> torch.Tensor:
    """SwiGLU's input gradient as the two-node path's autograd function computes it
    (agoq.ops.saved_swiglu._SwiGLUSavingInput.backward, without a Smooth-SwiGLU scale)."""
    if h_hat_TF2 is None:
        from agoq.kernels.swiglu_quant import dequant_swiglu_bwd

        return dequant_swiglu_bwd(q, grad_z_TF, None)
    if h_hat_TF2.is_cuda and not offset:
        from agoq.kernels.swiglu import swiglu_bwd

        return swiglu_bwd(h_hat_TF2, grad_z_TF, None)
    with torch.enable_grad():
        h = h_hat_TF2.detach().requires_grad_(True)
        (grad_h,) = torch.autograd.grad(swiglu_reference(h, offset), (h,), grad_z_TF)
    return grad_h


def swiglu_linear(feed: SwiGLUFeed, weight_OF: torch.Tensor, bias_O: torch.Tensor | None = None) -> torch.Tensor:
    """fc2 fed by the SwiGLU of ``feed`` as one node from the fc1 output: ``feed.z @ W^T (+ b)``, storing only the
    quantized fc1 output (the codes ``feed`` carries)."""
    if feed.q is None:
        raise RuntimeError(f"agoq: the SwiGLU feed of {feed.key} was used by a linear already")
    return _SwiGLULinear.apply(feed.h, weight_OF, bias_O, feed)
