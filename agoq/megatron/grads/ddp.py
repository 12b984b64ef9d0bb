"""8-bit gradients in Megatron's DDP: 8-bit reduction of every bucket, optionally 8-bit main_grad storage.

Seam card
---------
Touches (megatron-core 0.19.2, ``megatron/core/distributed/``):
  * ``DistributedDataParallel`` — subclassed (``AgoqDistributedDataParallel``); overrides
    ``_make_backward_post_hook`` (private) and ``zero_grad_buffer`` / ``scale_gradients`` (public).
  * ``param_and_grad_buffer._ParamAndGradBucketGroup`` — private; after ``super().__init__`` every
    object in ``self.bucket_groups`` / ``self.expert_parallel_bucket_groups`` is attached by one call,
    :func:`attach_bucket_group`: ``bg.__class__ = AgoqBucketGroup`` (through
    ``agoq.megatron.install.swap_class``: marked, undone by the install handle)
    and one typed attribute ``bg.agoq`` (:class:`GroupGrads`: format, transport, stores, lazy flag), which overrides
    ``start_grad_sync``, ``check_grads`` and ``finish_grad_sync`` (Megatron's, then agoq's
    post-reduction step; Megatron's only needs a handle with ``wait()``).
  * ``_ParamAndGradBuffer.__init__``'s gradient-buffer allocation (store mode): Megatron's constructor runs
    under agoq/megatron/grads/deferred_grad_buffer.py's scoped ``TorchFunctionMode``, which puts that buffer on
    the meta device; its bucket and ``main_grad`` views are placeholders, re-pointed at a real buffer
    only by the materialize path (no full-size float buffer at construction; why this mechanism: there).
  * Reads ``_ParamAndGradBucket.{grad_data, params_list, param_to_index, gradient_scaling_factor,
    params_with_extra_main_grads}``, ``_ParamAndGradBucketGroup.{buckets, ddp_config,
    intra_distributed_optimizer_instance_group/_size/_rank, data_parallel_group,
    cached_grad_buffer_shard_list, is_first_batch, grad_reduce_handle}``, ``shard_buffer``, the
    ``_ParamAndGradBuffer.{grad_data, buckets}`` storage, ``param.grad_added_to_main_grad``, and
    (store mode) re-points ``param.main_grad`` between the reduction and the next zero_grad_buffer.
Why: gradient communication lives in the private bucket group; a class swap is the narrowest seam
  that reaches both the all-reduce and the distributed-optimizer reduce-scatter (swapping the module
  global ``dist_reduce_scatter_func`` alone covers only the latter). agoq.comm.reduce has
  ``reduce_scatter_tensor``'s signature so an upstream hook would make this a one-symbol swap.
Modes:
  * ``reduce``: fp32 (or bf16) main_grad as in Megatron; each bucket is reduced through
    agoq.comm.reduce (all-to-all of 8-bit codes + scales, fp32 sum, requantize, all-gather; with the
    distributed optimizer the owned fp32 shard is kept and the all-gather skipped). Megatron's
    gradient_scaling_factor is applied to the fp32 sum (no separate pass over the buffer).
  * ``store``: main_grad is accumulated in 8 bits (agoq/megatron/grads/grad_store.py: one block grid per
    parameter, dequant-add-requant in the backward post-hook) and Megatron's float grad buffer is not
    allocated, not even at construction (meta placeholders, agoq/megatron/grads/deferred_grad_buffer.py). The
    reduction works on the 8-bit store directly (no float copy of the bucket): without the distributed
    optimizer the reduced gradient stays 8-bit in the store, and either a reader dequantizes it one
    parameter at a time (``agoq_set_lazy(True)``, done by agoq's optimizer through
    agoq/megatron/grads/grad_reader.py) or, for optimizers that need every ``.grad`` at once (Megatron's
    torch optimizers), it is dequantized into the float buffer in ``finish_grad_sync`` (allocated
    there and every bucket / main_grad view re-pointed at it; placeholders back in
    ``zero_grad_buffer``). With the distributed optimizer the owned shard's sum is requantized in place
    into the 8-bit store (no float window, no float buffer) and the optimizer reads it through
    agoq/megatron/grads/grad_reader.py (``attach``; the reduction raises without it).
Kept: ``check_for_nan_in_grad`` (store mode: the same check on the norm of the 8-bit bucket; NaN
  blocks stay NaN through the reduction), gradient scaling, grad-norm clipping, loss scaling,
  ``overlap_grad_reduce`` (async handles; on CUDA the reduction runs on a side stream), TP / PP / VPP,
  expert buffers; ``agoq_grads_nonfinite()`` for the training loop's skip check.
Not supported (raise): ``num_distributed_optimizer_instances > 1``; ``store`` with
  ``gradient_accumulation_fusion`` (wgrad kernels write into main_grad directly), with Megatron's
  promoted fp32 main_grads next to a bf16 buffer, or with ``reuse_grad_buf_for_mxfp8_param_ag``.
Verified on: megatron-core 0.19.2 (CPU/gloo).
When disabled: ``wrap_ddp_agoq(..., grads=None)`` (or a GradsConfig without a quantized format) builds Megatron's
own DDP.
Guarded by: tests/megatron/test_ddp_agoq.py, tests/megatron/test_deferred_grad_buffer.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup, shard_buffer
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from agoq.comm.grad_buffer import QuantizedGradBuffer
from agoq.comm.pipeline import check_reduction_kernel, run_maybe_async
from agoq.comm.reduce import allreduce_8bit, reduce_scatter_8bit
from agoq.comm.symm import allreduce_8bit_peer, reduce_scatter_8bit_peer
from agoq.config import flag_for
from agoq.config.sections import GradsConfig
from agoq.config.values import GRAD_MODES, GRAD_TRANSPORTS
from agoq.megatron.grads.deferred_grad_buffer import DeferredGradBuffer, GradBufferOnMeta, check_deferred
from agoq.megatron.grads.grad_store import BucketStore, finalize_touched
from agoq.megatron.grads.grad_transport import resolve_transport
from agoq.megatron.graphs import check_cuda_graphs
from agoq.megatron.install import mark, swap_class
from agoq.ops.nonfinite import nonfinite_in

__all__ = ["GRAD_MODES", "GRAD_TRANSPORTS", "GroupGrads", "AgoqBucketGroup", "AgoqDistributedDataParallel",
           "attach_bucket_group", "wrap_ddp_agoq", "grad_memory_report"]


@dataclass(kw_only=True)
class GroupGrads:
    """What agoq keeps on one of Megatron's bucket groups (``bg.agoq``, set by :func:`attach_bucket_group`): the run's
    gradient config, this group's resolved transport, its 8-bit stores and the reduction's state."""

    grads: GradsConfig
    """The run's gradient config (a quantized format)."""
    transport: str
    """This group's resolved transport: nccl or peer (agoq.megatron.grads.grad_transport.resolve_transport)."""
    stores: list | None
    """Store mode: one BucketStore per bucket; reduce mode: None."""
    on_reduced: Callable | None = None
    """Store mode: called with the group after an all-reduce (the DDP allocates the float buffer)."""
    chunk_bytes: int | None = None
    """Codes per pipeline chunk of the reduction (None: agoq.comm.pipeline's automatic size)."""
    lazy: bool = False
    """Store mode, all-reduce: leave the reduced gradient 8-bit (a reader dequantizes it)."""
    reduced_pending: bool = field(default=False, repr=False)
    """A reduction was started and its post-reduction step has not run yet."""


class _Handles:
    """One ``wait()`` for the per-bucket handles of a bucket group (rank-ordered, as issued)."""

    def __init__(self, handles: list):
        self.handles = [h for h in handles if h is not None]

    def wait(self) -> None:
        for h in self.handles:
            h.wait()
        self.handles = []


class AgoqBucketGroup(_ParamAndGradBucketGroup):
    """Bucket group whose grad reduction goes through agoq.comm (installed by :func:`attach_bucket_group`)."""

    agoq: GroupGrads

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # Megatron: no-op when already dispatched in the first batch
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        cfg = self.ddp_config
        if self.agoq.stores is None:
            for bucket in self.buckets:
                for param in bucket.params_with_extra_main_grads:
                    if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                        param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)
        if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=cfg.check_for_nan_in_grad, check_for_large=cfg.check_for_large_grads)
        average = bool(cfg.average_in_collective)
        async_op = cfg.overlap_grad_reduce
        handles = [self._reduce_bucket(idx, bucket, average, async_op, force_all_reduce)
                   for idx, bucket in enumerate(self.buckets)]
        self.agoq.reduced_pending = True
        self.grad_reduce_handle = _Handles(handles) if async_op else None

    def _uses_reduce_scatter(self, force_all_reduce: bool) -> bool:
        return bool(self.ddp_config.use_distributed_optimizer and not force_all_reduce)

    def _group(self):
        return (self.intra_distributed_optimizer_instance_group if self.ddp_config.use_distributed_optimizer
                else self.data_parallel_group)

    def _reduce_bucket(self, idx, bucket, average: bool, async_op: bool, force_all_reduce: bool):
        """The one dispatcher of a bucket's reduction: 8-bit store or float buffer x reduce-scatter (distributed
        optimizer) or all-reduce x this group's transport (peer: NVLink peer memory; nccl: agoq.comm.reduce)."""
        state, group = self.agoq, self._group()
        scale = float(bucket.gradient_scaling_factor)  # Megatron scales before the sum; agoq after it
        scatter = self._uses_reduce_scatter(force_all_reduce)
        if state.stores is not None:  # the store knows its storage (peer memory or not)
            store = state.stores[idx]
            start = store.start_reduce_scatter if scatter else store.start_allreduce
            return start(group, average=average, post_scale=scale, async_op=async_op)
        fmt, chunk = state.grads.format, state.chunk_bytes
        op = torch.distributed.ReduceOp.AVG if average else torch.distributed.ReduceOp.SUM
        peer = state.transport == "peer"
        if scatter:
            if self.cached_grad_buffer_shard_list[idx] is None:
                self.cached_grad_buffer_shard_list[idx] = shard_buffer(
                    bucket.grad_data, self.intra_distributed_optimizer_instance_size
                )
            shard = self.cached_grad_buffer_shard_list[idx][self.intra_distributed_optimizer_instance_rank]
            if peer:
                return run_maybe_async(bucket.grad_data.device, lambda: reduce_scatter_8bit_peer(
                    shard, bucket.grad_data, op, group, fmt=fmt, post_scale=scale), async_op=async_op)
            return reduce_scatter_8bit(shard, bucket.grad_data, op, group, async_op, fmt=fmt,
                                       post_scale=scale, chunk_bytes=chunk)
        if peer:
            return run_maybe_async(bucket.grad_data.device, lambda: allreduce_8bit_peer(
                bucket.grad_data, op, group, fmt=fmt, post_scale=scale), async_op=async_op)
        return allreduce_8bit(bucket.grad_data, op, group, async_op, fmt=fmt, post_scale=scale,
                              chunk_bytes=chunk)

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        super().finish_grad_sync(force_all_reduce=force_all_reduce)
        state = self.agoq
        if state.stores is not None and state.reduced_pending:
            state.reduced_pending = False
            if self._uses_reduce_scatter(force_all_reduce):
                for store in state.stores:
                    store.finish_reduce_scatter()
            else:
                if state.lazy:
                    for store in state.stores:
                        store.install_touched()
                else:
                    state.on_reduced(self)
                    for store in state.stores:
                        store.materialize()

    def check_grads(self, check_for_nan_or_inf, check_for_large):
        """Megatron's pre-communication check; in store mode the norm is taken from the 8-bit buffer."""
        if self.agoq.stores is None:
            return super().check_grads(check_for_nan_or_inf, check_for_large)
        rerun_state_machine = get_rerun_state_machine()
        for i, store in enumerate(self.agoq.stores):
            grad_norm = store.qbuf.sq_norm().sqrt()
            where = f"bucket #{i} in backward pass before data-parallel communication collective"
            if check_for_nan_or_inf:
                rerun_state_machine.validate_result(result=grad_norm, rejection_func=torch.isnan,
                                                    message=f"found NaN in local grad norm for {where}",
                                                    tolerance=0.001, fatal=True)
                rerun_state_machine.validate_result(result=grad_norm, rejection_func=torch.isinf,
                                                    message=f"found Inf in local grad norm for {where}",
                                                    tolerance=0.001, fatal=True)
            if check_for_large:
                rerun_state_machine.validate_result(
                    result=grad_norm, rejection_func=partial(rerun_state_machine.is_unexpectedly_large,
                                                             threshold=10, context="grads"),
                    message=f"found unexpected large grads in {where}", tolerance=0.001, fatal=False)


mark(AgoqBucketGroup, "ddp.bucket_group")


def attach_bucket_group(bucket_group: _ParamAndGradBucketGroup, state: GroupGrads) -> None:
    """The one call that puts agoq's 8-bit gradient path on one of Megatron's bucket groups: the class swap
    (``swap_class``: marked, undone by the install handle) and its typed state ``bucket_group.agoq``."""
    swap_class(bucket_group, AgoqBucketGroup, seam="ddp.bucket_group")
    bucket_group.agoq = state


class AgoqDistributedDataParallel(DistributedDataParallel):
    """Megatron's DDP with 8-bit gradient reduction (and, in ``store`` mode, 8-bit main_grad)."""

    def __init__(self, config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                 module: torch.nn.Module, disable_bucketing: bool = False, pg_collection=None, *,
                 grads: GradsConfig, chunk_bytes: int | None = None):
        if not grads.quantized:
            raise ValueError("AgoqDistributedDataParallel needs a quantized gradient format, got "
                             f"{flag_for('grads.format')} {grads.format}; build Megatron's DDP "
                             "(agoq.megatron.grads.ddp.wrap_ddp_agoq does)")
        _check_supported(config, ddp_config, grads)
        check_reduction_kernel(next(iter(module.parameters())).device, grads.format)
        if grads.mode == "store":  # Megatron's float grad buffer: meta placeholders (deferred_grad_buffer.py)
            with GradBufferOnMeta(distributed_optimizer=ddp_config.use_distributed_optimizer) as on_meta:
                super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                                 pg_collection=pg_collection)
            check_deferred(self.buffers + self.expert_parallel_buffers, on_meta)
            self._agoq_float_buffers = {id(b): DeferredGradBuffer(b, on_meta.device_of(b.grad_data))
                                        for b in self.buffers + self.expert_parallel_buffers}
        else:
            super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                             pg_collection=pg_collection)
            self._agoq_float_buffers = {}
        self.agoq_grads = grads
        self.agoq_chunk_bytes = chunk_bytes
        self._agoq_store_of: dict = {}  # param -> BucketStore
        touched = {p for name, p in self.module.named_parameters() if finalize_touched(p, name)}
        self.agoq_transport = {}  # process-group name -> (transport, reason), for the start-up report
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            transport = self._transport_of(self._reduction_group(bg))
            stores = self._build_stores(bg, touched, transport) if grads.mode == "store" else None
            attach_bucket_group(bg, GroupGrads(grads=grads, transport=transport, stores=stores,
                                               on_reduced=self._allocate_float_buffer_of, chunk_bytes=chunk_bytes))

    def _build_stores(self, bucket_group, touched: set, transport: str) -> list[BucketStore]:
        if any(b.params_with_extra_main_grads for b in bucket_group.buckets):
            raise NotImplementedError(
                f"{flag_for('grads.mode')} store: some parameters keep a separate fp32 main_grad next to a bf16 grad "
                f"buffer (Megatron's promoted main_grads); use {flag_for('grads.mode')} reduce or --grad-reduce-in-fp32"
            )
        group = self._reduction_group(bucket_group)
        world, rank = group.size(), group.rank()
        peer_group = group if transport == "peer" else None
        stores = []
        for bucket in bucket_group.buckets:
            device = self._agoq_float_buffers[id(self._buffer_of(bucket))].device  # grad_data is meta here
            store = BucketStore(bucket, self.agoq_grads.format, device,
                                error_feedback=self.agoq_grads.error_feedback, world=world, rank=rank,
                                touched=touched, chunk_bytes=self.agoq_chunk_bytes, peer_group=peer_group)
            stores.append(store)
            for param in store.params:
                self._agoq_store_of[param] = store
        return stores

    def _reduction_group(self, bucket_group):
        return (bucket_group.intra_distributed_optimizer_instance_group
                if self.ddp_config.use_distributed_optimizer else bucket_group.data_parallel_group)

    def _transport_of(self, group) -> str:
        """The group's transport (resolved once per group: a collective on the first call)."""
        name = getattr(group, "group_name", str(id(group)))
        if name not in self.agoq_transport:
            device = next(iter(self.module.parameters())).device
            self.agoq_transport[name] = resolve_transport(self.agoq_grads.transport, group, device,
                                                          self.agoq_grads.format)
        return self.agoq_transport[name][0]

    def stores(self) -> list[BucketStore]:
        return [s for bg in self.bucket_groups + self.expert_parallel_bucket_groups for s in (bg.agoq.stores or [])]

    def quantized_grad_buffers(self) -> list[QuantizedGradBuffer]:
        return [s.qbuf for s in self.stores()]

    def agoq_set_lazy(self, lazy: bool) -> None:
        """Store mode, all-reduce: keep the reduced gradient 8-bit after finish_grad_sync (a reader
        dequantizes it per parameter) instead of materialising Megatron's float grad buffer."""
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            bg.agoq.lazy = lazy

    def agoq_grad_of(self, param) -> torch.Tensor | None:
        """Reduced fp32 gradient of ``param`` (store mode; None for parameters without a DDP gradient)."""
        store = self._agoq_store_of.get(param)
        return None if store is None else store.grad(param)

    def agoq_shard_grad_of(self, param, start: int, end: int) -> torch.Tensor | None:
        """Distributed optimizer, store mode: fp32 reduced gradient of ``param``'s flat elements
        [start, end) (this rank's shard; None for parameters without a DDP gradient)."""
        store = self._agoq_store_of.get(param)
        return None if store is None else store.shard_grad(param, start, end)

    def agoq_set_shard_reader(self) -> None:
        """agoq/megatron/grads/grad_reader.py attached a reader of the 8-bit reduced shards (see BucketStore)."""
        for store in self.stores():
            store.reader_attached = True

    def agoq_grads_nonfinite(self) -> bool:
        """True when this rank's gradients hold NaN/Inf (store mode: 8-bit scales and float windows;
        otherwise Megatron's float grad buffers)."""
        if self.agoq_grads.mode == "store":
            return any(store.nonfinite() for store in self.stores())
        found = None
        for b in self.buffers + self.expert_parallel_buffers:
            found = nonfinite_in(b.grad_data, found)
        return found is not None and bool(found)

    def _buffer_of(self, bucket):
        return next(b for b in self.buffers + self.expert_parallel_buffers
                    if any(x is bucket for x in b.buckets))

    def _allocate_float_buffer_of(self, bucket_group) -> None:
        """Store mode, before materialize(): Megatron's float buffers of the group's buckets, allocated."""
        for bucket in bucket_group.buckets:
            self._agoq_float_buffers[id(self._buffer_of(bucket))].allocate()

    def _release_float_buffers(self) -> None:
        """Store mode: drop the float grad buffers (meta placeholders back; re-allocated by materialize)."""
        for deferred in self._agoq_float_buffers.values():
            deferred.release()

    def agoq_float_grad_bytes(self) -> int:
        """Bytes of Megatron's float grad buffers allocated now (store mode: 0 unless materialised)."""
        if self.agoq_grads.mode == "store":
            return sum(d.nbytes for d in self._agoq_float_buffers.values())
        return sum(b.grad_data.untyped_storage().nbytes() for b in self.buffers + self.expert_parallel_buffers)

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        default_hook = super()._make_backward_post_hook(param)

        def hook(*unused):
            grads = getattr(self, "agoq_grads", None)
            if grads is None or grads.mode != "store" or param not in self.param_to_bucket_group:
                return default_hook(*unused)
            if self.ddp_config.overlap_grad_reduce and param.grad is None:
                raise RuntimeError("param.grad is None under overlap_grad_reduce (Megatron's invariant)")
            if param.grad is not None and not param.grad_added_to_main_grad:
                self._agoq_store_of[param].accumulate(param, param.grad.data)
            param.grad = None
            if self.ddp_config.overlap_grad_reduce:
                self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)

        return hook

    def zero_grad_buffer(self):
        if getattr(self, "agoq_grads", None) is None or self.agoq_grads.mode != "store":
            return super().zero_grad_buffer()
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for store in self.stores():
            store.release()
        self._release_float_buffers()
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()

    def scale_gradients(self, scaling_factor):
        if self.agoq_grads.mode != "store":
            return super().scale_gradients(scaling_factor)
        if any(d.allocated for d in self._agoq_float_buffers.values()):
            super().scale_gradients(scaling_factor)  # materialised: scale the float values as Megatron
        for store in self.stores():
            store.scale_(scaling_factor)


def _check_supported(config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                     grad: GradsConfig) -> None:
    check_cuda_graphs(config, ["grads_store" if grad.mode == "store" else "grads_reduce"])
    if ddp_config.num_distributed_optimizer_instances > 1:
        raise NotImplementedError(
            "agoq 8-bit gradients support num_distributed_optimizer_instances=1 only; drop "
            f"--num-distributed-optimizer-instances or {flag_for('grads.format')}"
        )
    if grad.mode == "store" and getattr(ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise NotImplementedError(
            f"{flag_for('grads.mode')} store frees Megatron's grad buffer, which reuse_grad_buf_for_mxfp8_param_ag "
            f"uses as the parameter all-gather buffer; turn that option off or use {flag_for('grads.mode')} reduce"
        )
    if grad.mode == "store" and config.gradient_accumulation_fusion:
        raise NotImplementedError(
            f"{flag_for('grads.mode')} store accumulates main_grad in 8 bits, but gradient_accumulation_fusion "
            "writes wgrads into main_grad directly; disable gradient accumulation fusion or use mode reduce"
        )


def wrap_ddp_agoq(chunks: list, config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                  device: torch.device, grads: GradsConfig | None, *, chunk_bytes: int | None = None) -> list:
    """agoq/megatron/model.py:wrap_ddp with 8-bit gradients: the run's ``AgoqConfig.grads`` (None, or no quantized
    format: Megatron's DDP). ``chunk_bytes``: codes per pipeline chunk of the reduction (None: automatic; tests and
    benchmarks set it)."""
    if grads is None or not grads.quantized:
        from agoq.megatron.model import wrap_ddp

        return wrap_ddp(chunks, config, ddp_config, device)
    wrapped = []
    for idx, chunk in enumerate(chunks):
        chunk.to(device)
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)  # as Megatron's get_model (see model.wrap_ddp)
        wrapped.append(AgoqDistributedDataParallel(config, ddp_config, chunk, disable_bucketing=idx > 0, grads=grads,
                                                   chunk_bytes=chunk_bytes))
    return wrapped


# -- memory report --------------------------------------------------------------------------------------

def grad_memory_report(model_chunks: list) -> dict:
    """Measured gradient bytes of DDP-wrapped chunks: float buffers allocated now, 8-bit storage, numel."""
    numel = float_bytes = quant_bytes = 0
    for chunk in model_chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            numel += sum(p.numel() for p in buffer.params)
        if isinstance(chunk, AgoqDistributedDataParallel):
            float_bytes += chunk.agoq_float_grad_bytes()
            quant_bytes += sum(q.nbytes for q in chunk.quantized_grad_buffers())
        else:
            float_bytes += sum(b.grad_data.untyped_storage().nbytes()
                               for b in chunk.buffers + chunk.expert_parallel_buffers)
    total = float_bytes + quant_bytes
    return {"grad_numel": numel, "grad_float_bytes": float_bytes, "grad_quant_bytes": quant_bytes,
            "grad_bytes_per_param": total / max(numel, 1)}
