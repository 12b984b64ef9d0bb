"""Load the newest readable checkpoint through ``megatron.core.dist_checkpointing``: check its record, read it on
every rank, agree, and only then apply it (model, optimizer, LR schedule, RNG).

Seam card
---------
Touches: ``dist_checkpointing.load`` / ``load_common_state_dict``, ``MegatronOptimizer.load_state_dict``
  (public API); ``OptimizerParamScheduler.override_opt_param_scheduler`` / ``use_checkpoint_opt_param_scheduler``
  (set before its ``load_state_dict``: Megatron-LM's two resume modes); the saved param groups' ``max_lr`` /
  ``min_lr``, which megatron-core 0.19.2 uses to pair saved and live groups
  (``optimizer.param_group_identifier_keys``).
Resume order: the resume record (agoq.megatron.ckpt.resume) is checked before any tensor is read; every rank
  reads, all ranks agree, and only then is anything applied (a rank's read failure never leaves another
  rank with a newer state than the checkpoint the job falls back to).
Verified on: megatron-core 0.19.2 (CPU gloo and GPU NCCL).
Guarded by: ``tests/megatron/test_resume.py`` (resume matrix, fallback, schedule, mismatches),
  ``tests/megatron/test_resume_schedule.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from agoq.megatron.ckpt.checkpoint_errors import read_error_text
from agoq.megatron.ckpt.ckpt_files import PROGRESS_FILE, iteration_dir, latest_iteration
from agoq.megatron.ckpt.resume import ResumeMismatch, check_contract, policy_note
from agoq.megatron.ckpt.state import (
    WEIGHTS_ONLY_KEY,
    Progress,
    data_parallel_size,
    full_sharded_state_dict,
    init_torch_optimizer_steps,
    load_model_chunks,
    model_sharded_state_dict,
    restore_rng,
    set_torch_optimizer_step,
)

CONVERTED_HINT = ("It is a converted checkpoint: its shape is the Hugging Face model's (use the model.yaml written "
                  "next to it as --config), and its vocabulary rows are padded for the tensor-parallel size it was "
                  "converted for: convert again with python -m agoq.convert hf-to-agoq --tensor-model-parallel-size "
                  "<this run's TP> (and this run's --make-vocab-size-divisible-by)")


def load_checkpoint(
    load_dir: str | os.PathLike, model_chunks: list, optimizer, scheduler, *,
    record: dict | None = None, policy_report: str | None = None, override_schedule: bool = False,
    iteration: int | None = None,
) -> tuple[Progress, dict] | None:
    """Load the newest readable checkpoint into the model, optimizer and scheduler; None when there is none.

    Candidates: the tracker's iteration, then older ``iter_*`` directories, newest first. For each, on
    every rank, and agreed between all ranks after each stage:
      1. complete: ``agoq_progress.json`` (rank 0 writes it after every rank finished) exists and parses;
      2. its common state reads, and its saved run record serves this run's ``record``
         (agoq.megatron.ckpt.resume.run_record; else ResumeMismatch: the
         older checkpoints share the settings, so there is no fallback);
      3. every rank reads its tensors into a template.
    A candidate failing 1 or 3 on any rank is reported with every failing rank's error and skipped.
    Only after all ranks read one does any rank apply it (model, optimizer, LR schedule, RNG): applying
    does not fall back, it raises. ``override_schedule``: the scheduler keeps its (command-line) values
    instead of the checkpoint's (Megatron-LM's --override-opt_param-scheduler). ``iteration``: exactly that
    checkpoint, no tracker and no fallback (``--load DIR/iter_N``, Megatron-LM's --ckpt-step).
    """
    if iteration is not None:
        candidates = [iteration]
    else:
        latest = latest_iteration(load_dir)
        if latest is None:
            return None
        candidates = _candidate_iterations(load_dir, latest)
    for candidate in candidates:
        source = iteration_dir(load_dir, candidate)
        problem, progress = _on_every_rank(_read_progress, source)
        if problem is None:
            problem, common = _on_every_rank(dist_checkpointing.load_common_state_dict, str(source))
        weights_only = problem is None and bool(common.get("agoq", {}).get(WEIGHTS_ONLY_KEY))
        if problem is None:
            try:
                _check_resume_contract(source, common.get("agoq", {}), record, policy_report)
            except ResumeMismatch as exc:
                if weights_only:
                    raise ResumeMismatch(f"{exc}\n{CONVERTED_HINT}") from None
                raise
            read = _read_model_state if weights_only else _read_state
            problem, state = _on_every_rank(read, source, model_chunks, optimizer, common)
        if problem is None and weights_only:
            _print_rank0(f"agoq checkpoint: {source} holds model weights only (a converted checkpoint): the "
                         "optimizer, LR schedule and data position start fresh")
            _apply_on_every_rank(source, state, model_chunks, optimizer, scheduler, override_schedule,
                                 apply=_apply_weights_only)
            return progress, common["agoq"]
        if problem is None:
            _apply_on_every_rank(source, state, model_chunks, optimizer, scheduler, override_schedule)
            return progress, state["agoq"]
        if iteration is not None:
            raise FileNotFoundError(f"{source}: cannot be loaded ({problem}); it was asked for by name, so there is "
                                    f"no fallback: pass another iteration folder, or --load {load_dir} for the "
                                    "tracker's")
        _print_rank0(f"agoq checkpoint: skipping {source}: {problem}")
    raise FileNotFoundError(
        f"{load_dir}: no readable checkpoint (every iter_* directory is incomplete or unreadable, reasons "
        "above); start without --load or restore a checkpoint"
    )


def _print_rank0(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def _candidate_iterations(load_dir, latest: int) -> list[int]:
    found = []
    for path in Path(load_dir).glob("iter_*"):
        suffix = path.name.removeprefix("iter_")
        if path.is_dir() and suffix.isdigit() and int(suffix) <= latest:
            found.append(int(suffix))
    return sorted(set(found) | {latest}, reverse=True)


class _Unusable(Exception):
    """A checkpoint that is not (completely) there; its message is the whole reason."""


def _read_progress(source: Path) -> Progress:
    if not source.is_dir():
        raise _Unusable("directory missing")
    path = source / PROGRESS_FILE
    if not path.is_file():
        raise _Unusable(f"incomplete save ({PROGRESS_FILE} missing: the save was interrupted)")
    try:
        return Progress(**json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Unusable(f"{path}: not valid JSON ({exc}); treated as an incomplete save") from exc
    except TypeError as exc:
        raise _Unusable(f"{path}: not agoq's progress record ({exc}); treated as an incomplete save") from exc


def _on_every_rank(read, *args):
    """(problem, result): run ``read`` on every rank; problem names each failing rank's error in full
    (None when every rank succeeded, the same answer on all ranks)."""
    error, result = None, None
    try:
        result = read(*args)
    except _Unusable as exc:
        error = str(exc)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported, and the candidate skipped
        # torch DCP raises CheckpointException (a BaseException) for a rank's read error
        error = read_error_text(exc, args[0] if args and isinstance(args[0], Path | str) else None)
    return _gather_errors(error), result


def _gather_errors(error: str | None) -> str | None:
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failing: dict[str, list[int]] = {}
    for rank, text in enumerate(errors):
        if text is not None:
            failing.setdefault(text, []).append(rank)
    if not failing:
        return None
    if len(failing) == 1 and len(next(iter(failing.values()))) == len(errors):
        return next(iter(failing))  # every rank, one reason
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
                     for text, r in failing.items())


def _check_resume_contract(source: Path, saved_extra: dict, record, policy_report) -> None:
    """Stop (ResumeMismatch) before any tensor is read when the checkpoint cannot serve this run;
    report the changes it can serve."""
    notes = []
    if record is not None:
        notes += check_contract(str(source), saved_extra, record)
    if policy_report is not None:
        notes.append(policy_note(str(source), saved_extra.get("policy_report"), policy_report))
    saved_dp = saved_extra.get("data_parallel_size")
    if saved_dp is not None and saved_dp != data_parallel_size():
        notes.append(f"agoq checkpoint: saved with data-parallel size {saved_dp}, loading with "
                     f"{data_parallel_size()}: model and optimizer states are resharded, RNG states are not "
                     "restored (fresh seeds)")
    for note in filter(None, notes):
        _print_rank0(note if note.startswith("agoq checkpoint") else f"agoq checkpoint: {note}")


def _read_state(source: Path, model_chunks, optimizer, common: dict) -> dict:
    """Every tensor of this rank, read into a template of the live objects; nothing is applied."""
    init_torch_optimizer_steps(optimizer)
    template = full_sharded_state_dict(model_chunks, optimizer, None, None, is_loading=True)
    if common.get("agoq", {}).get("data_parallel_size", data_parallel_size()) != data_parallel_size():
        template.pop("rng_state")  # saved per (pp, tp, dp) rank: another DP size has none for this rank
    return dist_checkpointing.load(template, str(source))


def _read_model_state(source: Path, model_chunks, optimizer, common: dict) -> dict:
    """A weights-only checkpoint: the model tensors of this rank."""
    return dist_checkpointing.load(model_sharded_state_dict(model_chunks), str(source))


def _apply_weights_only(state: dict, model_chunks, optimizer, scheduler, override: bool) -> None:
    load_model_chunks(state, model_chunks)
    # Megatron's optimizers copied the (initial) weights into their fp32 main params when built
    # (Megatron-LM's --no-load-optim path does the same); agoq's optimizer states start at the first step
    optimizer.reload_model_params()


def _apply_on_every_rank(source: Path, state: dict, model_chunks, optimizer, scheduler, override: bool,
                         apply=None) -> None:
    error, local = None, None
    try:
        (apply or _apply_loaded_state)(state, model_chunks, optimizer, scheduler, override)
    except Exception as exc:  # noqa: BLE001 - re-raised below on every rank, with every rank's reason
        error, local = f"{type(exc).__name__}: {exc}", exc
    problem = _gather_errors(error)
    if problem is not None:
        raise RuntimeError(
            f"{source} was read on every rank, but applying it failed ({problem}). The model and optimizer may "
            "be partly loaded, so the job stops instead of falling back to an older checkpoint"
        ) from local


def _apply_loaded_state(state: dict, model_chunks, optimizer, scheduler, override: bool) -> None:
    load_model_chunks(state, model_chunks)
    _rebase_saved_group_lrs(state["optimizer"], state["opt_param_scheduler"], optimizer)
    with torch.no_grad():  # fp32-param distopt loads in place into leaves
        optimizer.load_state_dict(state["optimizer"])
    set_torch_optimizer_step(optimizer, state["agoq"]["torch_optimizer_step"])
    # Megatron-LM's two modes: the checkpoint's schedule (--use-checkpoint-opt_param-scheduler), or
    # the constructor's values, i.e. the command line's (--override-opt_param-scheduler)
    scheduler.override_opt_param_scheduler = override
    scheduler.use_checkpoint_opt_param_scheduler = not override
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _pin_group_lr_bounds(optimizer, scheduler)
    if "rng_state" in state:
        restore_rng(state["rng_state"])


def _live_lr_bounds(optimizer) -> tuple[float, float] | None:
    """The (max_lr, min_lr) that Megatron's optimizer puts in every param group (None: agoq's groups
    carry none and the scheduler's own values apply)."""
    bounds = {(g["max_lr"], g["min_lr"]) for g in optimizer.param_groups if "max_lr" in g}
    if len(bounds) > 1:
        raise NotImplementedError(f"per-group learning rates {sorted(bounds)}: agoq's resume handles one lr "
                                  "for all parameter groups")  # fmt: skip
    return bounds.pop() if bounds else None


def _rebase_saved_group_lrs(saved_optimizer, saved_schedule: dict, optimizer) -> None:
    """megatron-core 0.19.2 pairs saved and live param groups by a key that includes max_lr / min_lr
    (optimizer.param_group_identifier_keys): a changed --lr / --min-lr finds no saved group ("Could not
    find parameter group with key"). The saved groups that carry the checkpoint's schedule values get the
    live ones; _pin_group_lr_bounds then sets whatever schedule is in force."""
    live = _live_lr_bounds(optimizer)
    if live is None:
        return
    saved = (saved_schedule["max_lr"], saved_schedule["min_lr"])
    for groups in _param_group_lists(saved_optimizer):
        for group in groups:
            if isinstance(group, dict) and (group.get("max_lr"), group.get("min_lr")) == saved:
                group["max_lr"], group["min_lr"] = live


def _param_group_lists(tree):
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "param_groups" and isinstance(value, list):
                yield value
            else:
                yield from _param_group_lists(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _param_group_lists(value)


def _pin_group_lr_bounds(optimizer, scheduler) -> None:
    """Megatron's scheduler reads max_lr / min_lr from each group before its own: make the groups carry
    the schedule in force, then recompute every group's lr and weight decay. The recompute runs for agoq's
    groups too (they carry no bounds): megatron-core 0.19.2's ``load_state_dict`` steps the groups before it
    reads the checkpoint's weight decay, so without it the first resumed step used the command line's
    --weight-decay and every later one the checkpoint's."""
    if _live_lr_bounds(optimizer) is not None:
        for group in optimizer.param_groups:
            if "max_lr" in group:
                group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.step(0)
