"""Peak CPU allocation of a code region, from torch's own allocator events (tests of memory claims).

``with cpu_allocation_peak() as peak: ...`` runs the region under ``torch.profiler`` with
``profile_memory=True``; every CPU allocation and free (tensor storages, storage ``resize_``, from any
thread) is reported with the allocator's running total since the profiler started. Afterwards
``peak.bytes`` is the highest running total inside the region, i.e. the most bytes allocated at once
beyond what was live when it started (frees of tensors allocated before any profiling are not
reported, so they never lower it: the number is an upper bound), and ``peak.net`` the total at the
end, and ``peak.largest`` the largest single allocation inside the region. CPU only (CUDA has
torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocationPeak", "cpu_allocation_peak"]


@dataclass
class AllocationPeak:
    bytes: int = 0
    net: int = 0
    events: int = 0
    largest: int = 0  # bytes of the largest single allocation in the region


@contextlib.contextmanager
def cpu_allocation_peak():
    result = AllocationPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    fd, path = tempfile.mkstemp(suffix=".json", prefix="agoq-mem-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = sorted((e for e in trace["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    mem = [e["args"] for e in events if e["args"].get("Device Type", 0) == 0]
    if not mem:
        return
    # the allocator's running total persists across profiler sessions (blocks it saw allocated earlier
    # are subtracted when freed): measure from the total just before the region's first event
    base = int(mem[0]["Total Allocated"]) - int(mem[0]["Bytes"])
    totals = [int(a["Total Allocated"]) - base for a in mem]
    result.events = len(totals)
    result.bytes = max([0] + totals)
    result.net = totals[-1]
    result.largest = max([0] + [int(a["Bytes"]) for a in mem])
