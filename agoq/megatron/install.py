"""install(config) -> Handle: check the Megatron contract and apply agoq's seams, reversibly.

Seam card
---------
Touches: whatever the registered seams and runtime changes touch; each is named below, and every
  change agoq makes to Megatron's or torch's process state goes through this module.
  * :data:`SEAMS`, applied by :func:`install` when the config asks for them: ``cpu_mode`` (runtime
    patches of torch, only without a GPU; agoq/megatron/cpu_mode.py) and ``fp8_weight_cache`` (torch's
    process-wide optimizer step post-hook that invalidates the FP8 weight caches,
    agoq/ops/fp8_weight_cache.py), and agoq's own kernel setting ``triton_launch`` (``AgoqConfig.kernels.
    fast_launch`` False: agoq.kernels.fastlaunch's direct launches off, Triton's own launch path; undone by the
    handle).
  * Runtime changes made later, when agoq builds the objects they concern, recorded here through
    :func:`swap_class` / :func:`set_module_attr`: ``ddp.bucket_group`` (every bucket group of agoq's
    DDP becomes ``AgoqBucketGroup``, agoq/megatron/grads/ddp.py), ``grad_reader.distributed_optimizer``
    (Megatron's ``DistributedOptimizer`` reading the 8-bit shard, agoq/megatron/grads/grad_reader.py) and
    ``checkpoint.results_queue`` (``filesystem_async._results_queue`` from agoq's signal-proof queue server,
    agoq/megatron/ckpt/save.py).
  * Scoped, nothing to undo: ``ddp.deferred_grad_buffer`` (a ``TorchFunctionMode`` active only while
    agoq's DDP runs Megatron's DDP constructor in store mode, popped on return or error; marked;
    agoq/megatron/grads/deferred_grad_buffer.py).
  Spec substitutions (SDPA attention, agoq linears) need no install step: they enter through the
  layer spec (agoq/megatron/model.py).
Why: one place where agoq changes process state (the Liger pattern: every patch carries a marker,
  :data:`PATCH_MARKER`, naming its seam), idempotent (installing twice applies each seam once) and
  undoable: ``Handle.undo()`` reverts every recorded runtime change, then the seams, in reverse order,
  so the original objects are back (identical, not equal copies).
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_install_and_cpu_mode.py``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from agoq.config import AgoqConfig
from agoq.megatron import compat

log = logging.getLogger("agoq.install")

PATCH_MARKER = "__agoq_patch__"
"""Attribute set on every class or function agoq puts in Megatron's or torch's place; its value is
``(seam name, megatron-core versions the seam was verified on)``."""


def mark(obj: Any, seam: str) -> Any:
    """Give ``obj`` (a class or function agoq substitutes) the patch marker of ``seam``; returns it."""
    setattr(obj, PATCH_MARKER, (seam, compat.SUPPORTED_MCORE_VERSIONS))
    return obj


def marked_seam(obj: Any) -> str | None:
    """The seam whose marker ``obj`` carries (None: not an agoq substitute)."""
    marker = getattr(obj, PATCH_MARKER, None)
    return marker[0] if marker else None


@dataclass(frozen=True)
class Seam:
    name: str
    kind: str  # "spec" | "hook" | "subclass" | "patch" | "setting" (agoq's own process state, from the config)
    wanted: Callable[[AgoqConfig], bool]
    apply: Callable[[], None]
    undo: Callable[[], None]


def runs_on_cpu(config: AgoqConfig) -> bool:
    """Whether ``config``'s run is on the CPU (megatron-core's CPU mode): ``device`` cpu, or auto without CUDA."""
    return config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())


def _enter_cpu() -> None:
    from agoq.megatron import cpu_mode  # imported only on CPU runs: GPU runs never load the shims

    cpu_mode.enter_cpu_mode()


def _exit_cpu() -> None:
    from agoq.megatron import cpu_mode

    cpu_mode.exit_cpu_mode()


def _fp8_hook_wanted(config: AgoqConfig) -> bool:
    return config.enabled


def _add_fp8_hook() -> None:
    from agoq.ops import fp8_weight_cache

    mark(fp8_weight_cache.fp8_weights_changed, "fp8_weight_cache")
    fp8_weight_cache.install_optimizer_hook()


def _remove_fp8_hook() -> None:
    from agoq.ops import fp8_weight_cache

    fp8_weight_cache.remove_optimizer_hook()


_LAUNCH_BEFORE: list[bool] = []  # the direct-launch setting triton_launch replaced (restored by its undo)


def _triton_own_launch() -> None:
    from agoq.kernels import fastlaunch

    _LAUNCH_BEFORE.append(fastlaunch.set_fast_launch(False))


def _restore_launch() -> None:
    from agoq.kernels import fastlaunch

    fastlaunch.set_fast_launch(_LAUNCH_BEFORE.pop() if _LAUNCH_BEFORE else True)


SEAMS: tuple[Seam, ...] = (
    Seam("cpu_mode", "patch", runs_on_cpu, _enter_cpu, _exit_cpu),
    # FP8 weight caches (agoq.ops.fp8_weight_cache) made before install() add the same hook themselves
    # (standalone use of agoq.ops); removing it here removes theirs too (the hook is one per process).
    Seam("fp8_weight_cache", "hook", _fp8_hook_wanted, _add_fp8_hook, _remove_fp8_hook),
    # AgoqConfig.kernels.fast_launch False (AGOQ_TRITON_FAST_LAUNCH=0 in the trainer): Triton's own launch path
    Seam("triton_launch", "setting", lambda config: not config.kernels.fast_launch, _triton_own_launch,
         _restore_launch),
)


# -- runtime changes made after install() ----------------------------------------------------------

@dataclass(frozen=True)
class RuntimeChange:
    seam: str
    target: str  # what was changed, for the log and tests
    undo: Callable[[], None]
    alive: Callable[[], bool] = lambda: True  # False once the changed object is garbage


_CHANGES: list[RuntimeChange] = []


def _record(change: RuntimeChange) -> None:
    _CHANGES[:] = [c for c in _CHANGES if c.alive()]  # dead objects need no undo: keep the list bounded
    _CHANGES.append(change)


def runtime_changes() -> list[RuntimeChange]:
    """The recorded runtime changes still in effect (oldest first)."""
    return [c for c in _CHANGES if c.alive()]


def swap_class(obj: Any, cls: type, *, seam: str) -> None:
    """``obj.__class__ = cls`` for one object (``cls`` a marked subclass of its class), recorded for undo.

    The record holds a weak reference: a swapped object that is garbage needs no undo."""
    original = type(obj)
    if original is cls:
        return
    if not issubclass(cls, original) or marked_seam(cls) != seam:
        raise TypeError(f"swap_class: {cls.__qualname__} must subclass {original.__qualname__} and carry the "
                        f"{seam!r} marker (install.mark)")
    ref = weakref.ref(obj)
    obj.__class__ = cls

    def undo() -> None:
        live = ref()
        if live is not None and type(live) is cls:
            live.__class__ = original

    _record(RuntimeChange(seam, f"{original.__module__}.{original.__qualname__} -> {cls.__qualname__}", undo,
                          alive=lambda: ref() is not None))


_ABSENT = object()  # set_module_attr: the module had no such name before


def set_module_attr(module: ModuleType, name: str, value: Any, *, seam: str,
                    cleanup: Callable[[], None] | None = None, allow_absent: bool = False) -> None:
    """``module.name = value`` (a module global of Megatron or torch), recorded: undo puts the original
    object back, then runs ``cleanup`` (e.g. stops a process the value needed). ``allow_absent``: the module may
    lack the name (a slot an optional import leaves undefined); undo then removes it. Otherwise a missing name
    raises (a renamed global must not be added silently)."""
    original = getattr(module, name, _ABSENT)
    if original is _ABSENT and not allow_absent:
        raise AttributeError(f"agoq: {module.__name__} has no {name!r} to replace (seam {seam}); megatron-core "
                             "changed: see the contract table (agoq.megatron.contract)")
    setattr(module, name, value)

    def undo() -> None:
        if getattr(module, name, _ABSENT) is value:
            if original is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, original)
        if cleanup is not None:
            cleanup()

    _record(RuntimeChange(seam, f"{module.__name__}.{name}", undo))


def undo_runtime_changes() -> None:
    """Revert every recorded runtime change, newest first."""
    while _CHANGES:
        change = _CHANGES.pop()
        if change.alive():
            change.undo()


# -- install / undo --------------------------------------------------------------------------------

@dataclass
class Handle:
    config: AgoqConfig
    applied: list[Seam] = field(default_factory=list)

    def undo(self) -> None:
        """Revert the runtime changes recorded since (bucket-group / optimizer class swaps, Megatron
        module globals), then the seams, newest first: the original objects are back."""
        undo_runtime_changes()
        for seam in reversed(self.applied):
            seam.undo()
        self.applied.clear()
        _INSTALLED.pop("handle", None)

    uninstall = undo  # the earlier name


_INSTALLED: dict[str, Handle] = {}


def _install_key(config: AgoqConfig) -> tuple:
    return config.enabled, config.device, config.policy.path, config.kernels.fast_launch


def install(config: AgoqConfig) -> Handle:
    """Check the contract, then apply the seams ``config`` asks for. Installing again is a no-op
    for the same install settings and an error for different ones (undo first): ``enabled``, ``device``,
    the policy file and ``kernels.fast_launch`` (the rest of the config shapes models and optimizers, not process
    state)."""
    current = _INSTALLED.get("handle")
    if current is not None:
        if _install_key(current.config) != _install_key(config):
            raise RuntimeError(
                "agoq is already installed with a different config; call handle.undo() first"
            )
        return current
    compat.check()
    handle = Handle(config=config)
    for seam in SEAMS:
        if seam.wanted(config):
            seam.apply()
            handle.applied.append(seam)
    _INSTALLED["handle"] = handle
    log.info("agoq installed seams: %s", [s.name for s in handle.applied] or "none")
    return handle
