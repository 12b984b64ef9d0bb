"""One job per ``--save`` folder: the lock file ``<save>/agoq_save.lock``, taken by rank 0 at start-up, held while
the job runs, removed at exit.

The file is JSON: host, pid, start time, Slurm job id (``SLURM_JOB_ID``) and a random token. A second job that
finds it stops before training and names the holder. What this relies on (and what it does not):

* **Atomic create, no flock.** The record is written to a private temporary file in the same folder, then
  hard-linked to the lock name (``os.link`` fails with EEXIST when the name exists: atomic on local filesystems and
  on NFSv3/v4, the classic NFS-safe lock-file recipe; a lost reply to a retried link is caught by the temporary
  file's link count of 2). Filesystems without hard links fall back to ``open(O_CREAT | O_EXCL)`` (exclusive
  create, atomic on NFSv3+). ``flock``/``fcntl`` locks are not used: on NFS they depend on lockd and the mount
  options, and die with the client.
* **Heartbeat.** The holder refreshes the file's mtime every ``HEARTBEAT_S`` seconds (a daemon thread). A lock is
  stale when its holder ran on this host and its pid is gone, or when its mtime is older than ``STALE_AFTER_S`` on
  any host (a job killed by SIGKILL or a lost node; the hosts' clocks must agree to well within that, as NTP
  keeps them). A stale lock is reported and taken over; a live one stops the job unless ``--force-unlock``.
* **Take-over** renames the stale file aside (atomic), checks that the renamed file is the one judged stale (not
  a lock another job created meanwhile: then that job holds the folder, and it is put back), then creates the lock
  as above.
* Released at exit (normal end, exception, the stop signals the trainer turns into save-and-exit) only when the
  file still carries this job's token.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "agoq_save.lock"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0  # ten missed heartbeats


class SaveLocked(ValueError):
    """Another job holds the --save folder (the message names it and the fix)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float
    slurm_job_id: str | None
    token: str

    @classmethod
    def of_this_process(cls, environ) -> Holder:
        return cls(socket.gethostname(), os.getpid(), time.time(), environ.get("SLURM_JOB_ID"), uuid.uuid4().hex)

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}{job}, started {started}"


def _read(path: Path) -> Holder | None:
    try:
        data = json.loads(path.read_text())
        return Holder(str(data["host"]), int(data["pid"]), float(data["started"]), data.get("slurm_job_id"),
                      str(data["token"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # half-written by a tool, or not ours: judged by its age
        return Holder("unknown", -1, 0.0, None, "")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def stale_reason(path: Path, holder: Holder, now: float | None = None) -> str | None:
    """Why the lock at ``path`` is stale, or None while its holder looks alive."""
    now = time.time() if now is None else now
    try:
        age = now - path.stat().st_mtime
    except FileNotFoundError:
        return "gone"
    if holder.host == socket.gethostname() and holder.pid > 0 and not _pid_alive(holder.pid):
        return f"its process {holder.pid} no longer runs on this host"
    if age > STALE_AFTER_S:
        return (f"its heartbeat stopped {age:.0f} s ago (the holder refreshes it every {HEARTBEAT_S:.0f} s; stale "
                f"after {STALE_AFTER_S:.0f} s)")
    return None


def _create(path: Path, holder: Holder) -> bool:
    """Create ``path`` holding ``holder`` atomically; False when it exists. OSError for anything else."""
    text = json.dumps(holder.__dict__) + "\n"
    tmp = path.with_name(f".{path.name}.{holder.host}.{holder.pid}.{holder.token[:8]}")
    tmp.write_text(text)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
                return _create_exclusive(path, text)  # no hard links here: exclusive create
            if tmp.stat().st_nlink == 2:  # the link was made, its reply lost (NFS retry)
                return True
            raise
    finally:
        tmp.unlink(missing_ok=True)


def _create_exclusive(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return True


class SaveLock:
    """The lock of one --save folder, held by this process (rank 0) from :meth:`acquire` to :meth:`release`."""

    def __init__(self, folder: str | os.PathLike, environ=os.environ):
        self.path = Path(folder) / LOCK_FILE
        self.holder = Holder.of_this_process(environ)
        self.notes: list[str] = []  # what acquire() found and did (a stale lock taken over), for the log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, *, force: bool = False) -> SaveLock:
        """Take the lock or raise SaveLocked naming the holder; OSError (unwritable folder) passes through."""
        for _ in range(3):  # a holder that released meanwhile, or a lost take-over race: look again
            if _create(self.path, self.holder):
                self._start_heartbeat()
                return self
            found = _read(self.path)
            if found is None:
                continue
            reason = "--force-unlock" if force else stale_reason(self.path, found)
            if reason is None:
                raise SaveLocked(
                    f"--save {self.path.parent}: another job is using this folder ({found.describe()}; lock file "
                    f"{self.path}). Two jobs saving into one folder overwrite each other's checkpoints. Wait for it "
                    f"to end, or give this job another --save folder; if that job is gone, remove the lock file or "
                    f"pass --force-unlock (a lock whose holder stopped refreshing it is taken over by itself after "
                    f"{STALE_AFTER_S:.0f} s)")
            if reason == "gone":
                continue
            self._take_over(found, reason)
        raise SaveLocked(f"--save {self.path.parent}: could not take the lock {self.path} (other jobs keep taking "
                         "it); start one job per --save folder")

    def _take_over(self, found: Holder, reason: str) -> None:
        aside = self.path.with_name(f".{self.path.name}.stale.{self.holder.token[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = _read(aside)
        if moved is not None and moved.token != found.token:  # another job's fresh lock: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        self.notes.append(f"--save {self.path.parent}: took over the lock of {found.describe()}: "
                          f"{'removed by --force-unlock' if reason == '--force-unlock' else 'stale, ' + reason}")

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="agoq-save-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (_read(self.path) or Holder("", 0, 0, None, "")).token == self.holder.token:
                    os.utime(self.path)
            except OSError:  # a filesystem hiccup: the next beat tries again
                pass

    def release(self) -> None:
        """Remove the lock if it is still this job's (idempotent)."""
        self._stop.set()
        found = _read(self.path)
        if found is not None and found.token == self.holder.token:
            self.path.unlink(missing_ok=True)
