"""Save a checkpoint through ``megatron.core.dist_checkpointing.save``: every rank writes ``<save>/iter_N/``, then
rank 0 publishes it in the tracker; a failure on any rank raises on every rank and leaves the tracker on the last
complete checkpoint.

Seam card
---------
Touches: ``dist_checkpointing.save`` (public API) and ``dist_checkpointing.strategies.filesystem_async.
  _results_queue`` (pre-created from agoq's queue server, agoq.megatron.ckpt.queue_server; listed in the contract,
  recorded in agoq.megatron.install as seam ``checkpoint.results_queue`` and undone by its handle).
Why: Megatron's layout, ``<save>/iter_0000010/`` plus a tracker file ``latest_checkpointed_iteration.txt`` that is
  written (atomically, by rename) only after every rank finished writing, so an interrupted save never replaces the
  last complete checkpoint.
Verified on: megatron-core 0.19.2 (CPU gloo and GPU NCCL).
Guarded by: ``tests/megatron/test_resume.py``, ``tests/megatron/test_install_and_cpu_mode.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from agoq.megatron.ckpt.checkpoint_errors import save_error_text
from agoq.megatron.ckpt.ckpt_files import PROGRESS_FILE, TRACKER_FILE, iteration_dir, latest_iteration_or_none
from agoq.megatron.ckpt.queue_server import start_queue_server
from agoq.megatron.ckpt.state import Progress, data_parallel_size, full_sharded_state_dict, torch_optimizer_step


def install_results_queue() -> None:
    """Pre-create megatron's module-global ``_results_queue`` from agoq's queue server (agoq.megatron.ckpt.
    queue_server: standard library only, ignores the launcher's stop signals, dies with the rank), before Megatron's
    first save would spawn a copy of the training script to serve it.

    Touches ``dist_checkpointing.strategies.filesystem_async._results_queue`` (listed in the contract).
    Recorded in agoq.megatron.install (seam ``checkpoint.results_queue``): the install handle's
    ``undo()`` puts Megatron's ``None`` back and stops the server.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    from agoq.megatron.install import set_module_attr

    server = start_queue_server()
    _SERVERS.append(server)  # keep it alive until the process ends or the install handle's undo()

    def stop_server() -> None:
        _SERVERS.remove(server)
        server.stop()

    set_module_attr(filesystem_async, "_results_queue", server.queue, seam="checkpoint.results_queue",
                    cleanup=stop_server)


_SERVERS: list = []


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (every rank raises it, with every failing rank's reason); the tracker still names
    the last complete checkpoint."""


def save_checkpoint(save_dir: str | os.PathLike, progress: Progress, model_chunks: list, optimizer,
                    scheduler, *, extra: dict | None = None) -> Path:
    """Write ``iter_N`` on every rank, then publish it in the tracker (rank 0, atomic rename). A failure on any rank
    (a full disk, a folder turned read-only) raises CheckpointSaveError on every rank, naming the path and errno;
    the tracker is left on the last complete checkpoint."""
    target = iteration_dir(save_dir, progress.iteration)
    install_results_queue()
    _save_step(save_dir, target, lambda: target.mkdir(parents=True, exist_ok=True) if dist.get_rank() == 0 else None)
    extra = dict(extra or {}, torch_optimizer_step=torch_optimizer_step(optimizer),
                 data_parallel_size=data_parallel_size())
    state = full_sharded_state_dict(model_chunks, optimizer, scheduler, progress, is_loading=False, extra=extra)
    _save_step(save_dir, target, lambda: dist_checkpointing.save(state, str(target)))

    def publish():
        if dist.get_rank() == 0:
            (target / PROGRESS_FILE).write_text(json.dumps(progress.__dict__, indent=1) + "\n")
            _atomic_write(Path(save_dir) / TRACKER_FILE, f"{progress.iteration}\n")

    _save_step(save_dir, target, publish)
    return target


def _save_step(save_dir, target: Path, step) -> None:
    """Run one step of a save on every rank; all ranks agree, and all raise CheckpointSaveError if any failed."""
    error = None
    try:
        step()
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported on every rank below
        error = save_error_text(exc, target)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if not any(errors):
        return
    # torch DCP's coordinator (rank 0) holds every rank's write error; the others raise it without the details
    named = {k: v for rank, e in enumerate(errors) if e for k, v in (e if isinstance(e, dict) else {rank: e}).items()}
    problem = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(named.items()) if text) or "no reason given"
    tracker = latest_iteration_or_none(save_dir)
    kept = (f"{Path(save_dir) / TRACKER_FILE} still names iteration {tracker}, the last complete checkpoint"
            if tracker is not None else "no earlier checkpoint was completed in this folder")
    raise CheckpointSaveError(
        f"saving checkpoint {target} failed ({problem}); {kept}. {target.name} is incomplete: a resume ignores it "
        f"and a later save replaces it. Free space or fix the folder, then resume with --load {save_dir}")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
