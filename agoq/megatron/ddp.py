"""8-bit gradients in Megatron's DDP: 8-bit reduction of every bucket, optionally 8-bit main_grad storage.

Seam card
---------
Touches (megatron-core 0.19.2, ``megatron/core/distributed/``):
  * ``DistributedDataParallel`` — subclassed (``AgoqDistributedDataParallel``); overrides
    ``_make_backward_post_hook`` (private) and ``zero_grad_buffer`` / ``scale_gradients`` (public).
  * ``param_and_grad_buffer._ParamAndGradBucketGroup`` — private; after ``super().__init__`` every
    object in ``self.bucket_groups`` / ``self.expert_parallel_bucket_groups`` gets
    ``bg.__class__ = AgoqBucketGroup`` (shared/spec/megatron.md §1.3), which overrides
    ``start_grad_sync`` (its ``finish_grad_sync`` is reused: it only needs a handle with ``wait()``).
  * Reads ``_ParamAndGradBucket.{grad_data, params_list, gradient_scaling_factor,
    params_with_extra_main_grads}``, ``_ParamAndGradBucketGroup.{buckets, ddp_config, check_grads,
    intra_distributed_optimizer_instance_group/_size/_rank, data_parallel_group,
    cached_grad_buffer_shard_list, is_first_batch, grad_reduce_handle}``, ``shard_buffer``, the
    ``_ParamAndGradBuffer.grad_data`` storage, and ``param.grad_added_to_main_grad``.
Why: gradient communication lives in the private bucket group; a class swap is the narrowest seam
  that reaches both the all-reduce and the distributed-optimizer reduce-scatter (swapping the module
  global ``dist_reduce_scatter_func`` alone covers only the latter). agoq.comm.reduce has
  ``reduce_scatter_tensor``'s signature so an upstream hook would make this a one-symbol swap.
Modes:
  * ``reduce``: fp32 (or bf16) main_grad as in Megatron; each bucket is reduced through
    agoq.comm.reduce (all-to-all of 8-bit codes + scales, fp32 sum, requantize, all-gather; with the
    distributed optimizer the owned fp32 shard is kept and the all-gather skipped).
  * ``store``: the same reduction, and main_grad is accumulated in 8 bits (QuantizedGradBuffer, one
    block grid per parameter, dequant-add-requant in the backward post-hook). The float grad buffer's
    storage is released in ``zero_grad_buffer`` and re-materialised (dequantized) only when the
    bucket's reduction starts, so it does not exist during forward/backward; the optimizer then reads
    float main_grad as usual.
Kept: ``check_for_nan_in_grad`` (Megatron's check runs on the float bucket before communication,
  and NaN blocks stay NaN through the reduction), gradient scaling, grad-norm clipping, loss scaling,
  ``overlap_grad_reduce`` (async handles), TP / PP / VPP, expert buffers.
Not supported (raise): ``num_distributed_optimizer_instances > 1``; ``store`` with
  ``gradient_accumulation_fusion`` (wgrad kernels write into main_grad directly).
Verified on: megatron-core 0.19.2 (CPU/gloo).
When disabled: ``wrap_ddp_agoq(..., grad_format=None)`` builds Megatron's own DDP.
Guarded by: tests/megatron/test_ddp_agoq.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup, shard_buffer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from agoq.comm.grad_buffer import QuantizedGradBuffer
from agoq.comm.reduce import allreduce_8bit, check_grad_format, reduce_scatter_8bit

GRAD_MODES = ("reduce", "store")


@dataclass(frozen=True, kw_only=True)
class GradConfig:
    fmt: str
    """Gradient format (agoq.formats name), e.g. int8_b256."""
    mode: str = "store"
    """reduce: 8-bit communication only; store: also 8-bit main_grad accumulation."""
    error_feedback: bool = False
    """store mode: keep the requantization error in a bf16 residual (2 more bytes per parameter)."""

    def __post_init__(self):
        check_grad_format(self.fmt)
        if self.mode not in GRAD_MODES:
            raise ValueError(f"GradConfig.mode={self.mode!r}: choose one of {GRAD_MODES}")
        if self.error_feedback and self.mode != "store":
            raise ValueError("GradConfig.error_feedback needs mode='store' (it corrects 8-bit accumulation)")


class _Handles:
    """One ``wait()`` for the per-bucket handles of a bucket group (rank-ordered, as issued)."""

    def __init__(self, handles: list):
        self.handles = [h for h in handles if h is not None]

    def wait(self) -> None:
        for h in self.handles:
            h.wait()
        self.handles = []


class AgoqBucketGroup(_ParamAndGradBucketGroup):
    """Bucket group whose grad reduction goes through agoq.comm.reduce (installed by class swap)."""

    agoq_grad: GradConfig
    agoq_store: dict | None  # bucket index -> (QuantizedGradBuffer, params) in store mode

    def _materialize(self) -> None:
        """store mode: dequantize the 8-bit gradients into the (re-allocated) float buckets."""
        for idx, bucket in enumerate(self.buckets):
            _ensure_allocated(bucket.grad_data)
            qbuf, params = self.agoq_store[idx]
            flat = bucket.grad_data.view(-1)
            for seg, param in enumerate(params):
                start, end = bucket.param_to_index[param]
                flat[start:end].copy_(qbuf.dequantize(seg))

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # Megatron: no-op when already dispatched in the first batch
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        if self.agoq_store is not None:
            self._materialize()
        for bucket in self.buckets:
            for param in bucket.params_with_extra_main_grads:
                if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                    param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)
        cfg = self.ddp_config
        if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=cfg.check_for_nan_in_grad, check_for_large=cfg.check_for_large_grads)
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        op = torch.distributed.ReduceOp.AVG if cfg.average_in_collective else torch.distributed.ReduceOp.SUM
        async_op = cfg.overlap_grad_reduce
        handles = [self._reduce_bucket(idx, bucket, op, async_op, force_all_reduce)
                   for idx, bucket in enumerate(self.buckets)]
        self.grad_reduce_handle = _Handles(handles) if async_op else None

    def _reduce_bucket(self, idx, bucket, op, async_op: bool, force_all_reduce: bool):
        fmt = self.agoq_grad.fmt
        if self.ddp_config.use_distributed_optimizer and not force_all_reduce:
            group = self.intra_distributed_optimizer_instance_group
            if self.cached_grad_buffer_shard_list[idx] is None:
                self.cached_grad_buffer_shard_list[idx] = shard_buffer(
                    bucket.grad_data, self.intra_distributed_optimizer_instance_size
                )
            shard = self.cached_grad_buffer_shard_list[idx][self.intra_distributed_optimizer_instance_rank]
            return reduce_scatter_8bit(shard, bucket.grad_data, op, group, async_op, fmt=fmt)
        group = (self.intra_distributed_optimizer_instance_group if self.ddp_config.use_distributed_optimizer
                 else self.data_parallel_group)
        return allreduce_8bit(bucket.grad_data, op, group, async_op, fmt=fmt)


def _ensure_allocated(grad_data: torch.Tensor) -> None:
    storage = grad_data.untyped_storage()
    wanted = (grad_data.storage_offset() + grad_data.numel()) * grad_data.element_size()
    if storage.nbytes() < wanted:
        storage.resize_(wanted)
        grad_data.zero_()


class AgoqDistributedDataParallel(DistributedDataParallel):
    """Megatron's DDP with 8-bit gradient reduction (and, in ``store`` mode, 8-bit main_grad)."""

    def __init__(self, config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                 module: torch.nn.Module, disable_bucketing: bool = False, pg_collection=None, *,
                 grad: GradConfig):
        _check_supported(config, ddp_config, grad)
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                         pg_collection=pg_collection)
        self.agoq_grad = grad
        self._agoq_slots: dict = {}  # param -> (QuantizedGradBuffer, segment index)
        for bg in self.bucket_groups + self.expert_parallel_bucket_groups:
            bg.__class__ = AgoqBucketGroup
            bg.agoq_grad = grad
            bg.agoq_store = self._build_store(bg) if grad.mode == "store" else None
        if grad.mode == "store":
            self._release_float_buffers()

    def _build_store(self, bucket_group) -> dict:
        store = {}
        device = bucket_group.buckets[0].grad_data.device
        for idx, bucket in enumerate(bucket_group.buckets):
            params = list(bucket.params_list)
            qbuf = QuantizedGradBuffer([p.numel() for p in params], self.agoq_grad.fmt, device,
                                       error_feedback=self.agoq_grad.error_feedback)
            store[idx] = (qbuf, params)
            for seg, param in enumerate(params):
                self._agoq_slots[param] = (qbuf, seg)
        return store

    def quantized_grad_buffers(self) -> list[QuantizedGradBuffer]:
        seen = {}
        for qbuf, _ in self._agoq_slots.values():
            seen[id(qbuf)] = qbuf
        return list(seen.values())

    def _release_float_buffers(self) -> None:
        """Free the float grad buffers' storage (views stay valid; re-allocated by _materialize)."""
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.grad_data.untyped_storage().resize_(0)

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        default_hook = super()._make_backward_post_hook(param)

        def hook(*unused):
            grad_cfg = getattr(self, "agoq_grad", None)
            if grad_cfg is None or grad_cfg.mode != "store" or param not in self.param_to_bucket_group:
                return default_hook(*unused)
            if self.ddp_config.overlap_grad_reduce and param.grad is None:
                raise RuntimeError("param.grad is None under overlap_grad_reduce (Megatron's invariant)")
            if param.grad is not None and not param.grad_added_to_main_grad:
                qbuf, seg = self._agoq_slots[param]
                qbuf.accumulate(seg, param.grad.data)
            param.grad = None
            if self.ddp_config.overlap_grad_reduce:
                self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)

        return hook

    def zero_grad_buffer(self):
        if getattr(self, "agoq_grad", None) is None or self.agoq_grad.mode != "store":
            return super().zero_grad_buffer()
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for qbuf in self.quantized_grad_buffers():
            qbuf.zero_()
        self._release_float_buffers()
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()

    def scale_gradients(self, scaling_factor: float):
        if self.agoq_grad.mode != "store":
            return super().scale_gradients(scaling_factor)
        buffers = self.buffers + self.expert_parallel_buffers
        if any(b.grad_data.untyped_storage().nbytes() > 0 for b in buffers):
            return super().scale_gradients(scaling_factor)  # materialised: scale the float values
        for qbuf in self.quantized_grad_buffers():
            qbuf.scale_(scaling_factor)


def _check_supported(config: TransformerConfig, ddp_config: DistributedDataParallelConfig, grad: GradConfig) -> None:
    if ddp_config.num_distributed_optimizer_instances > 1:
        raise NotImplementedError(
            "agoq 8-bit gradients support num_distributed_optimizer_instances=1 only; drop "
            "--num-distributed-optimizer-instances or --agoq-grads"
        )
    if grad.mode == "store" and config.gradient_accumulation_fusion:
        raise NotImplementedError(
            "--agoq-grads-mode store accumulates main_grad in 8 bits, but gradient_accumulation_fusion "
            "writes wgrads into main_grad directly; disable gradient accumulation fusion or use mode reduce"
        )


def wrap_ddp_agoq(chunks: list, config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                  device: torch.device, grad_format: str | GradConfig | None) -> list:
    """agoq/megatron/model.py:wrap_ddp with 8-bit gradients (``grad_format=None``: Megatron's DDP).

    ``grad_format`` is a format name (mode ``store``, no error feedback) or a full GradConfig.
    """
    if grad_format is None:
        from agoq.megatron.model import wrap_ddp

        return wrap_ddp(chunks, config, ddp_config, device)
    grad = grad_format if isinstance(grad_format, GradConfig) else GradConfig(fmt=grad_format)
    wrapped = []
    for idx, chunk in enumerate(chunks):
        chunk.to(device)
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)  # as Megatron's get_model (see model.wrap_ddp)
        wrapped.append(AgoqDistributedDataParallel(config, ddp_config, chunk, disable_bucketing=idx > 0, grad=grad))
    return wrapped


# -- command line, planner, memory report ----------------------------------------------------------

def add_grad_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--agoq-grads FORMAT, --agoq-grads-mode, --agoq-grads-error-feedback (the lead wires them in args.py)."""
    g = parser.add_argument_group("agoq gradients")
    g.add_argument("--agoq-grads", default=None, metavar="FORMAT",
                   help="8-bit gradients in DDP, e.g. int8_b256 (agoq.formats name); default: off "
                        "(Megatron's float gradients). A policy YAML's grads: entry gives the same choice.")
    g.add_argument("--agoq-grads-mode", choices=GRAD_MODES, default="store",
                   help="reduce: 8-bit communication, float main_grad; store: also 8-bit main_grad accumulation")
    g.add_argument("--agoq-grads-error-feedback", action="store_true",
                   help="store mode: keep the requantization error in a bf16 residual (+2 bytes/param)")
    return parser


def grad_config_from_args(args) -> GradConfig | None:
    if args.agoq_grads is None or args.agoq_grads in ("fp32", "bf16", "fp16"):
        if getattr(args, "agoq_grads_error_feedback", False):
            raise ValueError("--agoq-grads-error-feedback needs --agoq-grads FORMAT (a quantized format)")
        return None
    return GradConfig(fmt=args.agoq_grads, mode=args.agoq_grads_mode,
                      error_feedback=args.agoq_grads_error_feedback)


def grad_bytes_per_param(grad: GradConfig | None, *, grad_reduce_in_fp32: bool,
                         params_dtype: torch.dtype) -> float:
    """Planner: bytes per parameter of the gradient held during forward/backward (padding ignored).

    Megatron: 4 (fp32 main_grad) or the param dtype's size. agoq store: codes + scales (+ bf16
    residual with error feedback); the float buffer exists only between the reduction and the next
    zero_grad_buffer. agoq reduce: Megatron's number.
    """
    float_bytes = 4.0 if grad_reduce_in_fp32 else float(torch.finfo(params_dtype).bits // 8)
    if grad is None or grad.mode == "reduce":
        return float_bytes
    fmt = check_grad_format(grad.fmt)
    return fmt.bytes_per_element() + (2.0 if grad.error_feedback else 0.0)


def grad_memory_report(model_chunks: list) -> dict:
    """Measured gradient bytes of DDP-wrapped chunks: float buffers allocated now, 8-bit storage, numel."""
    numel = float_bytes = quant_bytes = 0
    for chunk in model_chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            numel += sum(p.numel() for p in buffer.params)
            float_bytes += buffer.grad_data.untyped_storage().nbytes()
        if isinstance(chunk, AgoqDistributedDataParallel):
            quant_bytes += sum(q.nbytes for q in chunk.quantized_grad_buffers())
    total = float_bytes + quant_bytes
    return {"grad_numel": numel, "grad_float_bytes": float_bytes, "grad_quant_bytes": quant_bytes,
            "grad_bytes_per_param": total / max(numel, 1)}
