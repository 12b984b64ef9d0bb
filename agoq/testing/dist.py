"""Run a function on W ranks of a real process group (gloo on CPU) from a test or a script.

``spawn_ranks(world_size, fn, backend="gloo")`` starts one process per rank, joins them through a
file-based rendezvous in a fresh temporary directory (no ports, so parallel test runs cannot
collide), calls ``fn(rank, world_size, *args)`` inside an initialised default process group and
returns every rank's return value (rank order). A failure on any rank raises ``RankError`` carrying
that rank's traceback; a hang raises after ``timeout_s``. The idea follows flashoptim's
``ddp_runner`` without its CUDA requirement.

``fn`` must be a module-level function (it is pickled by name). The default start method is
``forkserver``: a fresh server process, started once per parent, imports torch and megatron-core
(``PRELOAD``; the ~5 s a rank otherwise spends importing them on a 2-core machine) and forks every rank
from that single-threaded state. Forking the parent itself is faster still but deadlocked in the full
CPU suite: a parent whose OpenMP/gloo threads already ran forks children that hang in the thread pool
(measured: tests/dist hung for minutes after tests/unit ran in the same pytest process); the server has
run no operator, so its children start clean. A forked rank inherits the server's environment, so each
rank is handed the parent's ``os.environ`` of the call and applies it before ``fn`` runs. ``"spawn"``
(a fresh interpreter per rank) and ``"fork"`` (for a fresh parent) remain available.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn_ranks", "RankError"]

DEFAULT_TIMEOUT_S = 300.0  # generous for 2 shared CPU cores; a real hang is still reported
# what the fork server imports before it forks ranks (a name that does not import is skipped by multiprocessing)
PRELOAD = ("torch", "torch.distributed", "megatron.core", "agoq.megatron")


class RankError(RuntimeError):
    """A rank raised (or died); the message holds its traceback or exit code."""


def _child(rank: int, world_size: int, fn: Callable, args: tuple, backend: str, workdir: str, threads: int,
           environ: dict[str, str]) -> None:
    out = Path(workdir) / f"rank{rank}.pkl"
    try:
        if os.environ != environ:  # a forkserver rank starts with the server's environment, not the caller's
            os.environ.clear()
            os.environ.update(environ)
        if threads:
            torch.set_num_threads(threads)
        dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank,
                                world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - forwarded to the parent with the traceback
        payload = ("error", traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(payload, f)


def spawn_ranks(world_size: int, fn: Callable[..., Any], backend: str = "gloo", *, args: tuple = (),
                timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver",
                threads_per_rank: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first call), kept after
    with tempfile.TemporaryDirectory(prefix="agoq-ranks-") as workdir:
        procs = [
            ctx.Process(target=_child,
                        args=(r, world_size, fn, args, backend, workdir, threads_per_rank, dict(os.environ)))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        outcomes = [(False, None) if r in hung else _collect(workdir, r, procs[r].exitcode)
                    for r in range(world_size)]
    # every failed rank's report: the first rank's is often only the peer's disconnection, and a rank that hangs
    # usually waits for one that failed
    failures = [report for ok, report in outcomes if not ok and report is not None]
    if hung:
        failures.insert(0, f"ranks {hung} did not finish within {timeout_s:.0f} s (deadlock in a collective?)")
    if failures:
        raise RankError("\n\n".join(failures))
    return [value for _, value in outcomes]


def _collect(workdir: str, rank: int, exitcode: int | None) -> tuple[bool, Any]:
    """(True, the rank's result) or (False, why it has none)."""
    path = os.path.join(workdir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        how = f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else \
            f"exited with code {exitcode}"
        return False, f"rank {rank} {how} before reporting a result"
    with open(path, "rb") as f:
        status, value = pickle.load(f)
    if status == "error":
        return False, f"rank {rank} failed:\n{value}"
    return True, value
