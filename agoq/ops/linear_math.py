"""The forward and backward of a linear ``out = x @ W^T (+ b)`` as Megatron computes them, for agoq's nodes that own
a linear (agoq.ops.norm_linear: pre-norm -> QKV / fc1; agoq.ops.swiglu_linear: SwiGLU -> fc2; agoq.ops.quant_linear:
a linear storing its own input). The same ops with the same operand layouts as megatron-core 0.19.2's
``LinearWithGradAccumulationAndAsyncCommunication`` (no gradient-accumulation fusion, no wgrad deferral) and
``LinearWithFrozenWeight``, so a node gives the same gradient bits as Megatron's linear
(tests/megatron/test_activations.py, tests/megatron/test_layouts.py). Plain PyTorch: no Megatron import (house rule 1);
the Megatron layer decides which linears may use it.

Sequence parallelism (a column-parallel linear under Megatron's ``sequence_parallel``; ``sp_group``: its
tensor-parallel group): the node keeps its input sequence-sharded ([s/tp, ...]), all-gathers it along the first
dimension before the GEMM (:func:`seq_gather`, forward and again in backward for the weight gradient, as Megatron
re-gathers its saved sharded input) and reduce-scatters the input gradient instead of all-reducing it, started after
the input-gradient GEMM and waited for after the weight gradient, as Megatron's function does.

Shape legend: T = tokens (any leading dims), I = the linear's input features, O = its output features.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

__all__ = ["amp_bwd", "amp_fwd", "frozen_linear_backward", "linear_backward", "linear_forward", "seq_gather",
           "take_codes"]

# The decorators Megatron's linear functions carry (megatron-core 0.19.2 tensor_parallel/layers.py): under CUDA
# autocast the backward runs in the forward's autocast state, so the nodes compute as Megatron's linear does there.
amp_fwd = partial(torch.amp.custom_fwd, device_type="cuda")
amp_bwd = partial(torch.amp.custom_bwd, device_type="cuda")


def linear_forward(x_TI: torch.Tensor, weight_OI: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ b)`` with Megatron's ops: ``torch.matmul`` with the transposed weight, then the bias added."""
    out_TO = torch.matmul(x_TI, weight_OI.t())
    return out_TO if bias_O is None else out_TO + bias_O


def take_codes(ctx, node: str):
    """The quantized input an agoq one-node linear kept on ``ctx`` (agoq.ops.norm_linear / swiglu_linear /
    quant_linear), released from ``ctx`` as it is read so the codes go as soon as the backward is done with them.
    A second backward through the same graph (``retain_graph=True``) finds none and raises instead of failing on
    a None: Megatron's schedules never retain the graph; the hook paths do keep their saved copy."""
    q = ctx.q
    if q is None:
        raise RuntimeError(
            f"agoq's {node}: its backward already ran and released the quantized input; a second backward through the "
            "same graph (retain_graph=True) needs the hook paths: agoq_layer_spec(..., save_paths=SavePaths("
            "fuse_norm_linear=False, fuse_swiglu_linear=False, quantized_linear_node=False))")
    ctx.q = None
    return q


def seq_gather(x_TI: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[s/tp, ...] -> [s, ...]: the sequence shards of ``group``'s ranks concatenated along the first dimension, in
    rank order (Megatron's all-gather of a sequence-parallel column-parallel linear's input)."""
    world = dist.get_world_size(group)
    out = torch.empty((x_TI.shape[0] * world, *x_TI.shape[1:]), dtype=x_TI.dtype, device=x_TI.device)
    dist.all_gather_into_tensor(out, x_TI.contiguous(), group=group)
    return out


def _seq_reduce_scatter(grad_TI: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    """(this rank's [s/tp, ...] shard of the sum over ``group``, the handle): Megatron's reduce-scatter of the input
    gradient of a sequence-parallel column-parallel linear."""
    world = dist.get_world_size(group)
    out = torch.empty((grad_TI.shape[0] // world, *grad_TI.shape[1:]), dtype=grad_TI.dtype, device=grad_TI.device)
    return out, dist.reduce_scatter_tensor(out, grad_TI.contiguous(), group=group, async_op=async_op)


def linear_backward(grad_out_TO: torch.Tensor, x_TI: torch.Tensor, weight_OI: torch.Tensor,
                    dgrad_group: dist.ProcessGroup | None, bias_grad: bool,
                    sp_group: dist.ProcessGroup | None = None) -> tuple:
    """(grad_x, grad_weight, grad_bias) of Megatron's linear: grad_x from the gradient as given, the TP all-reduce
    over ``dgrad_group`` (Megatron's ``allreduce_dgrad``; None: none) or, under sequence parallelism, the
    reduce-scatter over ``sp_group`` (``x_TI`` is then the gathered input; grad_x comes back sharded) started after it
    and waited for after the weight gradient, which takes both operands flattened to 2-D
    (``prepare_input_tensors_for_wgrad_compute``); ``bias_grad``: the bias gradient, the sum over tokens (else
    None)."""
    if dgrad_group is not None and sp_group is not None:
        raise ValueError("linear_backward: allreduce_dgrad and sequence parallelism exclude each other (Megatron's "
                         "linear asserts the same)")
    grad_x_TI = grad_out_TO.matmul(weight_OI)
    handle = None
    if dgrad_group is not None:
        handle = dist.all_reduce(grad_x_TI, group=dgrad_group, async_op=True)
    elif sp_group is not None:
        grad_x_TI, handle = _seq_reduce_scatter(grad_x_TI, sp_group, async_op=True)
    grad_out_2d, x_2d = _flatten_2d(grad_out_TO), _flatten_2d(x_TI)
    grad_weight = grad_out_2d.t().matmul(x_2d)
    grad_bias = grad_out_2d.sum(dim=0) if bias_grad else None
    if handle is not None:
        handle.wait()
    return grad_x_TI, grad_weight, grad_bias


def frozen_linear_backward(grad_out_TO: torch.Tensor, weight_OI: torch.Tensor,
                           dgrad_group: dist.ProcessGroup | None,
                           sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """grad_x of a frozen weight as Megatron's LinearWithFrozenWeight computes it (what its linear runs when
    ``weight.requires_grad`` is False): the product through a 2-D view, a synchronous TP all-reduce, and no weight
    or bias gradient (Megatron's function returns none for the bias either). ``sp_group``: sequence parallelism,
    where Megatron gathers the input before that function (``gather_from_sequence_parallel_region``), whose
    backward reduce-scatters grad_x over this group."""
    if grad_out_TO.dim() > 2:
        grad_x_TI = grad_out_TO.reshape(-1, grad_out_TO.size(-1)).matmul(weight_OI)
        grad_x_TI = grad_x_TI.reshape(*grad_out_TO.shape[:-1], weight_OI.size(1))
    else:
        grad_x_TI = grad_out_TO.matmul(weight_OI)
    if dgrad_group is not None:
        dist.all_reduce(grad_x_TI, group=dgrad_group)
    if sp_group is not None:
        grad_x_TI, _ = _seq_reduce_scatter(grad_x_TI, sp_group, async_op=False)
    return grad_x_TI


def _flatten_2d(t: torch.Tensor) -> torch.Tensor:
    """[..., C] as a contiguous [N, C] (Megatron's prepare_input_tensors_for_wgrad_compute)."""
    t = t.contiguous()
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])
