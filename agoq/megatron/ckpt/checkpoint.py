"""Checkpoints through ``megatron.core.dist_checkpointing``: model chunks, optimizer, scheduler, progress.

Seam card
---------
Touches: ``dist_checkpointing.save`` / ``load`` / ``load_common_state_dict``,
  ``MegatronModule.sharded_state_dict``, ``MegatronOptimizer.sharded_state_dict`` / ``load_state_dict``
  (public API); ``OptimizerParamScheduler.override_opt_param_scheduler`` /
  ``use_checkpoint_opt_param_scheduler`` (set before its ``load_state_dict``: Megatron-LM's two resume
  modes); the saved param groups' ``max_lr`` / ``min_lr``, which megatron-core 0.19.2 uses to pair saved
  and live groups (``optimizer.param_group_identifier_keys``).
Why: the sharded format reloads under a different data-parallel size and is what Megatron users
  already use. Layout follows Megatron: ``<save>/iter_0000010/`` plus a tracker file
  ``latest_checkpointed_iteration.txt`` that is written (atomically, by rename) only after every
  rank finished writing, so an interrupted save never replaces the last complete checkpoint.
Verified on: megatron-core 0.19.2 (CPU gloo and GPU NCCL).
Resume order: the resume record (agoq.megatron.ckpt.resume) is checked before any tensor is read; every rank
  reads, all ranks agree, and only then is anything applied (a rank's read failure never leaves another
  rank with a newer state than the checkpoint the job falls back to).
Guarded by: ``tests/megatron/test_resume.py`` (resume matrix, fallback, schedule, mismatches).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException

from agoq.megatron.ckpt.checkpoint_errors import read_error_text, save_error_text
from agoq.megatron.ckpt.ckpt_files import PROGRESS_FILE, TRACKER_FILE, iteration_dir  # noqa: F401 (re-exported)
from agoq.megatron.ckpt.resume import (  # noqa: F401 (keys re-exported)
    CONTRACT_KEY,
    RECORD_KEY,
    ResumeMismatch,
    check_contract,
    policy_note,
)

# Reloadable with another data-parallel size. Megatron's default, fully_sharded_model_space, fails in
# 0.19.2 with "ShardedTensor.flattened_range is not supported" (measured).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
# state["agoq"][WEIGHTS_ONLY_KEY] = True: a converted checkpoint (python -m agoq.convert hf-to-agoq,
# agoq.megatron.ckpt.hf_checkpoint) holding the model's tensors only; --load takes the weights and starts the
# optimizer, LR schedule and data position fresh.
WEIGHTS_ONLY_KEY = "weights_only"
CONVERTED_HINT = ("It is a converted checkpoint: its shape is the Hugging Face model's (use the model.yaml written "
                  "next to it as --config), and its vocabulary rows are padded for the tensor-parallel size it was "
                  "converted for: convert again with python -m agoq.convert hf-to-agoq --tensor-model-parallel-size "
                  "<this run's TP> (and this run's --make-vocab-size-divisible-by)")


@dataclass(frozen=True)
class Progress:
    iteration: int
    consumed_samples: int
    skipped_iterations: int = 0


def _model_sharded_state_dict(model_chunks: list) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].module.sharded_state_dict()}
    return {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _full_sharded_state_dict(model_chunks, optimizer, scheduler, progress: Progress | None,
                             *, is_loading: bool, extra: dict | None = None) -> dict:
    state = _model_sharded_state_dict(model_chunks)
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
    if scheduler is not None:  # a load reads the schedule from the common state
        state["opt_param_scheduler"] = scheduler.state_dict()
    if progress is not None:
        state["progress"] = progress.__dict__.copy()
    state["agoq"] = dict(extra or {})
    state["rng_state"] = _rng_sharded_object()
    return state


def _data_parallel_size() -> int:
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _rng_sharded_object() -> ShardedObject:
    """This rank's RNG states (Python, NumPy, torch CPU/CUDA, Megatron's tracker), one object per
    (pp, tp, dp) rank, as Megatron's training checkpoints keep them."""
    rng = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    offset = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return ShardedObject("rng_state", rng, shape, offset, replica_id=0)


def _restore_rng(rng: dict) -> None:
    random.setstate(rng["random"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


def _ignore_stop_signals_in_child() -> None:
    """Initializer of the checkpoint writer's result-queue server process.

    The launcher (torchrun, slurm) delivers SIGTERM/SIGINT/SIGUSR1 to every process of the job; the
    training ranks turn it into "save, then exit", but the writer's helper process would die and break
    that very save (BrokenPipeError, measured). It ignores the stop signals and instead dies with its
    parent (Linux PR_SET_PDEATHSIG), so it never outlives the rank.
    """
    import ctypes
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:  # not Linux/glibc: the manager's own finalizer still stops it at a normal exit
        pass


def _install_signal_safe_results_queue() -> None:
    """Pre-create megatron's module-global ``_results_queue`` from a signal-proof manager process.

    Touches ``dist_checkpointing.strategies.filesystem_async._results_queue`` (listed in the contract);
    megatron creates it lazily with ``ctx.Manager().Queue()`` on the first save, which we do first.
    Recorded in agoq.megatron.install (seam ``checkpoint.results_queue``): the install handle's
    ``undo()`` puts Megatron's ``None`` back and stops the manager.
    """
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    from agoq.megatron.install import set_module_attr

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_ignore_stop_signals_in_child)
    _MANAGERS.append(manager)  # keep it alive until the process ends or the install handle's undo()

    def stop_manager() -> None:
        _MANAGERS.remove(manager)
        manager.shutdown()

    set_module_attr(filesystem_async, "_results_queue", manager.Queue(), seam="checkpoint.results_queue",
                    cleanup=stop_manager)


_MANAGERS: list = []


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (every rank raises it, with every failing rank's reason); the tracker still names
    the last complete checkpoint."""


def save_checkpoint(save_dir: str | os.PathLike, progress: Progress, model_chunks: list, optimizer,
                    scheduler, *, extra: dict | None = None) -> Path:
    """Write ``iter_N`` on every rank, then publish it in the tracker (rank 0, atomic rename). A failure on any rank
    (a full disk, a folder turned read-only) raises CheckpointSaveError on every rank, naming the path and errno;
    the tracker is left on the last complete checkpoint."""
    target = iteration_dir(save_dir, progress.iteration)
    _install_signal_safe_results_queue()
    _save_step(save_dir, target, lambda: target.mkdir(parents=True, exist_ok=True) if dist.get_rank() == 0 else None)
    extra = dict(extra or {}, torch_optimizer_step=_torch_optimizer_step(optimizer),
                 data_parallel_size=_data_parallel_size())
    state = _full_sharded_state_dict(model_chunks, optimizer, scheduler, progress, is_loading=False, extra=extra)
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


def latest_iteration_or_none(load_dir) -> int | None:
    try:
        return latest_iteration(load_dir)
    except (OSError, ValueError):
        return None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """The last completed checkpoint's iteration, or None when the directory has none."""
    tracker = Path(load_dir) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}; fix or delete the file")
    return int(text)


def _torch_optimizers(optimizer) -> list:
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def _torch_optimizer_step(optimizer) -> float | None:
    """The common ``step`` of torch.optim states (None before the first step)."""
    steps = {
        float(state["step"])
        for torch_optimizer in _torch_optimizers(optimizer)
        for state in torch_optimizer.state.values()
        if "step" in state
    }
    if len(steps) > 1:
        raise RuntimeError(f"optimizer states disagree on the step count: {sorted(steps)}")
    return steps.pop() if steps else None


def _set_torch_optimizer_step(optimizer, step: float | None) -> None:
    """Restore ``step`` as one tensor per parameter state.

    megatron-core 0.19.2 without TE/apex loses the step on load (it comes back as 0) and puts one
    shared tensor in every state, which torch's AdamW then increments once per parameter (measured:
    13 after one update). agoq saves the step itself and restores it here.
    """
    for torch_optimizer in _torch_optimizers(optimizer):
        for state in torch_optimizer.state.values():
            if step is None:
                state.pop("step", None)
            elif "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def _init_torch_optimizer_steps(optimizer) -> None:
    """Give a fresh torch.optim state a ``step`` before loading into it.

    Without TE/apex, ``DistributedOptimizer.state_dict()`` (called while building the load template)
    asserts that every param state holds one common tensor ``step``; Megatron's ``init_state_fn``
    creates only ``exp_avg``/``exp_avg_sq`` (megatron-core 0.19.2, measured). The loaded state
    overwrites these zeros.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if inner.init_state_fn is not None:
            inner.init_state_fn(torch_optimizer, inner.config)
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if state and "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)


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
    if saved_dp is not None and saved_dp != _data_parallel_size():
        notes.append(f"agoq checkpoint: saved with data-parallel size {saved_dp}, loading with "
                     f"{_data_parallel_size()}: model and optimizer states are resharded, RNG states are not "
                     "restored (fresh seeds)")
    for note in filter(None, notes):
        _print_rank0(note if note.startswith("agoq checkpoint") else f"agoq checkpoint: {note}")


def _read_state(source: Path, model_chunks, optimizer, common: dict) -> dict:
    """Every tensor of this rank, read into a template of the live objects; nothing is applied."""
    _init_torch_optimizer_steps(optimizer)
    template = _full_sharded_state_dict(model_chunks, optimizer, None, None, is_loading=True)
    if common.get("agoq", {}).get("data_parallel_size", _data_parallel_size()) != _data_parallel_size():
        template.pop("rng_state")  # saved per (pp, tp, dp) rank: another DP size has none for this rank
    return dist_checkpointing.load(template, str(source))


def _read_model_state(source: Path, model_chunks, optimizer, common: dict) -> dict:
    """A weights-only checkpoint: the model tensors of this rank."""
    return dist_checkpointing.load(_model_sharded_state_dict(model_chunks), str(source))


def _apply_weights_only(state: dict, model_chunks, optimizer, scheduler, override: bool) -> None:
    _load_model_chunks(state, model_chunks)
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


def _load_model_chunks(state: dict, model_chunks) -> None:
    if len(model_chunks) == 1:
        model_chunks[0].module.load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            chunk.module.load_state_dict(state[f"model{i}"])


def _apply_loaded_state(state: dict, model_chunks, optimizer, scheduler, override: bool) -> None:
    _load_model_chunks(state, model_chunks)
    _rebase_saved_group_lrs(state["optimizer"], state["opt_param_scheduler"], optimizer)
    with torch.no_grad():  # fp32-param distopt loads in place into leaves
        optimizer.load_state_dict(state["optimizer"])
    _set_torch_optimizer_step(optimizer, state["agoq"]["torch_optimizer_step"])
    # Megatron-LM's two modes: the checkpoint's schedule (--use-checkpoint-opt_param-scheduler), or
    # the constructor's values, i.e. the command line's (--override-opt_param-scheduler)
    scheduler.override_opt_param_scheduler = override
    scheduler.use_checkpoint_opt_param_scheduler = not override
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _pin_group_lr_bounds(optimizer, scheduler)
    if "rng_state" in state:
        _restore_rng(state["rng_state"])


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
