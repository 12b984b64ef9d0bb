"""--profile for benchmarks/bench_fp8.py: where the time of one FP8 linear forward + backward goes.

Per linear shape and mode (GPU only):
  host_ms   Python + launch time to enqueue one forward + backward (iterations back to back, no sync in
            between: what the training loop pays on the CPU);
  gpu_ms    the sum of the CUDA kernel times of one forward + backward (torch.profiler);
  wall_ms   one forward + backward back to back (the timing rows' ``ms``): max(host, gpu) when the two
            overlap; ``bound`` says which side is longer;
  phases    per ``agoq.fp8.<phase>`` range (agoq.ops.fp8_linear.phase_range, a range per phase for the
            profile: cast_x, cast_w, gemm_fwd, cast_g, recast_w, recast_x, gemm_dgrad, gemm_wgrad): host and GPU
            microseconds and calls per iteration (cast_w is ~0 with the weight cache except on a refresh; the
            ``weight_refresh`` row times one refresh: the cast of both weight layouts);
  kernels   the top CUDA kernels (calls and microseconds per iteration);
  cpu_ops   the top CPU operators by self time per iteration.
"""

from __future__ import annotations

import time

import torch

PHASE_PREFIX = "agoq.fp8."
TOP_KERNELS = 8
TOP_CPU_OPS = 10
NAME_CHARS = 90


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _host_ms(fn, iters: int, cuda: bool) -> float:
    _sync(cuda)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / iters
    _sync(cuda)
    return host


def _profile(fn, iters: int, cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    _sync(cuda)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(iters):
            fn()
        _sync(cuda)
    return prof


def _is_cuda(event) -> bool:
    from torch.autograd import DeviceType

    return event.device_type == DeviceType.CUDA


def summarize_profile(prof, iters: int) -> dict:
    """Kernels, CPU ops and agoq.fp8 phases of a profile, per iteration (microseconds)."""
    events = list(prof.events())
    kernels: dict[str, list[float]] = {}
    phases: dict[str, dict] = {}
    for e in events:
        name = e.name
        if name.startswith(PHASE_PREFIX):
            ph = phases.setdefault(name[len(PHASE_PREFIX):], {"calls": 0, "host_us": 0.0, "gpu_us": 0.0,
                                                               "gpu_span_us": 0.0})
            if _is_cuda(e):  # the GPU-side span of the range (first kernel start to last kernel end)
                ph["gpu_span_us"] += e.time_range.elapsed_us()
            else:
                ph["calls"] += 1
                ph["host_us"] += e.cpu_time_total
                ph["gpu_us"] += e.device_time_total  # kernels launched inside the range
        elif _is_cuda(e):
            k = kernels.setdefault(name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    gpu_us = sum(v[1] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    cpu = [a for a in prof.key_averages() if a.self_cpu_time_total > 0 and not a.key.startswith(PHASE_PREFIX)]
    cpu.sort(key=lambda a: -a.self_cpu_time_total)
    return {
        "gpu_ms": gpu_us / iters / 1e3,
        "phases": {k: {"calls": v["calls"] / iters, "host_us": v["host_us"] / iters, "gpu_us": v["gpu_us"] / iters,
                       "gpu_span_us": v["gpu_span_us"] / iters} for k, v in phases.items()},
        "kernels": [{"name": n[:NAME_CHARS], "calls": c / iters, "us": us / iters} for n, (c, us) in top],
        "cpu_ops": [{"name": a.key[:NAME_CHARS], "calls": a.count / iters, "self_us": a.self_cpu_time_total / iters}
                    for a in cpu[:TOP_CPU_OPS]],
    }


def profile_step(fn, warmup: int, iters: int, cuda: bool = True) -> dict:
    """host_ms, gpu_ms, phases, kernels and cpu_ops of one callable (see the module docstring; on the
    CPU, --smoke, only the host side)."""
    import unittest.mock

    from agoq.ops import fp8_linear

    for _ in range(warmup):
        fn()
    host = _host_ms(fn, iters, cuda)
    ranges = unittest.mock.patch.object(fp8_linear, "phase_range",
                                        lambda name: torch.profiler.record_function("agoq.fp8." + name))
    with ranges:  # this run only: the linear's phases as profiler ranges
        prof = _profile(fn, iters, cuda)
    out = summarize_profile(prof, iters)
    out["host_ms"] = host
    out["bound"] = "host" if host > out["gpu_ms"] else "gpu"
    return out


def print_profile(profile: dict) -> None:
    """A compact text view of the profile section (stdout of the benchmark)."""
    for shape_name, modes in profile.get("linears", {}).items():
        print(f"\n== profile {shape_name} ==")
        for mode, p in modes.items():
            wall = p.get("wall_ms") or float("nan")
            print(f"  {mode:24s} wall {wall:7.3f} ms  host {p['host_ms']:7.3f} ms  "
                  f"gpu {p['gpu_ms']:7.3f} ms  ({p['bound']}-bound)")
            for ph, v in p["phases"].items():
                print(f"      {ph:12s} host {v['host_us']:8.1f} us  gpu {v['gpu_us']:8.1f} us  x{v['calls']:.0f}")
            for k in p["kernels"][:4]:
                print(f"      kernel {k['us']:8.1f} us x{k['calls']:.0f}  {k['name'][:60]}")
