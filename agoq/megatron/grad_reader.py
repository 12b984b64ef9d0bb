"""Per-parameter reads of 8-bit reduced gradients for agoq's optimizer (``--agoq-grads`` store mode).

Megatron's FP32Optimizer sets ``param.grad = param.main_grad`` for every parameter, clips them all by the
global norm and steps, so every float gradient exists at once. agoq's optimizers update one
parameter at a time (``QuantizedOptimizer.step_param``), so with 8-bit gradients they need none of
that: the reader dequantizes one parameter's reduced gradient, the clip factor is applied to it, the
parameter is stepped and the fp32 copy is dropped. Transient float memory: the largest parameter.

Hook (agoq/megatron/optimizer.py): ``AgoqMegatronOptimizer.grad_reader``; when set, its
``prepare_grads`` / ``clip_grad_norm`` / ``step_with_ready_grads`` call :func:`prepare_grads`,
:func:`clip_grad_norm` and :func:`step_with_ready_grads` here. :func:`attach` sets it.

Norm: the same parameters as Megatron's ``_filter_grads_for_norm`` (not shared, not a TP / GTP
duplicate), the sum of squares in fp32, all-reduced over ``get_grad_stats_parallel_group()``, square
root; clip factor ``clip_grad / (norm + 1e-6)`` when below 1, as ``clip_grad_by_total_norm_fp32``.
Not supported (raise): separate grad-norm groups (MTP), ``log_num_zeros_in_grad``, the distributed
optimizer (its owned shards are float windows that main_grad points to: no reader needed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.optimizer.optimizer import _get_param_grad_norm_group
from megatron.core.transformer.module import param_is_not_shared

__all__ = ["QuantizedGradReader", "attach", "prepare_grads", "clip_grad_norm", "step_with_ready_grads"]

CLIP_EPS = 1.0e-6  # megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32


class QuantizedGradReader:
    """Reduced gradients of store-mode DDP chunks, one parameter at a time."""

    def __init__(self, chunks: list):
        self.chunks = chunks
        self.clip_coeff = 1.0

    def grad(self, param) -> torch.Tensor | None:
        for chunk in self.chunks:
            g = chunk.agoq_grad_of(param)
            if g is not None:
                return g
        return None


def attach(optimizer, model_chunks: list) -> QuantizedGradReader | None:
    """Switch store-mode chunks to lazy reads and give ``optimizer`` a reader (None when no chunk stores
    8-bit gradients or the distributed optimizer is on)."""
    chunks = [c for c in model_chunks if getattr(getattr(c, "agoq_grad", None), "mode", None) == "store"]
    if not chunks or any(c.ddp_config.use_distributed_optimizer for c in chunks):
        return None
    if len(chunks) != len(model_chunks):
        raise NotImplementedError("agoq 8-bit gradient store: every model chunk must use it (or none)")
    if getattr(optimizer.config, "log_num_zeros_in_grad", False):
        raise NotImplementedError("--log-num-zeros-in-grad with --agoq-grads store and agoq's optimizer is not "
                                  "implemented; drop the flag or use --agoq-grads-mode reduce")
    if any(_get_param_grad_norm_group(p) is not None for p in optimizer.get_parameters()):
        raise NotImplementedError("separate grad-norm groups (MTP) with --agoq-grads store and agoq's optimizer "
                                  "are not implemented; use --agoq-grads-mode reduce")
    for chunk in chunks:
        chunk.agoq_set_lazy(True)
    reader = QuantizedGradReader(chunks)
    optimizer.grad_reader = reader
    return reader


def prepare_grads(optimizer) -> bool:
    """No ``.grad`` is assigned (each is read in step_with_ready_grads); non-finite gradients are the
    training loop's skip check (agoq_grads_nonfinite), as with Megatron's FP32Optimizer."""
    optimizer.grad_reader.clip_coeff = 1.0
    for param in optimizer.get_parameters():
        param.grad = None
    return False


@torch.no_grad()
def clip_grad_norm(optimizer, clip_grad: float) -> float:
    reader = optimizer.grad_reader
    params = optimizer.get_parameters()
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for param in params:
        if not (param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(param)
                and tensor_parallel.param_is_not_gtp_duplicate(param)):
            continue
        g = reader.grad(param)
        if g is not None:
            total += torch.dot(g.reshape(-1), g.reshape(-1))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.get_grad_stats_parallel_group())
    norm = float(total.item()) ** 0.5
    coeff = clip_grad / (norm + CLIP_EPS)
    reader.clip_coeff = coeff if coeff < 1.0 else 1.0
    return norm


@torch.no_grad()
def step_with_ready_grads(optimizer) -> bool:
    reader, inner = optimizer.grad_reader, optimizer.optimizer
    if not hasattr(inner, "step_param"):
        raise NotImplementedError(f"{type(inner).__name__} has no per-parameter step; 8-bit gradient reads "
                                  "need agoq's optimizers (agoq.optim)")
    for group in inner.param_groups:
        for param in group["params"]:
            g = reader.grad(param)
            if g is None:
                continue
            if reader.clip_coeff != 1.0:
                g = g * reader.clip_coeff
            inner.step_param(param, g, group)
    return True
