"""benchmarks/mem_trace.py's replay: the blocks alive at the highest allocated total, grouped by site."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mem_trace.py"


def _module():
    spec = importlib.util.spec_from_file_location("mem_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _frames(name):
    return [{"filename": "/x/site-packages/torch/lib.py", "line": 1, "name": "inner"},
            {"filename": f"/repo/agoq/{name}.py", "line": 7, "name": name}]


def test_replay_finds_the_peak_and_groups_what_is_alive_then():
    gib = 2**30
    events = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": _frames("a")},
        {"action": "alloc", "addr": 2, "size": 1 * gib, "frames": _frames("b")},
        {"action": "alloc", "addr": 3, "size": 1 * gib, "frames": _frames("b")},  # peak: 4 GiB
        {"action": "free_requested", "addr": 2, "size": 1 * gib},
        {"action": "free_completed", "addr": 2, "size": 1 * gib},
        {"action": "alloc", "addr": 4, "size": 1 * gib, "frames": _frames("c")},  # back to 4 GiB, not above
    ]
    report = _module().live_at_peak({"device_traces": [events]}, depth=1)
    assert report["peak_in_trace_gib"] == 4.0
    groups = {g["where"]: (g["gib"], g["blocks"]) for g in report["groups"]}
    assert groups == {"/repo/agoq/a.py:7:a": (2.0, 1), "/repo/agoq/b.py:7:b": (2.0, 2)}  # c came after the peak
