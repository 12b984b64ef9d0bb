"""Optimizer step time and bytes/param: agoq AdamW (fused, split24 + cint8/cuint8) vs torch AdamW.

GPU:  python scripts/bench_optim.py --out docs/benchmarks/optim_h100.json   (~1e9 params, bf16)
CPU:  python scripts/bench_optim.py --smoke --out /tmp/bench_optim.json     (tiny, unfused, no timing claim)

Target (issue 6): agoq fused step <= 0.6x torch.optim.AdamW(fused=True) with fp32 states
(measured 10.7 ms per 1e9 fp32 params on an H100). Tensors: LLaMA-1B-like matrices (2048 x 8192).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agoq.optim import AdamW

CONFIGS = {
    "flash_split24": dict(master="split24", state_formats={"exp_avg": "cint8_b32", "exp_avg_sq": "cuint8_b32"}),
    "flash_split32": dict(master="split32", state_formats={"exp_avg": "cint8_b32", "exp_avg_sq": "cuint8_b32"}),
    "fp8_split24": dict(master="split24", state_formats={"exp_avg": "fp8e4m3_b128", "exp_avg_sq": "fp8e5m2_b128"}),
    "4bit_split24": dict(master="split24", state_formats={"exp_avg": "nf4_b32", "exp_avg_sq": "cuint8_b32"}),
}


def _params(total: int, rows: int, cols: int, dtype, device) -> list[torch.nn.Parameter]:
    count = max(1, total // (rows * cols))
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(rows, cols, generator=gen, device=device).mul_(0.02).to(dtype))
        p.grad = torch.randn(rows, cols, generator=gen, device=device).mul_(1e-3).to(dtype)
        params.append(p)
    return params


def _time(step, device, iters: int) -> float:
    step()  # warm-up: state allocation, compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) * 1e3 / iters


def bench(total: int, rows: int, cols: int, iters: int, device: torch.device, fused: bool) -> dict:
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "numel_target": total, "torch": torch.__version__, "configs": {}}  # fmt: skip
    params = _params(total, rows, cols, torch.float32, device)
    numel = sum(p.numel() for p in params)
    ref = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    ms = _time(ref.step, device, iters)
    results["torch_adamw_fp32"] = dict(ms=ms, ms_per_1e9=ms * 1e9 / numel, bytes_per_param=12 + 4)
    del ref, params
    for name, options in CONFIGS.items():
        params = _params(total, rows, cols, torch.bfloat16, device)
        opt = AdamW(params, lr=1e-4, fused=fused, **options)
        ms = _time(opt.step, device, iters)
        state = opt.state_bytes()
        per_param = (sum(state.values()) + 2 * numel) / numel  # + bf16 grads
        results["configs"][name] = dict(ms=ms, ms_per_1e9=ms * 1e9 / numel, bytes_per_param=per_param,
                                        ratio_vs_torch=ms / results["torch_adamw_fp32"]["ms"])  # fmt: skip
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["numel"] = numel
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the unfused path")
    parser.add_argument("--numel", type=float, default=1e9)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if args.smoke:
        res = bench(total=2 * 64 * 256, rows=64, cols=256, iters=2, device=torch.device("cpu"), fused=False)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the benchmark needs a CUDA GPU; use --smoke on CPU")
        res = bench(int(args.numel), 2048, 8192, args.iters, torch.device("cuda"), fused=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
