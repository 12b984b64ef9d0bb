"""Where a training step's GPU time goes, from a torch.profiler Chrome trace: per step, the GPU's busy time and the
kernel time by category, and the kernels with the most time; two traces side by side (``--against``).

Made for Megatron-LM's own profiler (``--profile --use-pytorch-profiler --profile-step-start A --profile-step-end
B``: ``<tensorboard-dir>/../torch_profile/rank-<R>.json.gz``), as ``benchmarks/bench_te.py --profile A B`` runs it;
any trace torch.profiler exported with CUDA activity reads the same.

How it counts:

- A step is a ``ProfilerStep#N`` annotation (the profiler's ``step()``); its host time is the annotation's length.
- A kernel (or GPU copy / memset) belongs to the step whose host window holds the CUDA runtime call that launched
  it (the trace's correlation ids): work that runs after its step's host window ended still counts for that step.
- ``gpu_busy_ms``: the union of the step's GPU intervals (overlapping kernels on several streams count once);
  ``gpu_span_ms``: first start to last end of them; ``gpu_idle_ms`` = span - busy (the GPU waiting on the host or
  on a dependency).
- ``by_category_ms``: summed kernel durations per category (overlaps count twice here, so the sum can exceed
  busy). Categories by kernel name, first match: ``agoq`` (a ``*_kernel`` function of agoq/kernels/*.py, read from
  the source), ``nccl``, ``attention``, ``gemm``, ``te_fp8_cast`` (Transformer Engine's cast / transpose / amax /
  scale kernels), ``te_other``, ``optimizer``, ``compiled`` (torch.compile's Triton kernels), ``copy`` (GPU
  memcpy / memset), ``elementwise`` (PyTorch's elementwise and reduction kernels), ``other``.

    python benchmarks/trace_summary.py rank-0.json.gz [--against other.json.gz] [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
RULES = (  # (category, regex on the kernel name), after agoq's own names; the first match wins
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attn|sdpa|cudnn"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|wgmma|cublas"),
    ("te_fp8_cast", r"transformer_engine.*(cast|transpose|amax|scale|quantiz)|(cast|transpose)_.*fp8"
                    r"|fp8.*(cast|transpose)"),
    ("te_other", r"transformer_engine"),
    ("optimizer", r"adam|multi_tensor|optim"),
    ("compiled", r"^triton_"),
    ("elementwise", r"elementwise|vectorized|reduce|at::native|unrolled"),
)


def agoq_kernel_names(root: Path = REPO) -> set[str]:
    """The ``@triton.jit`` functions of agoq/kernels whose names end in ``_kernel`` (the launched entry points)."""
    names: set[str] = set()
    for path in (root / "agoq" / "kernels").glob("*.py"):
        names.update(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\b", path.read_text()))
    return names


def category(name: str, cat: str, agoq_names: set[str]) -> str:
    if cat != "kernel":
        return "copy"
    if name in agoq_names:
        return "agoq"
    for label, pattern in RULES:
        if re.search(pattern, name, flags=re.I):
            return label
    return "other"


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        trace = json.load(fh)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1000.0


def summarize(events: list[dict], agoq_names: set[str] | None = None, top: int = 25) -> dict:
    """The per-step summary of one trace (see the module's docstring); times in ms, means over the steps."""
    agoq_names = agoq_kernel_names() if agoq_names is None else agoq_names
    complete = [e for e in events if e.get("ph") == "X"]
    steps = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in complete
                    if e.get("name", "").startswith("ProfilerStep#")), key=lambda s: s[0])
    step_of_correlation: dict[int, int] = {}
    for e in complete:
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            for k, (start, stop, _) in enumerate(steps):
                if start <= e["ts"] <= stop:
                    step_of_correlation[e["args"]["correlation"]] = k
                    break
    per_step = [{"spans": [], "by_category": defaultdict(float)} for _ in steps]
    kernels: dict[str, list] = {}
    unassigned = 0
    for e in complete:
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        k = step_of_correlation.get(e.get("args", {}).get("correlation"))
        if k is None:
            unassigned += 1
            continue
        label = category(e["name"], e["cat"], agoq_names)
        per_step[k]["spans"].append((e["ts"], e["ts"] + e["dur"]))
        per_step[k]["by_category"][label] += e["dur"] / 1000.0
        entry = kernels.setdefault(e["name"], [label, 0, 0.0])
        entry[1] += 1
        entry[2] += e["dur"] / 1000.0
    rows = []
    for (start, stop, name), step in zip(steps, per_step, strict=True):
        spans = step["spans"]
        span = (max(s[1] for s in spans) - min(s[0] for s in spans)) / 1000.0 if spans else 0.0
        busy = _union_ms(spans)
        rows.append({"step": name, "host_ms": (stop - start) / 1000.0, "gpu_busy_ms": busy, "gpu_span_ms": span,
                     "gpu_idle_ms": span - busy, "by_category_ms": dict(step["by_category"])})
    n = max(len(rows), 1)
    categories = sorted({c for r in rows for c in r["by_category_ms"]})
    mean = {key: statistics.fmean(r[key] for r in rows) if rows else 0.0
            for key in ("host_ms", "gpu_busy_ms", "gpu_span_ms", "gpu_idle_ms")}
    return {"steps": len(rows), **{f"mean_{k}": v for k, v in mean.items()},
            "mean_by_category_ms": {c: sum(r["by_category_ms"].get(c, 0.0) for r in rows) / n for c in categories},
            "per_step": rows, "gpu_events_outside_steps": unassigned,
            "top_kernels": [{"name": name, "category": label, "calls_per_step": calls / n, "ms_per_step": ms / n}
                            for name, (label, calls, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][2])[:top]]}


def compare(a: dict, b: dict) -> dict:
    """``b`` against ``a`` per step: each mean and category, and their difference (b - a), in ms."""
    keys = ("mean_host_ms", "mean_gpu_busy_ms", "mean_gpu_span_ms", "mean_gpu_idle_ms")
    categories = sorted(set(a["mean_by_category_ms"]) | set(b["mean_by_category_ms"]))
    out = {k: {"a": a[k], "b": b[k], "b_minus_a": b[k] - a[k]} for k in keys}
    out["by_category_ms"] = {c: {"a": a["mean_by_category_ms"].get(c, 0.0), "b": b["mean_by_category_ms"].get(c, 0.0),
                                 "b_minus_a": b["mean_by_category_ms"].get(c, 0.0)
                                 - a["mean_by_category_ms"].get(c, 0.0)} for c in categories}
    return out


def _table(summary: dict, against: dict | None) -> str:
    lines = []
    if against is None:
        lines.append(f"{summary['steps']} steps: host {summary['mean_host_ms']:.1f} ms, GPU busy "
                     f"{summary['mean_gpu_busy_ms']:.1f} of a {summary['mean_gpu_span_ms']:.1f} ms span per step")
        lines += [f"  {c:14s} {ms:9.2f} ms" for c, ms in sorted(summary["mean_by_category_ms"].items(),
                                                                 key=lambda kv: -kv[1])]
    else:
        diff = compare(against, summary)
        lines.append(f"{'per step (ms)':18s} {'against':>9s} {'this':>9s} {'this - against':>15s}")
        for key, row in diff.items():
            if key == "by_category_ms":
                for c, r in sorted(row.items(), key=lambda kv: -abs(kv[1]["b_minus_a"])):
                    lines.append(f"  {c:16s} {r['a']:9.2f} {r['b']:9.2f} {r['b_minus_a']:+15.2f}")
            else:
                lines.append(f"{key:18s} {row['a']:9.2f} {row['b']:9.2f} {row['b_minus_a']:+15.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--against", type=Path, default=None, help="a second trace: the table gives this - that")
    parser.add_argument("--json", type=Path, default=None, help="write the summary (and the comparison) here")
    args = parser.parse_args(argv)
    summary = summarize(load_events(args.trace))
    against = summarize(load_events(args.against)) if args.against else None
    print(_table(summary, against))
    if args.json:
        record = {"trace": str(args.trace), "summary": summary}
        if against is not None:
            record.update(against_trace=str(args.against), against=against, comparison=compare(against, summary))
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
