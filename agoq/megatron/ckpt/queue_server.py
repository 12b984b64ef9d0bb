"""The checkpoint writer's result queue, served by a small stdlib-only process.

Megatron's ``dist_checkpointing`` collects its writers' results through a module-global manager queue
(``filesystem_async._results_queue``). Left to itself it starts that manager with ``multiprocessing``'s spawn
context, and a spawned child re-imports the training script's ``__main__``: torch, megatron and agoq, for a queue
server. Measured on the CPU machine (2026-12-07, ``scripts/pretrain_llama.py``'s imports): 4.9 s to start and
739 MiB of host memory per rank, for the whole run, on every rank of every node.

This module is two things:

* run as a script (``python -I -S queue_server.py``, standard library only): a manager server of one queue
  type on a local socket; the items are pickled bytes (the clients pickle them: :class:`PicklingQueueProxy`), so
  it needs none of the classes the writers put. It reads ``AUTHKEY_HEX PARENT_PID`` from its stdin, prints
  ``{"address": ...}`` on one line, and serves until its stdin closes (the rank closed it, or ended). The
  launcher's stop signals (SIGTERM, SIGINT, SIGUSR1, sent to the whole job) are ignored: the rank turns them into
  "save, then exit", and that save needs the queue. It dies with the rank (Linux ``PR_SET_PDEATHSIG``), so it
  never outlives it.
* imported (by the rank): :func:`start_queue_server` starts it and returns a connected :class:`QueueServer`;
  its ``queue`` is a manager proxy like the one Megatron would have made, under the rank's own authkey, so the
  writer processes Megatron forks or spawns use it unchanged.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing import current_process
from multiprocessing.managers import BaseManager, BaseProxy

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0


class PicklingQueueProxy(BaseProxy):
    """A queue whose items the clients pickle and unpickle themselves: the server stores bytes, so it needs none of
    the classes Megatron's writers put (torch's WriteResult, wrapped exceptions). The methods Megatron calls (put,
    get_nowait) and the rest of ``queue.Queue``'s."""

    _exposed_ = ("put", "get", "qsize", "empty", "full")

    def put(self, obj, block: bool = True, timeout: float | None = None) -> None:
        self._callmethod("put", (pickle.dumps(obj), block, timeout))

    def put_nowait(self, obj) -> None:
        self.put(obj, False)

    def get(self, block: bool = True, timeout: float | None = None):
        return pickle.loads(self._callmethod("get", (block, timeout)))

    def get_nowait(self):
        return self.get(False)

    def qsize(self) -> int:
        return self._callmethod("qsize")

    def empty(self) -> bool:
        return self._callmethod("empty")

    def full(self) -> bool:
        return self._callmethod("full")


class QueueManager(BaseManager):
    """The server's one type: ``Queue()``, a ``queue.Queue`` of pickled items behind a PicklingQueueProxy."""


QueueManager.register("Queue", queue.Queue, proxytype=PicklingQueueProxy)


@dataclass
class QueueServer:
    """A running server (its process) and the rank's proxy of its queue."""

    process: subprocess.Popen
    manager: QueueManager
    queue: PicklingQueueProxy

    def stop(self) -> None:
        """Close the server's stdin (it stops within a second and removes its socket); killed if it has not ended
        after STOP_TIMEOUT_S."""
        if self.process.poll() is not None:
            return
        try:
            self.process.stdin.close()
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()


def start_queue_server(timeout_s: float = START_TIMEOUT_S) -> QueueServer:
    """Start the server (this file run by the same interpreter, isolated from site-packages) and connect to it.
    Raises RuntimeError with the server's own output if it has not said its address within ``timeout_s``."""
    authkey = bytes(current_process().authkey)
    # its stderr into a file, not a pipe: nobody reads it while it serves, and a full pipe would stop the server
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        proc.stdin.write(f"{authkey.hex()} {os.getpid()}\n")
        proc.stdin.flush()
    except BrokenPipeError:  # it ended already: reported below with its output
        pass
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        errors.seek(0)
        err = errors.read()
        raise RuntimeError(f"the checkpoint writer's queue server ({__file__}) did not start within {timeout_s:.0f} s "
                           f"(exit {proc.returncode}): {err.strip()[-1500:] or 'no output'}")
    errors.close()  # the server keeps its own handle of the (unlinked) file
    address = json.loads(line)["address"]
    address = tuple(address) if isinstance(address, list) else address  # an AF_INET (host, port) pair
    manager = QueueManager(address=address, authkey=authkey)
    manager.connect()
    return QueueServer(proc, manager, manager.Queue())


def _die_with_parent(parent_pid: int) -> None:
    import ctypes

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux/glibc: the closed stdin still stops it when the parent ends
        pass
    if os.getppid() != parent_pid:  # the parent ended before prctl took effect
        os._exit(0)


def _serve() -> None:
    key_hex, parent_pid = sys.stdin.readline().split()
    _die_with_parent(int(parent_pid))
    server = QueueManager(authkey=bytes.fromhex(key_hex)).get_server()

    def stop_on_eof() -> None:
        sys.stdin.read()  # returns when the rank closes its end or ends
        server.stop_event.set()

    threading.Thread(target=stop_on_eof, daemon=True).start()
    print(json.dumps({"address": server.address}), flush=True)
    server.serve_forever()  # ends with sys.exit(0) once stop_event is set: the socket's folder is removed


if __name__ == "__main__":
    _serve()
