"""Per-parameter reads of 8-bit reduced gradients for agoq's optimizer (``--agoq-grads`` store mode).

Megatron's FP32Optimizer sets ``param.grad = param.main_grad`` for every parameter, clips them all by the
global norm and steps, so every float gradient exists at once. agoq's optimizers update one
parameter at a time (``QuantizedOptimizer.step_param``), so with 8-bit gradients they need none of
that: the reader dequantizes one parameter's reduced gradient, the clip factor is applied to it, the
parameter is stepped and the fp32 copy is dropped. Transient float memory: the largest parameter.

Hook (agoq/megatron/optim/megatron_optimizer.py): ``AgoqMegatronOptimizer.grad_reader``; when set, its
``prepare_grads`` / ``clip_grad_norm`` / ``step_with_ready_grads`` call :func:`prepare_grads`,
:func:`clip_grad_norm` and :func:`step_with_ready_grads` here. :func:`attach` sets it.

Norm: the same parameters as Megatron's ``_filter_grads_for_norm`` (not shared, not a TP / GTP
duplicate), the sum of squares in fp32, all-reduced over ``get_grad_stats_parallel_group()``, square
root; clip factor ``clip_grad / (norm + 1e-6)`` when below 1, as ``clip_grad_by_total_norm_fp32``.
Not supported (raise): separate grad-norm groups (MTP), ``log_num_zeros_in_grad`` with agoq's optimizer.

Distributed optimizer (``--use-distributed-optimizer``): the DDP requantizes this rank's reduced shard
into its 8-bit store (agoq/megatron/grads/grad_store.py) and Megatron's ``main_grad`` holds nothing, so the
optimizer must read the shard from the store (the reduction raises when no reader is attached):
  * agoq's optimizer (agoq.megatron.optim.dist_optimizer.AgoqDistributedOptimizer, a :class:`ReadsShardGrads`:
    this module names no optimizer class of agoq's, the optimizer imports it): a
    :class:`ShardGradReader` over its shards; norm, clip and step as above, one shard at a time (the
    inner optimizer's ``grad_source``); no ``.decoupled_grad`` is assigned. Extra bytes: one shard.
  * Megatron's DistributedOptimizer (``--agoq-optimizer torch``): the instance's class is swapped to
    :class:`ShardGradsDistributedOptimizer`, whose ``_copy_model_grads_to_main_grads`` sets every fp32
    shard main param's ``.grad`` to its dequantized shard (4/W bytes per parameter, dropped by
    Megatron's ``zero_grad``); the rest of Megatron's step is unchanged.

Seam card
---------
Touches (megatron-core 0.19.2): ``megatron.core.optimizer.optimizer._get_param_grad_norm_group``;
  ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer`` — instance class swap (as
  agoq/megatron/grads/ddp.py does for the bucket groups) overriding ``_copy_model_grads_to_main_grads``
  (private); reads its ``model_float16_groups`` / ``shard_fp32_from_float16_groups`` /
  ``model_fp32_groups`` / ``shard_fp32_groups`` and ``_get_model_param_range_map``; ``ChainedOptimizer
  .chained_optimizers``.
Why: the reduced shard lives in agoq's 8-bit store, which Megatron's only gradient source
  (``model_param.main_grad.view(-1)[param_range]``) cannot address without a float window over every
  parameter the shard touches (4 bytes per parameter when one parameter spans buckets).
Guarded by: tests/megatron/test_ddp_agoq.py, tests/megatron/test_grads_distopt_memory.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import _get_param_grad_norm_group
from megatron.core.transformer.module import param_is_not_shared

from agoq.config import flag_for
from agoq.megatron.install import mark, swap_class
from agoq.ops.fp8_weight_cache import fp8_weights_changed

__all__ = ["QuantizedGradReader", "ReadsShardGrads", "ShardGradReader", "ShardGradsDistributedOptimizer", "attach",
           "prepare_grads", "clip_grad_norm", "step_with_ready_grads"]

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


class ShardGradReader(QuantizedGradReader):
    """Distributed optimizer: this rank's shard of each parameter's reduced gradient, one at a time.
    ``shards`` maps id(optimizer param) -> (model param, start, end) (flat elements of the model param)."""

    def __init__(self, chunks: list, shards: dict):
        super().__init__(chunks)
        self.shards = shards

    def grad(self, param) -> torch.Tensor | None:
        model_param, start, end = self.shards[id(param)]
        for chunk in self.chunks:
            g = chunk.agoq_shard_grad_of(model_param, start, end)
            if g is not None:
                return g.view(param.shape) if g.numel() == param.numel() else g
        return None

    def clipped_grad(self, param) -> torch.Tensor | None:
        g = self.grad(param)
        return g * self.clip_coeff if g is not None and self.clip_coeff != 1.0 else g


class ReadsShardGrads:
    """Base of a distributed optimizer that steps from its 8-bit shards itself (agoq.megatron.optim.dist_optimizer
    .AgoqDistributedOptimizer): ``shard_info`` maps id(shard) -> (model param, start, end); :func:`attach`
    sets ``grad_reader`` (a :class:`ShardGradReader`) and the inner optimizer's ``grad_source``."""

    grad_reader: ShardGradReader | None = None
    shard_info: dict


class ShardGradsDistributedOptimizer(DistributedOptimizer):
    """Megatron's DistributedOptimizer whose shard gradients come from agoq's 8-bit store (class swap)."""

    agoq_shard_reader: ShardGradReader

    def _copy_model_grads_to_main_grads(self):
        reader = self.agoq_shard_reader
        for shard_group in self.shard_fp32_from_float16_groups + self.shard_fp32_groups:
            for shard in shard_group:
                g = reader.grad(shard)
                shard.grad = None if g is None else g.reshape(shard.shape)


mark(ShardGradsDistributedOptimizer, "grad_reader.distributed_optimizer")


def _megatron_shards(opt: DistributedOptimizer) -> dict:
    shards = {}
    for model_groups, shard_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                       (opt.model_fp32_groups, opt.shard_fp32_groups)):  # fmt: skip
        for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
            for model_param, shard in zip(model_group, shard_group, strict=True):
                rng = opt._get_model_param_range_map(model_param)["param"]
                shards[id(shard)] = (model_param, rng.start, rng.end)
    return shards


def _attach_distributed(optimizer, chunks: list) -> list:
    readers = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, ReadsShardGrads):  # agoq's (AgoqDistributedOptimizer)
            if getattr(opt.config, "log_num_zeros_in_grad", False) or opt.grad_scaler is not None:
                raise NotImplementedError("--log-num-zeros-in-grad or an fp16 loss scaler with "
                                          f"{flag_for('grads.format')} store, agoq's optimizer and the distributed "
                                          "optimizer is not implemented")
            reader = ShardGradReader(chunks, opt.shard_info)
            opt.grad_reader = reader
            opt.optimizer.grad_source = reader.clipped_grad
        elif isinstance(opt, DistributedOptimizer):
            if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                raise NotImplementedError("Megatron's precision-aware distributed optimizer with "
                                          f"{flag_for('grads.format')} store is not implemented; use "
                                          f"{flag_for('optimizer.kind')} adamw|lion|sgd")
            reader = ShardGradReader(chunks, _megatron_shards(opt))
            swap_class(opt, ShardGradsDistributedOptimizer, seam="grad_reader.distributed_optimizer")
            opt.agoq_shard_reader = reader
        else:
            raise NotImplementedError(f"{flag_for('grads.format')} store with the distributed optimizer: "
                                      f"{type(opt).__name__} is not a DistributedOptimizer and cannot read the 8-bit "
                                      "shard")
        readers.append(reader)
    for chunk in chunks:
        chunk.agoq_set_shard_reader()
    return readers


def attach(optimizer, model_chunks: list):
    """Give ``optimizer`` a reader of the store-mode chunks' 8-bit reduced gradients (None when no chunk
    stores 8-bit gradients). Without the distributed optimizer: agoq's optimizer (AgoqMegatronOptimizer)
    reads per parameter and the chunks stay lazy; other optimizers keep Megatron's materialised buffer
    (None). With it: see the module docstring (a list of readers, one per distributed optimizer)."""
    chunks = [c for c in model_chunks if getattr(getattr(c, "agoq_grads", None), "mode", None) == "store"]
    if not chunks:
        return None
    if len(chunks) != len(model_chunks):
        raise NotImplementedError("agoq 8-bit gradient store: every model chunk must use it (or none)")
    if any(c.ddp_config.use_distributed_optimizer for c in chunks):
        return _attach_distributed(optimizer, chunks)
    if not hasattr(optimizer, "grad_reader"):
        return None  # Megatron's optimizers: the DDP materialises the float buffer after the reduction
    if getattr(optimizer.config, "log_num_zeros_in_grad", False):
        raise NotImplementedError(f"--log-num-zeros-in-grad with {flag_for('grads.format')} store and agoq's optimizer "
                                  f"is not implemented; drop the flag or use {flag_for('grads.mode')} reduce")
    if any(_get_param_grad_norm_group(p) is not None for p in optimizer.get_parameters()):
        raise NotImplementedError(f"separate grad-norm groups (MTP) with {flag_for('grads.format')} store and agoq's "
                                  f"optimizer are not implemented; use {flag_for('grads.mode')} reduce")
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
    # the weights moved without torch's Optimizer.step, whose post-hook invalidates agoq's FP8 weight casts
    fp8_weights_changed()
    return True
