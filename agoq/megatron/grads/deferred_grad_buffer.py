"""Megatron's float gradient buffer in ``--agoq-grads`` store mode: never allocated at construction,
allocated only while a reader needs every float gradient at once.

Seam card
---------
Touches (megatron-core 0.19.2, ``megatron/core/distributed/param_and_grad_buffer.py``):
  * ``_ParamAndGradBuffer.__init__``'s allocations, through a ``TorchFunctionMode``
    (:class:`GradBufferOnMeta`) that is active only while agoq's DDP subclass runs
    ``DistributedDataParallel.__init__`` (a ``with`` block; popped on return and on error, so no process
    state outlives the call and there is nothing for the install handle to undo). Megatron allocates
    each buffer with ``torch.zeros(numel, dtype=..., device=..., requires_grad=False)``: with the
    distributed optimizer the parameter buffer first, then the gradient buffer; without it the
    gradient buffer only; no other call in the DDP constructor passes ``requires_grad=False``. The mode
    sends the gradient buffer's call to the ``meta`` device (shape and dtype, no data); everything else
    (the parameter buffer, which the parameters are copied into) is allocated as Megatron asked.
    :func:`check_deferred` verifies the result buffer by buffer and raises if Megatron allocated
    otherwise (e.g. MXFP8's shared parameter/gradient buffer).
  * Re-points ``_ParamAndGradBuffer.grad_data``, ``_ParamAndGradBucket.grad_data`` and ``param.main_grad``
    (:class:`DeferredGradBuffer`): the views Megatron sliced out of the meta buffer are kept as
    placeholders, and :meth:`DeferredGradBuffer.allocate` rebuilds each of them with the same size,
    stride and offset on a real buffer (``as_strided``); :meth:`DeferredGradBuffer.release` puts the
    placeholders back.
Why (the options weighed against the goal "no full-size float buffer, no transient larger than one bucket"):
  * No config field or hook of megatron-core 0.19.2 skips or defers the allocation: ``nccl_ub`` only swaps
    the allocator (NCCL memory pool, CUDA), ``offload_grad_buffers`` frees the storage after it was
    allocated (what agoq did until now: Megatron's buffer existed at full size during construction,
    4 B/param on top of the parameters and the distributed optimizer's parameter buffer; 10.59 GiB
    construction peak vs ~9.9 GiB training peak, DP=2 x PP=2 3B on 4 H100).
  * Serving a real tensor whose storage was resized to 0 fails: Megatron slices ``grad_data`` into
    bucket and ``main_grad`` views inside the constructor, and creating a non-empty view of a 0-byte
    storage raises ("setStorage ... out of bounds"). A tiny throwaway real buffer fails the same way.
  * A smaller grad dtype during construction (then re-typed views) would still allocate a full-size
    buffer (1 B/param) and needs Megatron's dtype grouping (``grad_reduce_in_fp32``) changed after the
    config was built, which agoq does not do.
  * The ``meta`` device is PyTorch's own "shape without storage": slicing works and keeps the offsets,
    so Megatron's constructor runs unmodified (no copied code, no patched symbol) and the placeholders
    carry the exact geometry to re-point later. A meta tensor that is read raises ("Cannot copy out of
    meta tensor", ".item() cannot be called on meta tensors") where a 0-byte storage used to be
    undefined behaviour; in-place writes into a meta tensor are no-ops, which is why store mode
    replaces Megatron's backward hook (agoq/megatron/grads/ddp.py) for every parameter with a buffer slot.
When the buffer exists: only for readers that need every float gradient at once (Megatron's torch
  optimizers without the distributed optimizer: ``BucketStore.materialize``), from the end of the
  reduction to the next ``zero_grad_buffer`` (4 B/param then, as before).
When disabled (``--agoq-grads-mode reduce`` or no ``--agoq-grads``): not entered; Megatron allocates.
Verified on: megatron-core 0.19.2 (CPU/gloo).
Guarded by: tests/megatron/test_deferred_grad_buffer.py (construction peak, allocate/release), and
  tests/megatron/test_ddp_agoq.py / test_grad_store_memory.py (every store-mode read path trains).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from agoq.config import flag_for
from agoq.megatron.install import mark

__all__ = ["DeferredGradBuffer", "GradBufferOnMeta", "check_deferred"]

SEAM = "ddp.deferred_grad_buffer"


class GradBufferOnMeta(TorchFunctionMode):
    """Inside Megatron's DDP constructor: each ``_ParamAndGradBuffer``'s gradient-buffer allocation goes
    to the meta device (module docstring). ``distributed_optimizer``: Megatron then allocates the
    parameter buffer (kept) before each gradient buffer. ``requested`` records the device Megatron asked
    for, per meta buffer (where :class:`DeferredGradBuffer` allocates)."""

    def __init__(self, *, distributed_optimizer: bool):
        super().__init__()
        self.distributed_optimizer = distributed_optimizer
        self.next_is_param_buffer = distributed_optimizer
        self.requested: list[tuple[torch.Tensor, torch.device]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and kwargs.get("requires_grad") is False:
            if self.next_is_param_buffer:
                self.next_is_param_buffer = False
            else:
                self.next_is_param_buffer = self.distributed_optimizer
                out = func(*args, **dict(kwargs, device="meta"))
                self.requested.append((out, torch.device(kwargs.get("device", "cpu"))))
                return out
        return func(*args, **kwargs)

    def device_of(self, grad_data: torch.Tensor) -> torch.device:
        for tensor, device in self.requested:
            if tensor is grad_data:
                return device
        raise RuntimeError("agoq deferred grad buffer: this grad_data was not allocated under GradBufferOnMeta")


mark(GradBufferOnMeta, SEAM)


def check_deferred(buffers: list, mode: GradBufferOnMeta) -> None:
    """Raise unless every buffer's grad_data came out meta and nothing else did (see module docstring)."""
    bad = []
    for i, buffer in enumerate(buffers):
        if not buffer.grad_data.is_meta:
            bad.append(f"buffer {i}: grad_data was allocated ({buffer.grad_data.device})")
        if buffer.param_data is not None and buffer.param_data.is_meta:
            bad.append(f"buffer {i}: param_data is on the meta device")
        if any(p.data.is_meta for p in buffer.params):
            bad.append(f"buffer {i}: parameters are on the meta device")
    if len(mode.requested) != len(buffers):
        bad.append(f"{len(mode.requested)} allocations sent to meta for {len(buffers)} buffers")
    if bad:
        raise RuntimeError(
            f"{flag_for('grads.mode')} store: Megatron's _ParamAndGradBuffer did not allocate as agoq expects "
            "(megatron-core 0.19.2: torch.zeros(numel, ..., requires_grad=False), parameter buffer before "
            "gradient buffer; agoq/megatron/grads/deferred_grad_buffer.py): " + "; ".join(bad)
            + f". Use {flag_for('grads.mode')} reduce with this configuration."
        )


class DeferredGradBuffer:
    """The float gradient buffer of one ``_ParamAndGradBuffer`` whose ``grad_data`` is a meta tensor:
    placeholders (meta views) until :meth:`allocate`, real views until :meth:`release`."""

    def __init__(self, buffer, device: torch.device):
        if not buffer.grad_data.is_meta:
            raise ValueError("DeferredGradBuffer needs a _ParamAndGradBuffer built under GradBufferOnMeta")
        self.buffer = buffer
        self.device = device
        self.placeholder = buffer.grad_data
        self.bucket_placeholders = [bucket.grad_data for bucket in buffer.buckets]
        self.param_placeholders = {p: p.main_grad for p in buffer.params}
        for t in (*self.bucket_placeholders, *self.param_placeholders.values()):
            if not t.is_meta:
                raise RuntimeError("DeferredGradBuffer: a bucket or main_grad view is not a view of the meta buffer")
        self.views: dict = {}  # param -> the real main_grad view installed by allocate()

    @property
    def allocated(self) -> bool:
        return not self.buffer.grad_data.is_meta

    @property
    def nbytes(self) -> int:
        return 0 if not self.allocated else self.buffer.grad_data.untyped_storage().nbytes()

    def allocate(self) -> None:
        """A zeroed real buffer; bucket and main_grad views re-pointed at it (same size, stride, offset)."""
        if self.allocated:
            return
        data = torch.zeros(self.placeholder.shape, dtype=self.placeholder.dtype, device=self.device)
        self.buffer.grad_data = data
        for bucket, ph in zip(self.buffer.buckets, self.bucket_placeholders, strict=True):
            bucket.grad_data = _view_like(data, ph)
        for param, ph in self.param_placeholders.items():
            if param.main_grad is ph:  # not replaced by an installed fp32 main_grad (BucketStore._install)
                self.views[param] = param.main_grad = _view_like(data, ph)

    def release(self) -> None:
        """Drop the real buffer: placeholders back in place (views installed elsewhere are left alone)."""
        if not self.allocated:
            return
        for param, view in self.views.items():
            if param.main_grad is view:
                param.main_grad = self.param_placeholders[param]
        self.views = {}
        for bucket, ph in zip(self.buffer.buckets, self.bucket_placeholders, strict=True):
            bucket.grad_data = ph
        self.buffer.grad_data = self.placeholder


def _view_like(data: torch.Tensor, placeholder: torch.Tensor) -> torch.Tensor:
    return data.as_strided(placeholder.size(), placeholder.stride(), placeholder.storage_offset())
