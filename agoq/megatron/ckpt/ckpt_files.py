"""What a checkpoint folder holds, read from its files alone (no torch, no megatron: the trainer's start-up checks
use it before anything is built).

Layout (Megatron's): ``<save>/iter_0000010/`` per checkpoint and the tracker ``latest_checkpointed_iteration.txt``.
A checkpoint is *complete* when rank 0 wrote its ``agoq_progress.json`` (after every rank finished writing; it must
parse): an ``iter_*`` folder without it is an interrupted save, which a later save of the same iteration may
replace (Megatron's ``dist_checkpointing.save`` writes into such a folder with a warning).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

TRACKER_FILE = "latest_checkpointed_iteration.txt"
PROGRESS_FILE = "agoq_progress.json"  # human-readable copy of the progress counters; its presence = complete
_ITER_RE = re.compile(r"iter_(\d+)")


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def iteration_of(path: str | os.PathLike) -> int | None:
    """N for a folder named ``iter_N`` (Megatron writes 7 digits), else None."""
    match = _ITER_RE.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(folder: Path) -> bool:
    """The save of this ``iter_*`` folder finished on every rank (its progress record is there and parses)."""
    try:
        record = json.loads((folder / PROGRESS_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(record, dict) and "iteration" in record


def saved_iterations(folder: str | os.PathLike) -> dict[int, bool]:
    """iteration -> complete, for every ``iter_*`` folder in ``folder`` (empty when it does not exist)."""
    root = Path(folder)
    if not root.is_dir():
        return {}
    found = {}
    for path in root.iterdir():
        iteration = iteration_of(path)
        if iteration is not None and path.is_dir():
            found[iteration] = is_complete(path)
    return dict(sorted(found.items()))


def complete_iterations(folder: str | os.PathLike) -> list[int]:
    return [it for it, complete in saved_iterations(folder).items() if complete]


@dataclass(frozen=True)
class Tracker:
    """The tracker file of a folder: ``iteration`` when it names one; ``problem`` when it exists but does not."""

    path: Path
    iteration: int | None
    problem: str | None

    @property
    def exists(self) -> bool:
        return self.iteration is not None or self.problem is not None


def read_tracker(folder: str | os.PathLike) -> Tracker:
    path = Path(folder) / TRACKER_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return Tracker(path, None, None)
    except (OSError, UnicodeDecodeError) as exc:
        return Tracker(path, None, f"unreadable ({exc})")
    if not text.isdigit():
        return Tracker(path, None, f"expected an iteration number, found {text!r}")
    return Tracker(path, int(text), None)


def names(iterations) -> str:
    """``iter_0000002, iter_0000004`` (at most the newest 6)."""
    items = sorted(iterations)
    shown = [f"iter_{i:07d}" for i in items[-6:]]
    return (f"{len(items) - 6} older, " if len(items) > 6 else "") + ", ".join(shown)


def written_by_megatron_training(folder: str | os.PathLike) -> int | None:
    """The iteration of a checkpoint folder that ``megatron.training`` wrote (agoq's Megatron-LM door, or Megatron-LM's
    own ``pretrain_gpt.py``): its tracker names an existing ``iter_*`` folder and no ``iter_*`` folder holds agoq's
    progress record, which agoq's trainer (scripts/pretrain_llama.py) writes with every complete save. None otherwise.
    The two trainers' checkpoints are not interchangeable (their state layouts differ): each refuses the other's."""
    tracker = read_tracker(folder)
    if tracker.iteration is None or not iteration_dir(folder, tracker.iteration).is_dir():
        return None
    return None if any(saved_iterations(folder).values()) else tracker.iteration


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """The last completed checkpoint's iteration, or None when the directory has none."""
    tracker = Path(load_dir) / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}; fix or delete the file")
    return int(text)


def latest_iteration_or_none(load_dir) -> int | None:
    try:
        return latest_iteration(load_dir)
    except (OSError, ValueError):
        return None
