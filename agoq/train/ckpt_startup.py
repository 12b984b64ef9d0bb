"""The checkpoint rules of agoq.train.ckpt_guard applied to a running job: rank 0 checks, every rank gets
the same answer (a refusal is raised on every rank, before training, so no rank waits in a collective).

Order in the trainer: :meth:`CheckpointGuard.start` right after the process groups exist (the --save folder,
its lock, what --load means), :meth:`CheckpointGuard.check_space` once the model is built (free space for one
checkpoint), :meth:`CheckpointGuard.after_load` after the load (no newer checkpoint in --save to write over),
:meth:`CheckpointGuard.release` at exit (the lock).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from agoq.train import ckpt_guard
from agoq.train.ckpt_guard import CheckpointRefusal, LoadTarget


def agreed(decide: Callable):
    """``decide()`` on rank 0, its result on every rank; its CheckpointRefusal raised on every rank."""
    payload: list = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", decide())
        except CheckpointRefusal as exc:
            payload[0] = ("refused", str(exc))
        except Exception as exc:  # noqa: BLE001 - raised below on rank 0 as it was, named on the others
            payload[0], error = ("error", f"rank 0: {type(exc).__name__}: {exc}"), exc
    dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "refused":
        raise CheckpointRefusal(value)
    if kind == "error":
        if error is not None:
            raise error
        raise RuntimeError(f"checkpoint start-up checks failed on {value}")
    return value


def _print0(text: str) -> None:
    if text and dist.get_rank() == 0:
        print(text, flush=True)


class CheckpointGuard:
    """--load / --save of one job (``args``: the trainer's Namespace)."""

    def __init__(self, args):
        self.save: str | None = args.save
        self.lock = None
        self.load = LoadTarget(None, None, "")
        self._args = args

    @classmethod
    def start(cls, args) -> CheckpointGuard:
        guard = cls(args)

        def decide():
            notes = []
            if args.save:
                ckpt_guard.check_save_folder(args.save)
                guard.lock = ckpt_guard.take_lock(args.save, force=args.force_unlock)
                notes += guard.lock.notes
            try:
                target = ckpt_guard.resolve_load(args.load, args.save, allow_fresh_start=args.allow_fresh_start)
            except BaseException:
                guard.release()
                raise
            return target, notes

        guard.load, notes = agreed(decide)
        for note in notes:
            _print0(note)
        return guard

    def check_space(self, predicted_bytes: int) -> None:
        if self.save:
            _print0(self._agreed_or_release(lambda: ckpt_guard.check_free_space(self.save, predicted_bytes)))

    def after_load(self, loaded_folder: Path | None, iteration: int) -> None:
        self._agreed_or_release(lambda: ckpt_guard.check_overwrite(self.save, loaded_folder, iteration))

    def _agreed_or_release(self, decide: Callable):
        try:
            return agreed(decide)
        except CheckpointRefusal:
            self.release()
            raise

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def predicted_checkpoint_bytes(config, shape, plan, *, fp32_params: bool) -> int:
    """One checkpoint of this run: the model's parameters over all tensor / pipeline ranks (agoq.plan.peak's
    per-rank tensors of ``shape`` under the planner Layout ``plan``) x (weight bytes + optimizer state bytes)."""
    from agoq.plan.peak import param_tensors
    from agoq.plan.shape import ModelShape

    model = ModelShape.of(shape)
    params = plan.tp * sum(sum(param_tensors(model, plan, rank)) for rank in range(plan.pp))
    return ckpt_guard.predicted_checkpoint_bytes(
        params, weight_bytes=4 if fp32_params else 2,
        optimizer_bytes_per_param=ckpt_guard.optimizer_state_bytes_per_param(config, fp32_params))
