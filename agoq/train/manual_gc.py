"""Megatron-LM's manual garbage collection (``--manual-gc``, ``--manual-gc-interval N``, ``--no-manual-gc-eval``).

Python's threshold-based collector runs whenever enough objects were allocated: in the middle of a forward or a
backward, at a different moment on every rank. Where the host sets the pace (small micro-batches, pipeline
parallelism: a stage that pauses stalls its peers) such pauses become step-time jitter; agoq's Python per layer
(autograd functions, saved-tensor hooks) allocates more objects per step than Megatron's layers alone. Megatron-LM's
remedy, same flags and meaning here: the automatic collector off during training, a full collection every
``--manual-gc-interval`` steps (0: never between steps) and, unless ``--no-manual-gc-eval``, before and after each
evaluation. The collector is switched back on when training ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class ManualGC:
    enabled: bool = False  # --manual-gc
    interval: int = 0  # --manual-gc-interval: full collection every N training steps (0: not between steps)
    around_eval: bool = True  # not --no-manual-gc-eval: collect before and after each evaluation

    @classmethod
    def from_args(cls, args) -> ManualGC:
        return cls(args.manual_gc, args.manual_gc_interval, args.manual_gc_eval)

    def describe(self) -> str | None:
        """The start-up line (None without --manual-gc)."""
        if not self.enabled:
            return None
        every = f"every {self.interval} steps" if self.interval else "not between steps (--manual-gc-interval 0)"
        around = "before and after each evaluation" if self.around_eval else "not around evaluations"
        return f"manual garbage collection (--manual-gc): automatic collector off while training; full collection " \
               f"{every}; {around}"

    @contextmanager
    def training(self) -> Iterator[None]:
        """The training loop's span: the automatic collector off (after one full collection) when enabled."""
        if not self.enabled:
            yield
            return
        was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        collect = self.enabled and self.around_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect()
