"""CPU time the host lost to its hypervisor ("steal"), for the per-iteration record (--log-json
``host_steal_cpu_seconds``).

Where a step is bound by the host enqueuing kernels (small micro-batches, eager), a virtual machine whose CPUs are
descheduled by the hypervisor runs slower steps with the same work, and the GPU cannot show why
(docs/benchmarks/activations.md: agoq's eager steps alternate between two speeds on some leases). Linux counts that
time per CPU in /proc/stat (the 8th value of the ``cpu`` line, in USER_HZ ticks, summed over the CPUs). Elsewhere,
or where the file has no such field, the reading is None and the record says so (null), nothing is estimated.
"""

from __future__ import annotations

import os

__all__ = ["PROC_STAT", "cpu_steal_seconds", "steal_since"]

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
