"""What is alive at a training run's peak GPU memory, grouped by where it was allocated (GPU).

Runs ``scripts/pretrain_llama.py`` in this process (one GPU, no torchrun) with PyTorch's allocator
history on, then replays the recorded alloc / free events to the moment of the highest allocated total
and groups the blocks alive then by the first frames of their allocation stack that lie in agoq,
megatron or torch.nn.functional. Use it when the planner and a measured peak disagree
(docs/benchmarks/planner.md)::

    python benchmarks/mem_trace.py --out trace.json -- --config configs/model/llama-1b.yaml --micro-batch-size 4 ...

Everything after ``--`` goes to pretrain_llama.py. Writes a small JSON (top groups, bytes, counts),
not the raw snapshot. Under torchrun (several GPUs) every rank traces its own GPU and writes
``<out stem>.rank<R>.json``::

    torchrun --nproc-per-node 4 benchmarks/mem_trace.py --out trace.json -- --pipeline-model-parallel-size 2 ...
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
KEEP = ("agoq/", "megatron/core/", "torch/nn/functional", "torch/autograd/function")
MAX_EVENTS = 2_000_000
GIB = 2**30


def _where(frames: list[dict], depth: int) -> str:
    picked = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}" for f in frames
              if any(k in f["filename"] for k in KEEP)]
    return " <- ".join(picked[:depth]) or "(no agoq/megatron frame)"


def live_at_peak(snapshot: dict, depth: int, device: int = 0) -> dict:
    """Replay one device's trace: the allocated total over time, and the blocks alive at its maximum."""
    events = snapshot["device_traces"][device]
    # pass 1: where the allocated total peaks (copying the live set at every new maximum is quadratic)
    live_size: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live_size[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_requested" and e["addr"] in live_size:
            total -= live_size.pop(e["addr"])
    # pass 2: the blocks alive right after that event
    at_peak: dict[int, dict] = {}
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            at_peak[e["addr"]] = e
        elif e["action"] == "free_requested":
            at_peak.pop(e["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in at_peak.values():
        g = groups[_where(e.get("frames", []), depth)]
        g[0] += e["size"]
        g[1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_in_trace_gib": peak / GIB, "events": len(events),
            "groups": [{"where": w, "gib": b / GIB, "blocks": n} for w, (b, n) in top[:40]]}


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--depth", type=int, default=3, help="agoq/megatron frames per group key")
    args = p.parse_args(argv[:split])
    if not torch.cuda.is_available():
        raise SystemExit("mem_trace.py needs a CUDA GPU (the allocator history is CUDA's)")
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks="python")
    sys.argv = [str(REPO / "scripts" / "pretrain_llama.py"), *argv[split + 1:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()  # the rank's GPU (pretrain_llama.py selected LOCAL_RANK's)
    report = live_at_peak(snapshot, args.depth, device)
    report["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    report["pretrain_args"] = sys.argv[1:]
    out = Path(args.out)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out = out.with_name(f"{out.stem}.rank{os.environ.get('RANK', '0')}{out.suffix}")
    out.write_text(json.dumps(report, indent=1))
    for g in report["groups"][:25]:
        print(f"{g['gib']:8.3f} GiB {g['blocks']:6d}  {g['where']}")
    print(f"peak in trace {report['peak_in_trace_gib']:.3f} GiB, max_memory_allocated "
          f"{report['max_memory_allocated_gib']:.3f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
