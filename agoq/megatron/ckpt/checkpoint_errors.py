"""The messages of a checkpoint that failed to save or read (agoq.megatron.ckpt.save, agoq.megatron.ckpt.load): one
line per rank naming the file and the errno, never torch's raw traceback.

Megatron's and torch DCP's writers keep little of a write error (the exception's class, or "unexpected pos 704 vs
598" for a short write), so the errno is recovered from the exception chain, the class name, or the free space left.
"""

from __future__ import annotations

import errno as errno_module
import os
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

# below this much free space after a failed write, the cause is taken to be a full filesystem: torch's writer
# reports a short write as "unexpected pos 704 vs 598" and megatron's writer keeps only the exception's class
_FULL_BELOW_BYTES = 16 << 20


# OSError subclasses by name: megatron's checkpoint writer keeps only the class of a write error
_ERRNO_OF_CLASS = {"IsADirectoryError": errno_module.EISDIR, "PermissionError": errno_module.EACCES,
                   "FileNotFoundError": errno_module.ENOENT, "NotADirectoryError": errno_module.ENOTDIR,
                   "FileExistsError": errno_module.EEXIST}


def _errno_text(code: int, where) -> str:
    return f"{errno_module.errorcode.get(code, 'errno')} (errno {code}: {os.strerror(code)}) writing {where}"


def save_error_text(exc: BaseException, target: Path) -> str | dict[int, str]:
    """This rank's save error in one line; for torch DCP's CheckpointException, {rank: line} of the ranks it
    names ({} on a rank that only learned that another one failed)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures is not None:
        return {rank: _one_save_error(failure[0] if isinstance(failure, tuple) else failure, target)
                for rank, failure in failures.items()}
    return _one_save_error(exc, target)


def _one_save_error(exc: BaseException, target: Path) -> str:
    import re
    import shutil

    found = _errno_of(exc)
    if found is not None:
        return _errno_text(found.errno, found.filename or target)
    named = re.search(r"<class '(\w+)'>", str(exc))
    if named and named.group(1) in _ERRNO_OF_CLASS:
        return _errno_text(_ERRNO_OF_CLASS[named.group(1)], target)
    try:
        free = shutil.disk_usage(target if target.exists() else target.parent).free
    except OSError:
        free = None
    if free is not None and free < _FULL_BELOW_BYTES:
        return (f"{_errno_text(errno_module.ENOSPC, target)}: {free} bytes free on its filesystem (the writer said: "
                f"{_first_line(exc)})")
    return f"{type(exc).__name__} writing {target}: {_first_line(exc)}"


def _errno_of(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``'s cause / context chain."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno:
            return item
        stack += [item.__cause__, item.__context__]
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def read_error_text(exc: BaseException, source) -> str:
    """One line for a rank's read error: the damaged file(s) of ``source`` when the sizes in its .metadata show
    them, and the underlying error (torch DCP's CheckpointException wraps it in a traceback dump, and numbers the
    ranks of its own process group, not the job's)."""
    inner = [failure[0] if isinstance(failure, tuple) else failure
             for failure in getattr(exc, "failures", {}).values()] or [exc]
    reasons = "; ".join(dict.fromkeys(_first_line(e) if str(e).strip() else type(e).__name__ for e in inner))
    if isinstance(exc, CheckpointException) or any(isinstance(e, EOFError | RuntimeError) for e in inner):
        damaged = damaged_files(Path(source)) if source is not None else []
        if damaged:
            return f"{'; '.join(damaged)} ({reasons})"
        if isinstance(exc, CheckpointException):
            return f"reading its tensor files failed ({reasons}); their sizes match its .metadata"
    return f"{type(exc).__name__}: {exc}"


def damaged_files(source: Path) -> list[str]:
    """Files of a torch_dist checkpoint that are missing or shorter than its .metadata says ('' when unknown)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(source)).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - no readable .metadata: nothing to compare with
        return []
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    out = []
    for name, size in sorted(needed.items()):
        path = source / name
        if not path.is_file():
            out.append(f"{path} is missing")
        elif path.stat().st_size < size:
            out.append(f"{path} is truncated ({path.stat().st_size} of the {size} bytes its .metadata lists)")
    return out
