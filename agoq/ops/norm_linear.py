"""RMSNorm -> linear as one autograd node that stores only the norm's quantized input (AGoQ's norm recompute,
arXiv 2605.00539), for the host cost of small micro-batches (docs/benchmarks/log.md, "Host cost").

The two-node path (:func:`agoq.ops.saved_norm.rmsnorm_saving_input` handing a :class:`RecomputeStash` to a
linear whose saved input is replaced inside a ``saved_tensors_hooks`` scope) stores the same bytes, but per
norm -> linear pair it runs a Python autograd function for the norm, a hook scope, two pack and two unpack
calls (one of them for the weight) and the stash's bookkeeping, on the host, for every micro-batch. Here the
norm's forward runs without a graph (:func:`rmsnorm_no_graph`, the values its autograd function computes),
and the linear that consumes it is one :class:`_RMSNormLinear` node from the norm's input and weight to the
linear's output: forward ``y = rms_norm(x) * g`` (already computed), ``out = y @ W^T (+ b)``, storing the
quantized ``x`` only; backward dequantizes ``x``, recomputes ``y`` and ``rstd`` once, and runs the linear's
and then the norm's backward with the same ops and operand layouts as the two-node path (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` for the linear, ATen's fused RMSNorm backward on CUDA), so
the gradients are the same bits (tests/megatron/test_activations.py, tests/megatron/test_layouts.py at TP=2,
tests/gpu/test_norm_linear_gpu.py).

A column-parallel linear's input-gradient all-reduce over the tensor-parallel group (Megatron's
``allreduce_dgrad``) is started after the input-gradient GEMM and waited for after the weight-gradient GEMM, as
Megatron's function does, and precedes the norm's backward. A frozen linear weight (``requires_grad`` False) gets
the backward of Megatron's ``LinearWithFrozenWeight``, which its ``_forward_impl`` runs then: the input gradient
through a 2-D view, a synchronous all-reduce, no weight or bias gradient.
Under sequence parallelism (``sp_group``) the norm runs on this rank's sequence shard, the node stores that shard's
quantized input (1/tp of the tokens), all-gathers the norm output along the sequence for the GEMM, and in backward
re-gathers the recomputed shard for the weight gradient and reduce-scatters the input gradient before the norm's
backward (agoq.ops.linear_math: Megatron's sequence-parallel linear, same ops). Gradient-accumulation fusion and
wgrad deferral are not implemented here: the Megatron layer does not route such a linear through this node
(agoq.megatron.layers).

Shape legend: T = tokens (any leading dims), H = hidden (the norm's width), O = the linear's output features.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agoq.formats import QuantFormat
from agoq.ops.linear_math import (
    amp_bwd,
    amp_fwd,
    frozen_linear_backward,
    linear_backward,
    linear_forward,
    seq_gather,
    take_codes,
)
from agoq.ops.saved_act import Key, SavedBytesCounter, _dequantize, quantize_saved
from agoq.ops.saved_norm import rmsnorm_backward, rmsnorm_recompute

__all__ = ["NormFeed", "rmsnorm_no_graph", "rmsnorm_linear"]


class NormFeed:
    """What a norm that skipped its own autograd node hands to the linear it feeds: its input, weight, eps,
    output (``y``, made without a graph) and how to store its input (format, counter key, counter)."""

    __slots__ = ("x", "weight", "eps", "y", "fmt", "key", "counter")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, y: torch.Tensor, fmt: QuantFormat,
                 key: Key, counter: SavedBytesCounter | None):
        self.x, self.weight, self.eps, self.y = x, weight, eps, y
        self.fmt, self.key, self.counter = fmt, key, counter

    def check_feeds(self, target: torch.Tensor) -> None:
        """Raise unless ``target`` (the linear's input) is this norm's output ``y`` (same memory and shape)."""
        y = self.y
        if target is not y and (target.data_ptr() != y.data_ptr() or target.shape != y.shape):
            raise RuntimeError(
                f"agoq: this linear's input is not the output of the recomputable op before it (the norm {self.key}); "
                "the layer's forward order changed. Use a bf16 policy for this role or report it.")


def rmsnorm_no_graph(x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm``'s forward values without an autograd node (the values agoq's norm function
    computes in its forward, which runs without grad too); the node comes with the linear (:func:`rmsnorm_linear`)."""
    with torch.no_grad():
        return F.rms_norm(x_TH, (x_TH.shape[-1],), weight_H, eps)


class _RMSNormLinear(torch.autograd.Function):
    """out = rms_norm(x) * g @ W^T (+ b) from y = rms_norm(x) * g computed before; stores quantized x."""

    @staticmethod
    @amp_fwd
    def forward(ctx, x_TH, norm_weight_H, weight_OH, bias_O, feed: NormFeed, dgrad_group, sp_group):
        y_TH = feed.y if sp_group is None else seq_gather(feed.y, sp_group)
        out_TO = linear_forward(y_TH, weight_OH, bias_O)
        del y_TH
        ctx.q = quantize_saved(x_TH, feed.fmt, feed.key, feed.counter)
        ctx.eps, ctx.use_bias, ctx.dgrad_group, ctx.sp_group = feed.eps, bias_O is not None, dgrad_group, sp_group
        ctx.save_for_backward(norm_weight_H, weight_OH)  # parameters: no activation memory
        return out_TO

    @staticmethod
    @amp_bwd
    def backward(ctx, grad_out_TO):
        norm_weight_H, weight_OH = ctx.saved_tensors
        q = take_codes(ctx, "norm + linear node")
        x_hat_TH = _dequantize(q)
        del q  # the codes go as soon as they are read (the two-node path lets them go at the norm's backward)
        rstd_T1 = None
        if ctx.needs_input_grad[2]:
            with torch.no_grad():  # the linear's input rebuilt once; on CUDA its rstd serves the norm's backward
                y_hat_TH, rstd_T1 = rmsnorm_recompute(x_hat_TH, norm_weight_H, ctx.eps)
            if ctx.sp_group is not None:  # the weight gradient takes the whole sequence (Megatron's re-gather)
                y_hat_TH = seq_gather(y_hat_TH, ctx.sp_group)
            grad_y_TH, grad_weight, grad_bias = linear_backward(grad_out_TO, y_hat_TH, weight_OH, ctx.dgrad_group,
                                                                ctx.use_bias and ctx.needs_input_grad[3],
                                                                sp_group=ctx.sp_group)
            del y_hat_TH
        else:  # a frozen weight needs no recomputed input
            grad_y_TH = frozen_linear_backward(grad_out_TO, weight_OH, ctx.dgrad_group, sp_group=ctx.sp_group)
            grad_weight = grad_bias = None
        grad_x, grad_norm_weight = rmsnorm_backward(grad_y_TH, x_hat_TH, rstd_T1, norm_weight_H, ctx.eps,
                                                    ctx.needs_input_grad[:2])
        return grad_x, grad_norm_weight, grad_weight, grad_bias, None, None, None


def rmsnorm_linear(feed: NormFeed, weight_OH: torch.Tensor, bias_O: torch.Tensor | None = None,
                   dgrad_group: dist.ProcessGroup | None = None,
                   sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The linear fed by the norm of ``feed`` as one node from the norm's input: ``feed.y @ W^T (+ b)``, storing
    only the norm's quantized input. ``dgrad_group``: all-reduce the gradient of ``y`` over this group (a
    column-parallel linear's tensor-parallel group, Megatron's ``allreduce_dgrad``; None: no all-reduce).
    ``sp_group``: sequence parallelism over this group (module docstring; excludes ``dgrad_group``)."""
    return _RMSNormLinear.apply(feed.x, feed.weight, weight_OH, bias_O, feed, dgrad_group, sp_group)
