"""Host time vs GPU time of one FP8 linear forward + backward (issue 7: the FP8 linears were host-bound).

    python benchmarks/bench_fp8_host.py --out fp8_host.json           # GPU, ~20 s
    python benchmarks/bench_fp8_host.py --smoke --out /tmp/h.json     # CPU: harness only (bf16)
    python benchmarks/bench_fp8.py --host ...                         # the same, as a section of bench_fp8

Per linear of one LLaMA-1B layer (qkv, proj, fc1, fc2; --tokens, --hidden, --ffn) and mode (bf16
``F.linear``; FP8 delayed scaling with the weight cache, with agoq's direct Triton launches and with
Triton's own dispatch; FP8 current scaling), without the profiler:
  host_ms  perf_counter time to enqueue one forward + backward (--iters back to back, no sync in
           between; the GPU runs behind, so this is the Python + launch cost the training loop pays);
  gpu_ms   GPU time of one forward + backward: the --iters iterations are enqueued behind a
           ``torch.cuda._sleep`` kernel that outlasts their enqueueing, so the GPU runs them back to back
           with no host gaps; CUDA events around them (after the sleep) give the pure GPU time;
  wall_ms  CUDA events around --iters back-to-back iterations (no sleep): max(host, gpu) when they
           overlap, what a training step sees; ``bound`` says which side is longer.
Also host microseconds per call of the primitives the FP8 path is made of (a torch.add for reference,
an allocation, a select, one fused cast through Triton's dispatch and through the direct launcher,
torch._scaled_mm, a bf16 mm, an empty autograd.Function forward + backward), and the number of CPU
operators and kernel launches per FP8 forward + backward (torch.profiler counts, not times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fp8_shapes (also when run in-process)

from fp8_shapes import FFNS, LLAMA_1B, linear_shapes  # noqa: E402

from agoq.ops.fp8_linear import fp8_linear  # noqa: E402
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState  # noqa: E402
from agoq.ops.fp8_weight_cache import FP8WeightCache  # noqa: E402

HOST_MODES = ("bf16", "fp8_delayed", "fp8_delayed_triton_dispatch", "fp8_current")
SLEEP_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep spins clock cycles; >= 2 GHz covers H100 / H200 clocks
SLEEP_MARGIN = 3.0  # the sleep lasts 3x the measured enqueue time (host jitter)
PRIMITIVE_SHAPE = 256  # small tensors: the GPU keeps up, the host cost is what is measured
SMOKE_SHAPE = dict(tokens=64, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def host_us_per_call(fn, iters: int, reps: int, cuda: bool) -> float:
    """Median over ``reps`` of the enqueue time per call of ``iters`` back-to-back calls (microseconds)."""
    times = []
    for _ in range(reps):
        _sync(cuda)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
        _sync(cuda)
    return statistics.median(times)


def _event_ms_per_call(fn, iters: int, sleep_cycles: int = 0) -> float:
    """CUDA-event time per call of ``iters`` back-to-back calls, optionally queued behind a sleep kernel."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gpu_ms_per_call(fn, iters: int, host_ms: float) -> float:
    """GPU time per call with the host out of the way: the calls queue behind a sleep kernel."""
    sleep = int(SLEEP_MARGIN * host_ms * iters * SLEEP_CYCLES_PER_MS) + SLEEP_CYCLES_PER_MS
    return _event_ms_per_call(fn, iters, sleep)


def wall_ms_per_call(fn, iters: int) -> float:
    return _event_ms_per_call(fn, iters)


def _linear_step(mode: str, x, w, g):
    """One forward + backward (fresh .grad each time, as bench_fp8). FP8 modes: a fresh state + cache."""
    if mode == "bf16":
        def step():
            x.grad = w.grad = None
            F.linear(x, w).backward(g)
        return step
    recipe = FP8Recipe(scaling="current" if mode == "fp8_current" else "delayed")
    state = FP8ScalingState(recipe, device=x.device) if recipe.scaling == "delayed" else None
    cache = FP8WeightCache()

    def step():
        x.grad = w.grad = None
        fp8_linear(x, w, state, recipe, weight_cache=cache).backward(g)
    return step


def _with_dispatch(mode: str, fn):
    """Run ``fn`` with Triton's own dispatch for the *_triton_dispatch mode, agoq's direct launches else."""
    if not mode.endswith("_triton_dispatch"):
        return fn
    from agoq.kernels.fastlaunch import set_fast_launch

    def wrapped():
        previous = set_fast_launch(False)
        try:
            return fn()
        finally:
            set_fast_launch(previous)
    return wrapped


def count_ops(fn) -> dict:
    """CPU operators (aten::*), kernel launches (cuLaunchKernel*, cudaLaunchKernel*) and autograd nodes
    of one call, from torch.profiler (counts only: the profiler's times are not the host cost)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # CUDA: runtime API events
        fn()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            continue
        if e.name.startswith(("aten::", "cuLaunchKernel", "cudaLaunchKernel", "autograd::engine::evaluate_function")):
            counts[e.name] = counts.get(e.name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def run_linears(args, cuda: bool) -> dict:
    shape = SMOKE_SHAPE if args.smoke else dict(tokens=args.tokens, hidden=args.hidden, heads=args.heads,
                                                kv_heads=args.kv_heads, head_dim=args.head_dim, ffn=args.ffn)
    modes = ("bf16",) if not cuda else HOST_MODES
    device, dt = ("cuda" if cuda else "cpu"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    dims = {k: shape[k] for k in ("hidden", "heads", "kv_heads", "head_dim")}
    rows, counts = [], {}
    for name, (n, k) in linear_shapes(ffn=shape["ffn"], **dims).items():
        x = torch.randn(shape["tokens"], k, device=device, dtype=dt, generator=gen).requires_grad_()
        w = (torch.randn(n, k, device=device, dtype=dt, generator=gen) / k**0.5).requires_grad_()
        g = torch.randn(shape["tokens"], n, device=device, dtype=dt, generator=gen)
        for mode in modes:
            step = _with_dispatch(mode, _linear_step(mode, x, w, g))
            for _ in range(args.warmup):
                step()
            host_ms = host_us_per_call(step, args.iters, args.reps, cuda) / 1e3
            row = dict(linear=name, mode=mode, out_features=n, in_features=k, host_ms=host_ms)
            if cuda:
                row["gpu_ms"] = gpu_ms_per_call(step, args.iters, host_ms)
                row["wall_ms"] = statistics.median(wall_ms_per_call(step, args.iters) for _ in range(args.reps))
                row["bound"] = "host" if host_ms > row["gpu_ms"] else "gpu"
                if name == "fc1":
                    counts[mode] = count_ops(step)
            rows.append(row)
    return dict(shape=shape, rows=rows, summary=summarize(rows), op_counts_fc1=counts)


def summarize(rows: list[dict]) -> dict:
    """Per mode: the four linears' sums, and the wall-time speed-up over bf16."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        sel = [r for r in rows if r["mode"] == mode]
        out[mode] = {key: sum(r[key] for r in sel) for key in ("host_ms", "gpu_ms", "wall_ms") if key in sel[0]}
    base = out.get("bf16", {})
    for s in out.values():
        if "wall_ms" in s and base.get("wall_ms"):
            s["wall_speedup_vs_bf16"] = base["wall_ms"] / s["wall_ms"]
            s["gpu_speedup_vs_bf16"] = base["gpu_ms"] / s["gpu_ms"]
            s["bound"] = "host" if s["host_ms"] > s["gpu_ms"] else "gpu"
    return out


def run_primitives(args, cuda: bool) -> dict:
    """Host microseconds per call of the FP8 path's building blocks (small tensors)."""
    device, s = ("cuda" if cuda else "cpu"), PRIMITIVE_SHAPE
    a = torch.randn(s, s, device=device, dtype=torch.bfloat16)
    meta = torch.ones(20, device=device)

    class _Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    leaf = a.clone().requires_grad_()
    prims = {"torch.add": lambda: torch.add(a, a), "torch.empty": lambda: torch.empty((s, s), device=device),
             "select meta[0]": lambda: meta[0], "bf16 mm": lambda: torch.mm(a, a),
             "autograd.Function fwd+bwd (identity)": lambda: _Identity.apply(leaf).backward(a)}
    # (leaf.grad accumulates: one add per call, as a parameter gradient would)
    if cuda:
        from agoq.kernels.fastlaunch import set_fast_launch
        from agoq.kernels.fp8_fused import cast_delayed_unchecked

        a8, one = a.to(torch.float8_e4m3fn), torch.ones((), device=device)
        b8 = a8.t()
        ws, state_meta = torch.zeros(2, dtype=torch.int32, device=device), torch.ones(4 + 16, device=device)
        state_meta[4] = 1.0

        def cast():
            cast_delayed_unchecked(a, "e4m3", state_meta, ws, 0, False, True, True, True)

        def cast_dispatch():
            previous = set_fast_launch(False)
            try:
                cast()
            finally:
                set_fast_launch(previous)

        prims.update({"fused cast (direct launch)": cast, "fused cast (Triton dispatch)": cast_dispatch,
                      "torch._scaled_mm": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)})
    out = {}
    for name, fn in prims.items():
        for _ in range(max(args.warmup, 1)):
            fn()
        out[name] = host_us_per_call(fn, 4 * args.iters, args.reps, cuda)
    return out


def run(args) -> dict:
    cuda = not args.smoke
    return {"primitives_host_us": run_primitives(args, cuda), "linears": run_linears(args, cuda)}


def print_host(report: dict) -> None:
    print("\n== host us per call ==")
    for name, us in report["primitives_host_us"].items():
        print(f"  {name:40s} {us:8.1f}")
    print("\n== one forward + backward per linear (ms) ==")
    for r in report["linears"]["rows"]:
        extra = (f" gpu {r['gpu_ms']:7.3f} wall {r['wall_ms']:7.3f} ({r['bound']}-bound)" if "gpu_ms" in r else "")
        print(f"  {r['linear']:5s} {r['mode']:28s} host {r['host_ms']:7.3f}{extra}")
    print(json.dumps({"four_linears": report["linears"]["summary"]}, indent=1))


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}warmup", type=int, default=5)
    p.add_argument(f"--{prefix}iters", type=int, default=20, help="back-to-back iterations per measurement")
    p.add_argument(f"--{prefix}reps", type=int, default=3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=FFNS[-1])
    for key in ("hidden", "heads", "kv_heads", "head_dim"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=LLAMA_1B[key])
    add_arguments(p)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU: the harness on bf16 only")
    args = p.parse_args()
    if args.smoke:
        args.warmup, args.iters, args.reps = 1, 2, 1
    elif not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        p.error("needs a CUDA GPU with FP8 tensor cores (sm_89+); use --smoke on CPU")
    report = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), torch=torch.__version__,
                  device=torch.cuda.get_device_name() if not args.smoke else "cpu", args=vars(args), **run(args))
    print_host(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
