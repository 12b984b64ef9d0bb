"""Where a step's host time went, for the per-iteration record (--log-json): CPU time the host lost to its
hypervisor ("steal", ``host_steal_cpu_seconds``), and per thread of this process the CPU time it ran and the time it
waited for a CPU while runnable (``host_threads``), with Python's garbage collections (``gc_collections``,
``gc_seconds``).

Where a step is bound by the host enqueuing kernels (small micro-batches, eager), a virtual machine whose CPUs are
descheduled by the hypervisor runs slower steps with the same work, and the GPU cannot show why
(docs/benchmarks/activations.md: agoq's eager steps alternate between two speeds on some leases). Linux counts that
time per CPU in /proc/stat (the 8th value of the ``cpu`` line, in USER_HZ ticks, summed over the CPUs). Elsewhere,
or where the file has no such field, the reading is None and the record says so (null), nothing is estimated.

Per thread, Linux has ``/proc/self/task/<tid>/schedstat`` (proc(5): nanoseconds on a CPU, nanoseconds runnable but
waiting for one, time slices) and ``.../comm`` (the thread's name). A slow step whose main thread ran longer on its
CPU did more work or ran on a slower CPU; one whose main thread waited for a CPU lost it to another thread or process;
one where another thread of this process (``pt_autograd_0``: the backward's device thread; a data loader's pin-memory
thread) ran much longer shows that thread. Where schedstat cannot be read (no such file: the kernel lacks
CONFIG_SCHED_INFO, or not Linux) the record holds null.
"""

from __future__ import annotations

import gc
import os
import threading
import time

__all__ = ["PROC_STAT", "GCMeter", "ThreadTimes", "cpu_steal_seconds", "steal_since", "thread_times",
           "threads_since"]

PROC_STAT = "/proc/stat"
_STEAL_FIELD = 8  # "cpu user nice system idle iowait irq softirq steal ...": proc(5)
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # USER_HZ


def cpu_steal_seconds(path: str = PROC_STAT) -> float | None:
    """Steal time of all CPUs since boot, in CPU-seconds (None: not Linux, or no steal field)."""
    try:
        with open(path, "rb") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) <= _STEAL_FIELD or fields[0] != b"cpu":
        return None
    return int(fields[_STEAL_FIELD]) / _TICKS_PER_SECOND


def steal_since(before: float | None, path: str = PROC_STAT) -> float | None:
    """CPU-seconds stolen since the reading ``before`` (None when either reading is unavailable)."""
    now = cpu_steal_seconds(path)
    return None if before is None or now is None else now - before


PROC_TASKS = "/proc/self/task"
_NS_PER_SECOND = 1e9
THREADS_REPORTED = 4  # the busiest threads a record lists: main + the backward's thread + two more covers agoq's runs


class ThreadTimes(dict):
    """tid -> (name, seconds on a CPU, seconds runnable but waiting for a CPU) of this process's threads."""


def thread_times(root: str = PROC_TASKS) -> ThreadTimes | None:
    """Every thread's CPU and run-queue time now (None where schedstat cannot be read, e.g. not Linux)."""
    try:
        tids = os.listdir(root)
    except OSError:
        return None
    out = ThreadTimes()
    for tid in tids:
        try:
            with open(f"{root}/{tid}/schedstat", "rb") as sched:
                on_cpu_ns, wait_ns = sched.read().split()[:2]
            with open(f"{root}/{tid}/comm", "rb") as comm:
                name = comm.read().strip().decode(errors="replace")
            out[int(tid)] = (name, int(on_cpu_ns) / _NS_PER_SECOND, int(wait_ns) / _NS_PER_SECOND)
        except (OSError, ValueError):
            continue  # the thread ended between listdir and open, or no schedstat
    return out or None


def threads_since(before: ThreadTimes | None, main_tid: int, root: str = PROC_TASKS,
                  limit: int = THREADS_REPORTED) -> list[dict] | None:
    """The busiest threads since ``before``: [{"name", "main", "cpu_seconds", "wait_seconds"}], the main thread
    first, then the others by CPU seconds, at most ``limit`` (None when either reading is unavailable)."""
    now = thread_times(root)
    if before is None or now is None:
        return None
    rows = []
    for tid, (name, cpu_s, wait_s) in now.items():
        name0, cpu0, wait0 = before.get(tid, (name, 0.0, 0.0))  # a thread started inside the step counts from zero
        if cpu_s < cpu0 or name0 != name:  # the id was reused by a new thread inside the step
            cpu0 = wait0 = 0.0
        rows.append({"name": name, "main": tid == main_tid, "cpu_seconds": round(cpu_s - cpu0, 4),
                     "wait_seconds": round(wait_s - wait0, 4)})
    rows.sort(key=lambda row: (not row["main"], -row["cpu_seconds"]))
    return rows[:limit]


def main_thread_id() -> int:
    """The OS id of the thread that calls this (the training loop's)."""
    return threading.get_native_id()


class GCMeter:
    """Counts Python's garbage collections and their wall time (``gc.callbacks``) while installed."""

    def __init__(self):
        self.collections, self.seconds, self._start = 0, 0.0, None

    def __call__(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.collections += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def install(self) -> GCMeter:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def reading(self) -> tuple[int, float]:
        return self.collections, self.seconds
