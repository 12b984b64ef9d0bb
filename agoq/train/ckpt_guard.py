"""Start-up rules that keep a run from losing checkpoints: what ``--load`` means, what ``--save`` may be
written over, one job per ``--save`` folder, and room for the next checkpoint.

``--load PATH`` (:func:`resolve_load`):

* a folder with a tracker (``latest_checkpointed_iteration.txt``): its iteration, falling back to older complete
  checkpoints when a file fails to read (agoq.megatron.ckpt.load.load_checkpoint);
* an ``iter_NNNNNNN`` folder: that iteration of its parent folder, no fallback, said in one line (Megatron-LM's
  ``--ckpt-step N`` semantics);
* a folder with ``iter_*`` checkpoints but no usable tracker: the run stops, naming the newest complete one and the
  ``--load .../iter_NNNNNNN`` that loads it;
* no checkpoint (missing folder, empty folder, only interrupted saves): a fresh start, only when ``--save`` holds no
  checkpoint either. ``--allow-fresh-start`` starts from scratch although ``--load`` holds checkpoints (they are
  neither read nor written).

``--save DIR`` (:func:`check_save_folder`, :func:`check_overwrite`): created at start-up, or must be a writable
folder (a file is refused); the run never writes over a complete checkpoint it did not load from: a ``--save``
holding checkpoints of another run (or newer ones than the loaded iteration) stops the run before training, naming
them. Interrupted saves (no ``agoq_progress.json``) are not checkpoints and may be replaced. Rank 0 also takes the
folder's lock (agoq.train.save_lock) and checks the free space against the predicted checkpoint size
(:func:`predicted_checkpoint_bytes`: the planner's bytes per parameter of each state format).

Every check runs on rank 0; all ranks raise the same error (:func:`agreed`), so no rank waits for another.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from agoq.megatron.ckpt.ckpt_files import (
    complete_iterations,
    is_complete,
    iteration_dir,
    iteration_of,
    names,
    read_tracker,
    saved_iterations,
    written_by_megatron_training,
)
from agoq.train.save_lock import SaveLock

ALLOW_FRESH = "--allow-fresh-start"


class CheckpointRefusal(ValueError):
    """The run would lose or ignore checkpoints; nothing was read or written (the message names the fix)."""


@dataclass(frozen=True)
class LoadTarget:
    """What the run loads: ``folder`` (None: start from scratch) and ``iteration`` (None: the tracker's, with
    fallback; a number: exactly that iteration); ``note``: the start-up line that says so."""

    folder: Path | None
    iteration: int | None
    note: str


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _load_source(load: Path) -> LoadTarget | None:
    """The checkpoint ``--load`` names (None: it holds none); CheckpointRefusal when it is ambiguous."""
    pinned = iteration_of(load)
    if pinned is not None and not load.exists():
        complete = complete_iterations(load.parent)
        raise CheckpointRefusal(f"--load {load}: no such iteration folder; complete checkpoints in {load.parent}: "
                                f"{names(complete) or 'none'}")
    if pinned is not None and load.is_dir() and not read_tracker(load).exists:
        if not is_complete(load):
            complete = complete_iterations(load.parent)
            raise CheckpointRefusal(
                f"--load {load}: an iteration folder whose save did not complete (no agoq_progress.json), so there "
                f"is nothing to load in it; complete checkpoints in {load.parent}: {names(complete) or 'none'}"
                + (f" (--load {iteration_dir(load.parent, complete[-1])} loads the newest)" if complete else ""))
        return LoadTarget(load.parent, pinned,
                          f"--load {load}: an iteration folder: loading iteration {pinned} of {load.parent} "
                          "(Megatron-LM's --ckpt-step semantics: exactly this iteration, the tracker is not used)")
    tracker = read_tracker(load)
    foreign = written_by_megatron_training(load)
    if foreign is not None:
        raise CheckpointRefusal(
            f"--load {load}: {iteration_dir(load, foreign).name} was written by megatron.training (agoq's Megatron-LM "
            "door or Megatron-LM's pretrain_gpt.py: no agoq_progress.json in any iter_* folder), whose checkpoint "
            "layout scripts/pretrain_llama.py does not read; resume it with the trainer that wrote it "
            "(python -m agoq.megatron_lm pretrain_gpt.py ... --load), or start this run with another --load")
    if tracker.iteration is not None:
        return LoadTarget(load, None, "")
    complete = complete_iterations(load)
    if not complete:
        if tracker.problem is not None:
            raise CheckpointRefusal(f"--load {load}: {tracker.path}: {tracker.problem}, and no complete iter_* "
                                    "checkpoint is there; fix or delete the tracker file")
        return None
    why = tracker.problem or "missing"
    raise CheckpointRefusal(
        f"--load {load}: holds checkpoints ({names(complete)}) but no usable tracker ({tracker.path.name}: {why}), "
        f"so which one to resume is not known. The newest complete one is {complete[-1]}: resume it with --load "
        f"{iteration_dir(load, complete[-1])} (or write {complete[-1]} into {tracker.path})")


def resolve_load(load: str | None, save: str | None, *, allow_fresh_start: bool = False) -> LoadTarget:
    """``--load`` / ``--save`` -> what the run loads (the rules in the module docstring); CheckpointRefusal when the
    run would ignore or write over checkpoints."""
    source = None
    if load:
        found = _load_source(Path(load))
        if found is not None and allow_fresh_start:
            source = LoadTarget(None, None, f"--load {load}: its checkpoints are not read ({ALLOW_FRESH}); starting "
                                            "from scratch")
        else:
            source = found
    if source is None:
        source = LoadTarget(None, None, f"--load {load}: no checkpoint yet, starting from scratch" if load
                            else "")
    if save and source.folder is None:
        held = complete_iterations(save)
        tracker = read_tracker(save)
        if held or tracker.iteration is not None:
            newest = f"newest {iteration_dir(save, held[-1])}" if held else f"tracker {tracker.path}"
            loads = f"loads nothing from it ({source.note})" if load else "has no --load"
            raise CheckpointRefusal(
                f"--save {save}: holds checkpoints ({newest}) and this run {loads}; saving there would write over "
                f"them. Resume them with --load {save}, or give this run a new --save folder")
    if save and source.folder is not None and not _same(source.folder, Path(save)):
        held = complete_iterations(save)
        if held:
            raise CheckpointRefusal(
                f"--save {save}: holds checkpoints ({names(held)}) of another run than the one loaded from "
                f"{source.folder}; saving there would write over them. Resume them with --load {save}, or give "
                "this run a new --save folder")
    return source


def check_overwrite(save: str | None, loaded_folder: Path | None, loaded_iteration: int) -> None:
    """After the load: complete checkpoints in ``--save`` newer than the loaded iteration would be written over by
    this run's saves (the same folder: a pinned older iteration, a fallback past unreadable ones, or a tracker
    behind a finished save)."""
    if not save or loaded_folder is None or not _same(loaded_folder, Path(save)):
        return
    newer = [it for it in complete_iterations(save) if it > loaded_iteration]
    if newer:
        raise CheckpointRefusal(
            f"--save {save}: holds newer checkpoints than the loaded iteration {loaded_iteration} ({names(newer)}); "
            f"this run would write over them when it saves. Resume the newest with --load "
            f"{iteration_dir(save, newer[-1])}, or keep iteration {loaded_iteration}'s continuation apart with a new "
            f"--save folder (or move the newer iter_* folders out of {save})")


def check_save_folder(save: str) -> None:
    """--save exists as a folder (created here) or fails with the path and errno."""
    path = Path(save)
    if path.exists() and not path.is_dir():
        raise CheckpointRefusal(f"--save {save}: is a file, not a folder; pass a folder for the checkpoints")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointRefusal(f"--save {save}: cannot create the folder ({_errno_text(exc)}); pass a folder this "
                                "job can write") from None


def _errno_text(exc: OSError) -> str:
    name = os.strerror(exc.errno) if exc.errno else str(exc)
    code = errno.errorcode.get(exc.errno) if exc.errno else None
    where = f" on {exc.filename}" if exc.filename else ""
    return f"{code or 'errno'} {exc.errno}: {name}{where}"


def take_lock(save: str, *, force: bool, environ=os.environ) -> SaveLock:
    try:
        return SaveLock(save, environ).acquire(force=force)
    except OSError as exc:
        raise CheckpointRefusal(f"--save {save}: not writable ({_errno_text(exc)}): the lock file and the "
                                "checkpoints could not be written; pass a folder this job can write") from None


def check_free_space(save: str, needed: int) -> str:
    """Refuse when the filesystem of ``save`` has less free space than one checkpoint needs; the report line."""
    free = shutil.disk_usage(save).free
    line = (f"--save {save}: {_gib(free)} free, a checkpoint of this run takes about {_gib(needed)} (predicted "
            "by agoq.plan's bytes per parameter)")
    if free < needed:
        raise CheckpointRefusal(f"{line}: not enough for one checkpoint. Free space there, or pass a --save folder "
                                "on a filesystem with room (the run would train, then fail at its first save)")
    return line


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# a checkpoint's files besides the tensors: .metadata, common state (RNG, schedule, run record), per-rank headers
CHECKPOINT_OVERHEAD_BYTES = 1 << 20
CHECKPOINT_MARGIN = 1.05


def predicted_checkpoint_bytes(params: int, *, weight_bytes: int, optimizer_bytes_per_param: float) -> int:
    """One checkpoint of a model of ``params`` parameters (all tensor / pipeline ranks): the weights and the
    optimizer states (agoq.plan's bytes per parameter of each state format), 5 % and 1 MiB on top."""
    return int(params * (weight_bytes + optimizer_bytes_per_param) * CHECKPOINT_MARGIN) + CHECKPOINT_OVERHEAD_BYTES


def optimizer_state_bytes_per_param(config, fp32_params: bool) -> float:
    """What an optimizer state takes on disk per parameter: Megatron's Adam keeps fp32 m and v (and an fp32 main
    copy of bf16 parameters); agoq's optimizers their state formats and master (agoq.plan.peak.MASTER_BYTES)."""
    from agoq.plan.peak import MASTER_BYTES

    opt = config.optimizer
    if not opt.agoq:
        return 8.0 if fp32_params else 12.0
    return sum(m.bytes_per_element() for m in opt.states.moments) + MASTER_BYTES[opt.master]


def interrupted_saves(folder: str) -> list[int]:
    return [it for it, complete in saved_iterations(folder).items() if not complete]
