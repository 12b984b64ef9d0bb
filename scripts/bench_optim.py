"""Optimizer step time, host time and memory: agoq fused optimizers vs torch.optim.AdamW(fused=True).

GPU:  python scripts/bench_optim.py --out $OUT/bench_optim.json     (~1e9 params, < 4 min on an H100)
CPU:  python scripts/bench_optim.py --smoke --out /tmp/bench_optim.json   (tiny, unfused, no timing claim)

Target (issue 6): the agoq fused AdamW step (split24 master, cint8/cuint8 moments, bf16 params and
grads) <= 0.6x torch.optim.AdamW(fused=True) with fp32 params, grads and states. Arithmetic: the lean
step moves ~12.25 bytes/param (read 2 p + 1 rho + 2 g + 2 x 1.0625 states, write all but g) against
fused AdamW's 28 (read p, g, m, v; write p, m, v in fp32): 0.44x at equal bandwidth.

Tensors are LLaMA-1B-like matrices (2048 x 8192 = 16.8M elements). Per config the JSON holds
  ms, ms_per_1e9          device time per step (CUDA events, mean over --iters after one warm-up step)
  host_ms                 Python + launch time per step (a host-bound step shows host_ms ~ ms)
  bytes_per_param         accounted: params + master + states (opt.state_bytes()) + grads
  peak_bytes, peak_bytes_per_param, steady_bytes
                          torch.cuda.max_memory_allocated over the config (params, grads, states and
                          the step's transients; the allocator is emptied between configs), and what
                          stays allocated after the steps
  ratio_vs_torch          ms / torch fused AdamW's ms (the target is <= 0.6 for flash_split24)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from agoq.optim import AdamW, Lion

TARGET_RATIO = 0.6  # issue 6
FLASH = {"exp_avg": "cint8_b32", "exp_avg_sq": "cuint8_b32"}
# name -> (optimizer class, options); every AdamW shares lr / betas / weight decay with torch's
CONFIGS = {
    "flash_split24": (AdamW, dict(master="split24", state_formats=FLASH)),
    "flash_split32": (AdamW, dict(master="split32", state_formats=FLASH)),
    "fp8_split24": (AdamW, dict(master="split24", state_formats={"exp_avg": "fp8e4m3_b128",
                                                                 "exp_avg_sq": "fp8e5m2_b128"})),
    "4bit_split24": (AdamW, dict(master="split24", state_formats={"exp_avg": "nf4_b32", "exp_avg_sq": "cuint8_b32"})),
    "bf16_states_split24": (AdamW, dict(master="split24", state_formats={"exp_avg": "bf16", "exp_avg_sq": "bf16"})),
    "fp32_states_fp32_master": (AdamW, dict(master="fp32", state_formats={"exp_avg": "fp32", "exp_avg_sq": "fp32"})),
    "lion_flash_split24": (Lion, dict(master="split24", state_formats={"exp_avg": "cint8_b32"})),
}  # fmt: skip
HP = dict(lr=1e-4, weight_decay=0.1)


def _params(total: int, rows: int, cols: int, dtype, device) -> list[torch.nn.Parameter]:
    count = max(1, total // (rows * cols))
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(rows, cols, generator=gen, device=device).mul_(0.02).to(dtype))
        p.grad = torch.randn(rows, cols, generator=gen, device=device).mul_(1e-3).to(dtype)
        params.append(p)
    return params


def _time(step, device, iters: int) -> tuple[float, float]:
    """(device ms per step, host ms per step); one untimed warm-up step (state allocation, compile)."""
    step()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        ms = (time.perf_counter() - t0) * 1e3 / iters
        return ms, ms
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host


def _reset(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _memory(device, base: int, numel: int) -> dict:
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) - base
    steady = torch.cuda.memory_allocated(device) - base
    return dict(peak_bytes=peak, peak_bytes_per_param=peak / numel, steady_bytes=steady,
                steady_bytes_per_param=steady / numel)  # fmt: skip


def _finite(params) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params)


def bench(total: int, rows: int, cols: int, iters: int, device: torch.device, fused: bool, only=None) -> dict:
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
               "numel_target": total, "tensor_shape": [rows, cols], "iters": iters, "torch": torch.__version__,
               "target_ratio": TARGET_RATIO, "configs": {}}  # fmt: skip
    if fused:
        import triton

        results["triton"] = triton.__version__
    base = _reset(device)
    params = _params(total, rows, cols, torch.float32, device)
    numel = sum(p.numel() for p in params)
    results["numel"] = numel
    ref = torch.optim.AdamW(params, fused=device.type == "cuda", **HP)
    ms, host = _time(ref.step, device, iters)
    results["torch_adamw_fp32"] = dict(ms=ms, ms_per_1e9=ms * 1e9 / numel, host_ms=host, bytes_per_param=16.0,
                                       finite=_finite(params), **_memory(device, base, numel))  # fmt: skip
    del ref, params
    for name, (cls, options) in CONFIGS.items():
        if only and name not in only:
            continue
        base = _reset(device)
        params = _params(total, rows, cols, torch.bfloat16, device)
        opt = cls(params, fused=fused, **HP, **options)
        ms, host = _time(opt.step, device, iters)
        state = opt.state_bytes()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
        results["configs"][name] = dict(
            optimizer=cls.__name__, options=options, ms=ms, ms_per_1e9=ms * 1e9 / numel, host_ms=host,
            ratio_vs_torch=ms / results["torch_adamw_fp32"]["ms"],
            bytes_per_param=(sum(state.values()) + grads) / numel,
            state_bytes={k: v / numel for k, v in state.items()}, finite=_finite(params),
            **_memory(device, base, numel),
        )  # fmt: skip
        print(f"{name:26s} {ms:8.3f} ms  host {host:7.3f} ms  x{ms / results['torch_adamw_fp32']['ms']:.3f}",
              flush=True)  # fmt: skip
        del opt, params
    flash = results["configs"].get("flash_split24")
    if flash and device.type == "cuda":
        results["meets_target"] = flash["ratio_vs_torch"] <= TARGET_RATIO
    return results


SWEEP_ELEMS = (512, 1024, 2048, 4096, 8192)
SWEEP_WARPS = (2, 4, 8)


def launch_sweep(total: int, rows: int, cols: int, iters: int, names: list[str]) -> dict:
    """Step time of agoq.kernels.optim per (ELEMS_PER_PROGRAM, NUM_WARPS); results must not depend on
    the launch shape (the first tensor after one step is compared bit for bit with the default's)."""
    import agoq.kernels.optim as kopt

    device = torch.device("cuda")
    default = (kopt.ELEMS_PER_PROGRAM, kopt.NUM_WARPS)
    out = {"default": list(default), "numel_target": total, "rows": []}
    try:
        for name in names:
            cls, options = CONFIGS[name]
            reference = None
            for elems, warps in [default] + [(e, w) for e in SWEEP_ELEMS for w in SWEEP_WARPS if (e, w) != default]:
                kopt.ELEMS_PER_PROGRAM, kopt.NUM_WARPS = elems, warps
                _reset(device)
                params = _params(total, rows, cols, torch.bfloat16, device)
                opt = cls(params, fused=True, **HP, **options)
                opt.step()
                first = params[0].detach().clone()
                reference = first if reference is None else reference
                ms, host = _time(opt.step, device, iters)
                row = dict(config=name, elems_per_program=elems, num_warps=warps, ms=ms,
                           ms_per_1e9=ms * 1e9 / sum(q.numel() for q in params), host_ms=host,
                           same_result_as_default=bool(torch.equal(first, reference)))  # fmt: skip
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
                del opt, params
    finally:
        kopt.ELEMS_PER_PROGRAM, kopt.NUM_WARPS = default
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_optim.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the unfused path")
    parser.add_argument("--numel", type=float, default=1e9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", nargs="*", choices=sorted(CONFIGS), help="subset (default: all)")
    parser.add_argument("--launch-sweep", action="store_true",
                        help="time the fused kernels over launch shapes instead (GPU; --configs picks which)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="GPU: print the N top functions (tottime) of 5 flash_split24 steps under cProfile")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.cprofile:
        import cProfile
        import pstats

        params = _params(int(args.numel), 2048, 8192, torch.bfloat16, torch.device("cuda"))
        cls, options = CONFIGS["flash_split24"]
        opt = cls(params, fused=True, **HP, **options)
        opt.step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            opt.step()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- cProfile: 5 flash_split24 steps over {len(params)} tensors")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
        return
    if args.launch_sweep:
        res = launch_sweep(int(args.numel), 2048, 8192, args.iters, args.configs or ["flash_split24"])
        res["wall_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    if args.smoke:
        res = bench(2 * 64 * 256, 64, 256, 2, torch.device("cpu"), fused=False, only=args.configs)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the benchmark needs a CUDA GPU; use --smoke on CPU")
        res = bench(int(args.numel), 2048, 8192, args.iters, torch.device("cuda"), fused=True, only=args.configs)
    res["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
