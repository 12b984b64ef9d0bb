"""A linear that stores its input quantized, as one autograd node (AGoQ's low-bit saved activations,
arXiv 2605.00539; the out-projection's input under the default policy), for the host cost of
small micro-batches (docs/benchmarks/log.md, "Host cost").

The hook path (a ``saved_tensors_hooks`` scope around Megatron's linear function, agoq.ops.saved_act
``quantized_saves``) stores the same bytes, but per linear and micro-batch it enters and leaves a hook scope, runs
two pack and two unpack calls (one for the weight) and Megatron's Python linear function. Here the linear is one
:class:`_QuantizedInputLinear` node: forward ``out = x @ W^T (+ b)`` and the quantized ``x``; backward dequantizes
``x`` once and runs Megatron's linear backward math (agoq.ops.linear_math), the ops of the hook path, so the
gradients are the same bits (tests/megatron/test_activations.py, tests/megatron/test_layouts.py at TP=2).
Under sequence parallelism (``sp_group``, a column-parallel linear) the stored input is this rank's sequence shard,
gathered for the GEMM in forward and again, dequantized, for the weight gradient; the input gradient is
reduce-scattered (agoq.ops.linear_math, tests/megatron/test_sequence_parallel.py).

Shape legend: T = tokens (any leading dims), I = input features, O = output features.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from agoq.formats import QuantFormat
from agoq.ops.linear_math import amp_bwd, amp_fwd, linear_backward, linear_forward, seq_gather, take_codes
from agoq.ops.saved_act import Key, SavedBytesCounter, _dequantize, quantize_saved

__all__ = ["quantized_input_linear"]


class _QuantizedInputLinear(torch.autograd.Function):
    """out = x @ W^T (+ b); stores quantized x (and the weight, a parameter). For a trainable weight and an input
    that needs a gradient only: Megatron's linear saves no input otherwise, and the layer calls it then."""

    @staticmethod
    @amp_fwd
    def forward(ctx, x_TI, weight_OI, bias_O, fmt: QuantFormat, key: Key, counter: SavedBytesCounter | None,
                dgrad_group, sp_group):
        out_TO = linear_forward(x_TI if sp_group is None else seq_gather(x_TI, sp_group), weight_OI, bias_O)
        ctx.q = quantize_saved(x_TI, fmt, key, counter)
        ctx.use_bias, ctx.dgrad_group, ctx.sp_group = bias_O is not None, dgrad_group, sp_group
        ctx.save_for_backward(weight_OI)  # a parameter: no activation memory
        return out_TO

    @staticmethod
    @amp_bwd
    def backward(ctx, grad_out_TO):
        (weight_OI,) = ctx.saved_tensors
        q = take_codes(ctx, "quantized-input linear node")
        x_hat_TI = _dequantize(q)
        del q
        if ctx.sp_group is not None:  # the weight gradient takes the whole sequence (Megatron's re-gather)
            x_hat_TI = seq_gather(x_hat_TI, ctx.sp_group)
        grad_x_TI, grad_weight, grad_bias = linear_backward(grad_out_TO, x_hat_TI, weight_OI, ctx.dgrad_group,
                                                            ctx.use_bias and ctx.needs_input_grad[2],
                                                            sp_group=ctx.sp_group)
        return grad_x_TI, grad_weight, grad_bias, None, None, None, None, None


def quantized_input_linear(x_TI: torch.Tensor, weight_OI: torch.Tensor, bias_O: torch.Tensor | None, fmt: QuantFormat,
                           key: Key, counter: SavedBytesCounter | None = None,
                           dgrad_group: dist.ProcessGroup | None = None,
                           sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` as one node storing ``fmt``-quantized ``x`` (counted under ``key``). ``dgrad_group``:
    all-reduce the input gradient over this group (a column-parallel linear's tensor-parallel group, Megatron's
    ``allreduce_dgrad``; None: no all-reduce). ``sp_group``: ``x`` is a sequence shard of this group (module
    docstring; excludes ``dgrad_group``)."""
    return _QuantizedInputLinear.apply(x_TI, weight_OI, bias_O, fmt, key, counter, dgrad_group, sp_group)
