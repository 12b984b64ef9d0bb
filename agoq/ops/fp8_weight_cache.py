"""FP8 copies of a linear's weight kept across micro-batches: the weight only changes at the optimizer
step, so its FP8 casts (row-major for the forward GEMM, transposed for dgrad) are made once per
weight version instead of twice per micro-batch (forward cast + backward re-cast).

A cached entry is valid while all of these hold (checked on the host, no GPU sync):
  - the weight generation is unchanged: :func:`fp8_weights_changed` bumps it; agoq calls it after every
    ``torch.optim.Optimizer.step`` (a process-wide step post-hook, :func:`install_optimizer_hook`:
    registered by ``agoq.megatron.install`` as its ``fp8_weight_cache`` seam and removed by the install
    handle's ``undo()``; without install, e.g. agoq.ops used alone, the first cache adds it; Megatron's
    optimizers and agoq's step through a torch optimizer) and at the start of every training / eval
    step (agoq.train.training.StepRunner);
  - the weight tensor is the same (``data_ptr``, shape, dtype) and its autograd version counter
    (``weight._version``, bumped by in-place ops such as ``copy_`` or ``load_state_dict``) is unchanged;
  - the recipe object is the same.
Caveat: code that rewrites weights through ``.data`` outside an optimizer step (no version bump, no
hook) must call :func:`fp8_weights_changed` itself.

Memory: one FP8 copy of the weight in each layout (2 bytes per parameter of every cached linear),
shared by all micro-batches in flight; a backward holds the entry its forward used even if the cache
has moved on.

CUDA graphs (``graph_phase``, set by the owner: agoq.megatron.graphs; None, the default, is everything above).
A replay runs no Python, so no host check can skip a cast: under ``"capture"`` every call makes a fresh entry
inside the graph (each micro-batch's graph casts the weight; same weight and scale, so the same bytes as the
eager cache's entry). With delayed scaling (``gate_state``, the linear's FP8ScalingState) the cast records the
weight's amax only when the weight generation changed since this cache's last captured call, compared on the
device: :func:`device_generation` is a per-device int64 counter that :func:`fp8_weights_changed` advances with the
host one, and the cache keeps the value it saw (made in the warm-up, ``"warmup"``, before the capture), so the
history moves once per optimizer step as in eager mode. In-place weight changes without
:func:`fp8_weights_changed` (the ``_version`` check) are not seen by a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FP8WeightCache", "device_generation", "fp8_weights_changed", "install_optimizer_hook",
           "optimizer_hook_installed", "remove_optimizer_hook", "weight_generation"]

_generation = 0
_hook_handle = None
_device_generations: dict = {}  # device -> int64 [1] counter (CUDA graphs only: device_generation)


def fp8_weights_changed(*_args, **_kwargs) -> None:
    """Invalidate every FP8 weight cache (the weights changed). Usable as an optimizer step hook. Also advances
    the device-side counters of :func:`device_generation` (one add per device; none exist without CUDA graphs)."""
    global _generation
    _generation += 1
    for counter in _device_generations.values():
        counter.add_(1)


def device_generation(device: torch.device) -> torch.Tensor:
    """The weight generation as an int64 [1] tensor on ``device``, advanced by :func:`fp8_weights_changed`, for
    captured CUDA graphs to compare on the device. Made on first use, which must not be inside a capture (its
    initial fill would be replayed): FP8WeightCache makes it in the warm-up."""
    counter = _device_generations.get(device)
    if counter is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("agoq.ops.fp8_weight_cache.device_generation: first use inside a CUDA graph capture; "
                               "make it before capturing (FP8WeightCache does in the warm-up pass)")
        counter = _device_generations[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return counter


def weight_generation() -> int:
    return _generation


def install_optimizer_hook() -> None:
    """Add :func:`fp8_weights_changed` as torch's process-wide optimizer step post-hook (idempotent)."""
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook_handle = register_optimizer_step_post_hook(fp8_weights_changed)


def remove_optimizer_hook() -> None:
    """Remove the hook :func:`install_optimizer_hook` added (idempotent)."""
    global _hook_handle
    if _hook_handle is not None:
        _hook_handle.remove()
        _hook_handle = None


def optimizer_hook_installed() -> bool:
    return _hook_handle is not None


class FP8WeightCache:
    """One linear's cached FP8 weight entry (whatever ``make(weight)`` returns)."""

    def __init__(self) -> None:
        install_optimizer_hook()  # a no-op after agoq.megatron.install (its fp8_weight_cache seam)
        self._key: tuple | None = None
        self._recipe = None
        self._col_scale: torch.Tensor | None = None
        self._entry = None
        self.refreshes = 0  # how many times the entry was (re)built: for tests and reports
        self.graph_phase: str | None = None  # None (eager), "warmup" or "capture" (module docstring)
        self.gate_state = None  # delayed scaling: the FP8ScalingState whose weight slot a captured cast gates
        self._seen: torch.Tensor | None = None  # the device generation this cache's captured call saw last

    def get(self, weight: torch.Tensor, recipe, make: Callable[[torch.Tensor], object],
            col_scale: torch.Tensor | None = None):
        """The entry for ``weight`` (``make(weight.detach())`` when stale). ``col_scale``: a tensor the entry
        also depends on (per-channel Smooth-SwiGLU's s, folded into fc2's FP8 weight): the entry is
        rebuilt when it is another tensor or its autograd version changed (the forward and backward of
        one micro-batch, and a recomputed forward, share the scale tensor and so the entry). Under CUDA graphs
        see the module docstring."""
        if self.graph_phase is not None:
            if self.graph_phase == "capture":
                return self._captured_entry(weight, make, col_scale)
            if self._seen is None:  # warm-up: the device counter and this cache's copy, outside any capture
                self._seen = device_generation(weight.device).clone()
            if self.gate_state is not None:
                self.gate_state.prepare_gate("w")
        key = (_generation, weight.data_ptr(), weight._version, weight.shape, weight.dtype,
               None if col_scale is None else col_scale._version)
        if key != self._key or recipe is not self._recipe or col_scale is not self._col_scale:
            self._entry = None  # drop the old copies before making the new ones
            self._entry = make(weight.detach())
            self._key, self._recipe, self._col_scale = key, recipe, col_scale
            self.refreshes += 1
        return self._entry

    def _captured_entry(self, weight: torch.Tensor, make: Callable[[torch.Tensor], object],
                        col_scale: torch.Tensor | None):
        """A fresh entry inside the graph; with delayed scaling its weight amax is recorded only at replays where
        the weight generation moved (module docstring). A column scale changes every micro-batch: the eager cache
        re-casts and records then too, and so does this."""
        state = self.gate_state
        if state is None or col_scale is not None:
            return make(weight.detach())
        if self._seen is None:
            raise RuntimeError("FP8 weight cache: captured without a warm-up pass (Megatron's "
                               "cuda_graph_warmup_steps >= 1 is needed with delayed scaling)")
        generation = device_generation(weight.device)
        moved = (generation != self._seen).reshape(())
        self._seen.copy_(generation)
        with state.gated("w", moved):
            return make(weight.detach())

    def release(self, entry) -> None:
        """Drop ``entry`` if it is the cached one (a per-micro-batch entry whose backward has run)."""
        if entry is not None and entry is self._entry:
            self.clear()

    def clear(self) -> None:
        self._key = self._recipe = self._entry = self._col_scale = None
