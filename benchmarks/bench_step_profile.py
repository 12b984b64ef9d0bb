"""Where a whole training step of scripts/pretrain_llama.py spends host time, and whether it waits on the GPU.

Issue 24: in eager mode at micro-batch 1 agoq's steps are slower than the baseline's although its GPU work is
less (under CUDA graphs agoq is the faster one). This runs the real script (under torchrun, any layout) and
profiles a few chosen training iterations with ``torch.profiler`` (CPU + CUDA activity), then writes per rank:

- ``host_ms_per_thread``: CPU time of the profiled top-level ops per thread, keyed by the profiler's own thread
  numbers (in these runs one holds the forward's ops: the main thread; another the backward's: the autograd
  engine's device thread);
- ``gpu_busy_ms`` (the union of the kernel intervals) against ``wall_ms``: a host-bound step leaves the GPU idle;
- ``sync_calls``: counts and CPU time of the CUDA runtime calls that block the host (stream / event / device
  synchronisations, synchronous copies, cudaMalloc / cudaFree), which stop the host from running ahead
  (asynchronous copies and stream waits are not among them);
- ``sync_sites``: with ``torch.cuda.set_sync_debug_mode("warn")`` during the profiled iterations, the Python
  lines that made a synchronising call, counted;
- ``top_ops``: the ops with the most self CPU time.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_step_profile.py --iterations 6 7 \\
        --out step_profile.json -- --num-layers 16 ... --pipeline-model-parallel-size 2

``--iterations`` are consecutive training iterations of the run (the trainer's own numbering, so a resumed run
profiles the iterations named). The report is written as soon as the last of them ends; a run that never reaches
them exits with status 3. Everything after ``--`` is the script's own command line. On the CPU (no CUDA activity)
it still writes the host times (a smoke check).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agoq.testing.procs import PRETRAIN_SCRIPT  # noqa: E402

# CUDA runtime / driver calls after which the host cannot have run ahead of the GPU (blocking)
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                  "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree", "cudaHostAlloc")
_VERSIONED = "_v"  # driver entry points carry a version suffix (cuMemAlloc_v2)


def _blocking(name: str) -> bool:
    """Exact names: a prefix match would count cudaMemcpyAsync (asynchronous) as cudaMemcpy."""
    return any(name == call or name.startswith(call + _VERSIONED) for call in BLOCKING_CALLS)
TOP_OPS = 40
NOT_REACHED_EXIT = 3  # the run ended before the last chosen iteration


def _intervals_union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarise(prof, wall_s: float, sync_sites: collections.Counter) -> dict:
    events = prof.events()
    per_thread: dict[int, float] = collections.defaultdict(float)
    kernels, syncs = [], collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        device_type = str(getattr(e, "device_type", ""))
        if device_type.endswith("CUDA"):
            kernels.append((e.time_range.start, e.time_range.end))
            continue
        if e.cpu_parent is None:  # top-level ops only: their CPU time includes their children's
            per_thread[e.thread] += e.cpu_time_total / 1e3
        if _blocking(e.name):
            syncs[e.name][0] += 1
            syncs[e.name][1] += e.cpu_time_total / 1e3
    table = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return {
        "wall_ms": wall_s * 1e3,
        "host_ms_per_thread": {str(t): round(ms, 3) for t, ms in per_thread.items()},
        "gpu_busy_ms": _intervals_union_us(kernels) / 1e3,
        "kernels": len(kernels),
        "sync_calls": {k: {"calls": n, "cpu_ms": round(ms, 3)} for k, (n, ms) in sorted(syncs.items())},
        "sync_sites": dict(sync_sites.most_common(30)),
        "top_ops": [{"name": a.key, "calls": a.count, "self_cpu_ms": round(a.self_cpu_time_total / 1e3, 3),
                     "cpu_ms": round(a.cpu_time_total / 1e3, 3)} for a in table],
    }


def install(iterations: set[int], out: Path) -> dict:
    """Wrap StepRunner.run so that the chosen iterations run under the profiler; the report is written when the last
    one ends. Returns the state (its ``written`` key holds the report's path then)."""
    import time

    from agoq.train import training

    original, state = training.StepRunner.run, {"wall": 0.0, "sites": collections.Counter()}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)

    def run(self, data_iterators):
        if self.iteration not in iterations:  # the trainer sets the iteration each run() performs
            return original(self, data_iterators)
        first, last = self.iteration == min(iterations), self.iteration == max(iterations)
        if first:
            prof.start()
        cuda = torch.cuda.is_available()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            start = time.perf_counter()
            try:
                result = original(self, data_iterators)
            finally:
                state["wall"] += time.perf_counter() - start
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                state["sites"][f"{Path(w.filename).name}:{w.lineno}"] += 1
        if last:
            prof.stop()
            r = {"iterations": sorted(iterations), "rank": int(os.environ.get("RANK", "0")),
                 **summarise(prof, state["wall"], state["sites"])}
            path = out.with_name(f"{out.stem}.rank{r['rank']}{out.suffix}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(r, indent=1) + "\n")  # now: a run killed later keeps it
            state["written"] = path
            print(f"step_profile rank {r['rank']}: wall {r['wall_ms']:.1f} ms, gpu busy {r['gpu_busy_ms']:.1f} ms, "
                  f"host {r['host_ms_per_thread']}, syncs {r['sync_calls']}, sites {r['sync_sites']} -> {path}",
                  file=sys.stderr)
        return result

    training.StepRunner.run = run
    return state


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit("usage: bench_step_profile.py --iterations N [N ...] --out FILE -- <pretrain_llama.py args>")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON path; one file per rank (.rankN)")
    args = parser.parse_args(argv[:cut])
    chosen = sorted(set(args.iterations))
    if chosen[0] < 1 or chosen != list(range(chosen[0], chosen[-1] + 1)):
        parser.error(f"--iterations {args.iterations}: consecutive training iterations from 1 (the wall time and the "
                     "profile must cover the same steps)")
    state = install(set(chosen), args.out)
    sys.argv = [str(PRETRAIN_SCRIPT), *argv[cut + 1:]]
    sys.path[0] = str(PRETRAIN_SCRIPT.parent)
    try:
        runpy.run_path(str(PRETRAIN_SCRIPT), run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    if "written" not in state:
        print(f"bench_step_profile: the run ended before iteration {chosen[-1]}: nothing profiled (raise "
              "--train-iters, or profile earlier iterations)", file=sys.stderr)
        sys.exit(NOT_REACHED_EXIT)


if __name__ == "__main__":
    main(sys.argv[1:])
