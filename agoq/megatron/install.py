"""install(config) -> Handle: check the Megatron contract and apply agoq's seams, reversibly.

Seam card
---------
Touches: whatever the registered seams touch; each seam is listed in :data:`SEAMS` with its kind.
  Today: ``cpu_mode`` (runtime patches, only without a GPU). Spec substitutions (SDPA attention,
  agoq linears) need no install step: they enter through the layer spec (agoq/megatron/model.py).
Why: one place where agoq changes Megatron's process state, idempotent (installing twice applies each
  seam once) and undoable (``Handle.uninstall()`` restores everything, in reverse order).
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_install.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agoq.config import AgoqConfig
from agoq.megatron import compat

log = logging.getLogger("agoq.install")


@dataclass(frozen=True)
class Seam:
    name: str
    kind: str  # "spec" | "hook" | "subclass" | "patch"
    wanted: Callable[[AgoqConfig], bool]
    apply: Callable[[], None]
    undo: Callable[[], None]


def _cpu_wanted(config: AgoqConfig) -> bool:
    return config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())


def _enter_cpu() -> None:
    from agoq.megatron import cpu_mode  # imported only on CPU runs: GPU runs never load the shims

    cpu_mode.enter_cpu_mode()


def _exit_cpu() -> None:
    from agoq.megatron import cpu_mode

    cpu_mode.exit_cpu_mode()


SEAMS: tuple[Seam, ...] = (
    Seam("cpu_mode", "patch", _cpu_wanted, _enter_cpu, _exit_cpu),
)


@dataclass
class Handle:
    config: AgoqConfig
    applied: list[Seam] = field(default_factory=list)

    def uninstall(self) -> None:
        for seam in reversed(self.applied):
            seam.undo()
        self.applied.clear()
        _INSTALLED.pop("handle", None)


_INSTALLED: dict[str, Handle] = {}


def install(config: AgoqConfig) -> Handle:
    """Check the contract, then apply the seams ``config`` asks for. Installing again is a no-op
    for the same config and an error for a different one (uninstall first)."""
    current = _INSTALLED.get("handle")
    if current is not None:
        if current.config != config:
            raise RuntimeError(
                "agoq is already installed with a different config; call handle.uninstall() first"
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
