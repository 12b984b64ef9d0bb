"""A rank whose launcher is gone ends instead of waiting forever.

``torchrun``'s agent starts the ranks as its child processes and, with ``--standalone``, hosts the job's rendezvous
store. When the agent itself dies without passing a signal on (SIGKILL, the out-of-memory killer), its ranks are
reparented and keep waiting in a collective on a peer or a store that no longer exists; on 2026-12-07 two such ranks
sat 28 minutes on this project's CI machine until found by hand. :class:`LauncherWatch` polls the parent process id
from a daemon thread; when it changes, the rank says so on stderr and ends with ``os._exit(EXIT_ORPHANED)`` (a rank in
a blocked collective cannot be unwound from Python, and nobody is left to collect a checkpoint it would save).

Only ranks started by torchrun are watched (``agoq.train.environment.launched_by_torchrun``): a trainer started with
``python`` or ``srun`` directly must keep running when its parent goes (``nohup``, a closed terminal).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

EXIT_ORPHANED = 70  # the launcher is gone (sysexits' EX_SOFTWARE: not a user error, not a signal)
POLL_S = 2.0


class LauncherWatch:
    """Watch the parent process (the launcher): ``start()`` polls ``os.getppid()`` every ``poll_s`` seconds from a
    daemon thread and calls ``on_orphaned(parent_pid)`` once it differs from the parent at construction.
    ``on_orphaned`` defaults to a stderr line and ``os._exit(EXIT_ORPHANED)``."""

    def __init__(self, rank: int, poll_s: float = POLL_S, on_orphaned: Callable[[int], None] | None = None):
        self.parent = os.getppid()
        self.rank = rank
        self.poll_s = poll_s
        self.on_orphaned = on_orphaned or self._exit_orphaned
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="agoq-launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if os.getppid() != self.parent:
                self.on_orphaned(self.parent)
                return


    def _exit_orphaned(self, parent: int) -> None:
        print(f"rank {self.rank}: the launcher (pid {parent}) is gone; ending this rank (exit {EXIT_ORPHANED}) "
              "instead of waiting on peers that cannot answer", file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)
