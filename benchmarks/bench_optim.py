"""Optimizer step time, host time and memory: agoq fused optimizers vs torch.optim.AdamW(fused=True).

GPU:  python benchmarks/bench_optim.py --out $OUT/bench_optim.json     (~1e9 params, < 4 min on an H100)
CPU:  python benchmarks/bench_optim.py --smoke --out /tmp/bench_optim.json   (tiny, unfused, no timing claim)

Target (issue 6): the agoq fused AdamW step (split24 master, cint8/cuint8 moments, bf16 params and
grads) <= 0.6x torch.optim.AdamW(fused=True) with fp32 params, grads and states. Arithmetic: the lean
step moves ~12.25 bytes/param (read 2 p + 1 rho + 2 g + 2 x 1.0625 states, write all but g) against
fused AdamW's 28 (read p, g, m, v; write p, m, v in fp32): 0.44x at equal bandwidth.

Two cases (--cases), each ~--numel params:
  matrices   2048 x 8192 matrices (16.8M elements each, ~60 tensors)
  llama1b    the real 1B LLaMA shapes as Megatron holds them: 16 layers x (qkv 3072 x 2048, proj 2048 x 2048,
             fc1 16384 x 2048, fc2 2048 x 8192, 2 norms of 2048) + embedding and output 4096 x 2048 + final
             norm (99 tensors); params and grads are views of one flat buffer each (param starts padded to
             64 elements, as Megatron's DDP buffers), decay / no-decay param groups as Megatron's
agoq's steps use the multi-tensor launch (agoq.kernels.optim_multi, the default); flash_split24_per_tensor
is the same optimizer with multi_tensor=False (one launch per tensor) for comparison.
Per config the JSON holds
  ms, ms_per_1e9          step time as training sees it (CUDA events around --iters back-to-back steps after
                          one warm-up step: max(host, device) per step)
  host_ms                 Python + launch time per step (a host-bound step shows host_ms ~ ms)
  device_ms               GPU time per step alone: the steps are queued behind a torch.cuda._sleep long enough
                          for the host to enqueue them all, so host gaps do not count
  ratio_vs_torch, device_ratio_vs_torch   ms / torch's ms, device_ms / torch's device_ms
  bytes_per_param         accounted: params + master + states (opt.state_bytes()) + grads
  peak_bytes, peak_bytes_per_param, steady_bytes
                          torch.cuda.max_memory_allocated over the config (params, grads, states and
                          the step's transients; the allocator is emptied between configs), and what
                          stays allocated after the steps
The target (<= 0.6 for flash_split24 on ratio_vs_torch) is checked per case: meets_target.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
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


LLAMA_LAYERS = 16
LLAMA_LAYER_SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (2048,), (2048,))
LLAMA_EXTRA_SHAPES = ((4096, 2048), (4096, 2048), (2048,))  # embedding, output layer, final norm
MEGATRON_PARAM_ALIGN = 64  # Megatron pads each param's start in its DDP buffer to 64 elements
CASES = ("matrices", "llama1b")


def llama_shapes(scale: int = 1, layers: int = LLAMA_LAYERS) -> list[tuple[int, ...]]:
    """The 1B LLaMA's parameter shapes (CPU smoke run: matrix dims divided by ``scale``, fewer layers)."""
    shapes = [s for _ in range(layers) for s in LLAMA_LAYER_SHAPES] + list(LLAMA_EXTRA_SHAPES)
    return [tuple(d // scale for d in s) if len(s) == 2 else s for s in shapes]


def _flat_params(shapes, dtype, device) -> list[torch.nn.Parameter]:
    """Params and grads as views of one flat buffer each (Megatron's DDP layout: 64-element aligned starts)."""
    starts, at = [], 0
    for s in shapes:
        starts.append(at)
        at += -(-math.prod(s) // MEGATRON_PARAM_ALIGN) * MEGATRON_PARAM_ALIGN
    gen = torch.Generator(device=device).manual_seed(0)
    pbuf = torch.randn(at, generator=gen, device=device).mul_(0.02).to(dtype)
    gbuf = torch.randn(at, generator=gen, device=device).mul_(1e-3).to(dtype)
    params = []
    for s, a in zip(shapes, starts, strict=True):
        n = math.prod(s)
        p = torch.nn.Parameter(pbuf[a : a + n].view(s))
        p.grad = gbuf[a : a + n].view(s)
        params.append(p)
    return params


def _case_params(case: str, total: int, dtype, device, scale: int):
    """(params, param groups) of a case; llama1b has Megatron's decay / no-decay groups."""
    if case == "matrices":
        params = _params(total, 2048 // scale, 8192 // scale, dtype, device)
        return params, [{"params": params}]
    params = _flat_params(llama_shapes(scale, LLAMA_LAYERS if scale == 1 else SMOKE_LLAMA_LAYERS), dtype, device)
    return params, [{"params": [p for p in params if p.ndim >= 2]},
                    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip


def _device_time(step, device, iters: int, host_ms: float) -> float:
    """GPU ms per step with the host out of the way (see the module docstring); the caller has warmed up."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record()
    torch.cuda._sleep(SLEEP_CALIBRATION_CYCLES)
    s1.record()
    torch.cuda.synchronize()
    cycles_per_ms = SLEEP_CALIBRATION_CYCLES / max(s0.elapsed_time(s1), 1e-3)
    torch.cuda._sleep(int(cycles_per_ms * (2.0 * host_ms * iters + SLEEP_MARGIN_MS)))
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


SLEEP_CALIBRATION_CYCLES = 20_000_000
SLEEP_MARGIN_MS = 5.0
# CUDA queues ~1024 launches per stream before the host blocks; the device-time loop stays below it
MAX_QUEUED_LAUNCHES = 900
# torch fused AdamW: multi_tensor_apply launches one kernel per ~320 chunks of 65536 elements (~50 per 1e9 params)
TORCH_LAUNCHES_PER_STEP = 64


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


def _run_config(key, make_opt, params, device, iters, launches_per_step, torch_ref) -> dict:
    numel = sum(p.numel() for p in params)
    opt = make_opt()
    ms, host = _time(opt.step, device, iters)
    dev_iters = max(2, min(iters, MAX_QUEUED_LAUNCHES // max(1, launches_per_step)))
    device_ms = _device_time(opt.step, device, dev_iters, host)
    row = dict(ms=ms, ms_per_1e9=ms * 1e9 / numel, host_ms=host, device_ms=device_ms, finite=_finite(params))
    if torch_ref is not None:
        row["ratio_vs_torch"] = ms / torch_ref["ms"]
        row["device_ratio_vs_torch"] = device_ms / torch_ref["device_ms"] if device.type == "cuda" else None
    if hasattr(opt, "state_bytes"):
        state = opt.state_bytes()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
        row.update(bytes_per_param=(sum(state.values()) + grads) / numel,
                   state_bytes={k: v / numel for k, v in state.items()},
                   launches_per_step=launches_per_step)  # fmt: skip
    print(f"{key:34s} {ms:8.3f} ms  host {host:7.3f}  device {device_ms or 0:7.3f} ms"
          + (f"  x{row['ratio_vs_torch']:.3f}" if "ratio_vs_torch" in row else ""), flush=True)  # fmt: skip
    del opt
    return row


def bench_case(case: str, total: int, iters: int, device, fused: bool, only=None, scale: int = 1) -> dict:
    out = {"configs": {}}
    base = _reset(device)
    params, _ = _case_params(case, total, torch.float32, device, scale)
    numel = sum(p.numel() for p in params)
    out.update(numel=numel, num_tensors=len(params))
    if case == "matrices":
        out["tensor_shape"] = list(params[0].shape)
    make = functools.partial(torch.optim.AdamW, params, fused=device.type == "cuda", **HP)
    torch_row = _run_config(f"{case}/torch_adamw_fp32", make, params, device, iters, TORCH_LAUNCHES_PER_STEP, None)
    torch_row.update(bytes_per_param=16.0, **_memory(device, base, numel))
    out["torch_adamw_fp32"] = torch_row
    del params, make
    variants = [(n, n, True) for n in CONFIGS] + [("flash_split24_per_tensor", "flash_split24", False)]
    for key, name, multi in variants:
        if only and name not in only:
            continue
        cls, options = CONFIGS[name]
        base = _reset(device)
        params, groups = _case_params(case, total, torch.bfloat16, device, scale)
        buckets = 2 * len(groups)  # matrices + small tensors per group, at most
        make = functools.partial(cls, groups, fused=fused, multi_tensor=multi, **HP, **options)
        launches = buckets if multi else len(params)
        row = _run_config(f"{case}/{key}", make, params, device, iters, launches, torch_row)
        row.update(optimizer=cls.__name__, options=options, multi_tensor=multi and fused,
                   **_memory(device, base, numel))  # fmt: skip
        out["configs"][key] = row
        del params, groups, make
    flash = out["configs"].get("flash_split24")
    if flash and device.type == "cuda":
        out["meets_target"] = flash["ratio_vs_torch"] <= TARGET_RATIO
    return out


SMOKE_SCALE = {"matrices": 32, "llama1b": 32}  # --smoke: matrix dims divided by this (CPU, reference path)
SMOKE_LLAMA_LAYERS = 2


def bench(total: int, iters: int, device: torch.device, fused: bool, only=None, cases=CASES, smoke=False) -> dict:
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
               "numel_target": total, "iters": iters, "torch": torch.__version__, "target_ratio": TARGET_RATIO,
               "cases": {}}  # fmt: skip
    if fused:
        import triton

        results["triton"] = triton.__version__
    for case in cases:
        results["cases"][case] = bench_case(case, total, iters, device, fused, only, SMOKE_SCALE[case] if smoke else 1)
    return results


SWEEP_ELEMS = (256, 512, 1024, 2048)
SWEEP_WARPS = (1, 2, 4, 8)
SWEEP_MAXNREG = (None, 64, 72, 80, 96)  # None: ptxas chooses (~96 for FlashAdamW at 2 warps)


def launch_sweep(total: int, rows: int, cols: int, iters: int, names: list[str], small: bool = False) -> dict:
    """Step time of the fused multi-tensor step per (ELEMS_PER_PROGRAM, num_warps, register cap); results
    must not depend on the launch shape (the first tensor after one step is compared bit for bit with the
    default's). The first row of each config is the shipped default (agoq.kernels.optim_multi.launch_shape)."""
    import agoq.kernels.optim as kopt
    import agoq.kernels.optim_multi as kmulti

    device = torch.device("cuda")
    default = (kopt.ELEMS_PER_PROGRAM, None)  # None: the per-format default shape
    shapes = [(e, (w, None)) for e in SWEEP_ELEMS for w in SWEEP_WARPS]
    shapes += [(e, (w, r)) for e in (256, 512, 1024) for w in (1, 2, 4) for r in SWEEP_MAXNREG if r is not None]
    if small:  # per-format check at the default element count: warps x register caps
        shapes = [(kopt.ELEMS_PER_PROGRAM, (w, r)) for w in (1, 2, 4) for r in (None, 64, 80)]
    out = {"default_elems_per_program": default[0], "numel_target": total, "rows": []}
    try:
        for name in names:
            cls, options = CONFIGS[name]
            reference = None
            for elems, override in [default] + [s for s in dict.fromkeys(shapes) if s != default]:
                kopt.ELEMS_PER_PROGRAM, kmulti.LAUNCH_OVERRIDE = elems, override
                _reset(device)
                params = _params(total, rows, cols, torch.bfloat16, device)
                opt = cls(params, fused=True, **HP, **options)
                opt.step()
                first = params[0].detach().clone()
                reference = first if reference is None else reference
                ms, host = _time(opt.step, device, iters)
                warps, maxnreg = override or ("default", "default")
                row = dict(config=name, elems_per_program=elems, num_warps=warps, maxnreg=maxnreg, ms=ms,
                           ms_per_1e9=ms * 1e9 / sum(q.numel() for q in params), host_ms=host,
                           same_result_as_default=bool(torch.equal(first, reference)))  # fmt: skip
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
                del opt, params
    finally:
        kopt.ELEMS_PER_PROGRAM, kmulti.LAUNCH_OVERRIDE = default
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_optim.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the unfused path")
    parser.add_argument("--numel", type=float, default=1e9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", nargs="*", choices=sorted(CONFIGS), help="subset (default: all)")
    parser.add_argument("--cases", nargs="*", choices=CASES, default=list(CASES), help="parameter sets (default: all)")
    parser.add_argument(
        "--launch-sweep",
        action="store_true",
        help="time the fused kernels over launch shapes instead (GPU; --configs picks which)",
    )
    parser.add_argument("--sweep-small", action="store_true",
                        help="--launch-sweep over warps x register caps only, at the default elements per program")
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="GPU: print the N top functions (tottime) of 5 llama1b flash_split24 steps under cProfile",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.cprofile:
        import cProfile
        import pstats

        params, groups = _case_params("llama1b", int(args.numel), torch.bfloat16, torch.device("cuda"), 1)
        cls, options = CONFIGS["flash_split24"]
        opt = cls(groups, fused=True, **HP, **options)
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
        res = launch_sweep(int(args.numel), 2048, 8192, args.iters, args.configs or ["flash_split24"],
                           small=args.sweep_small)
        res["wall_s"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    if args.smoke:  # two 64 x 256 matrices; 2 llama layers / 32
        res = bench(2 * 64 * 256, 2, torch.device("cpu"), fused=False, only=args.configs, cases=args.cases, smoke=True)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the benchmark needs a CUDA GPU; use --smoke on CPU")
        res = bench(int(args.numel), args.iters, torch.device("cuda"), fused=True, only=args.configs, cases=args.cases)
    res["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
