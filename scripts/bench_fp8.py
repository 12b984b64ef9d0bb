"""Micro-benchmark: the linear layers of one LLaMA-1B transformer layer, bf16 vs agoq's FP8 linear.

Shapes (Llama-3.2-1B: hidden 2048, FFN 8192, 32 query / 8 KV heads of 64, 16 layers): QKV
[3072, 2048], attention out-proj [2048, 2048], fc1 [2 * 8192, 2048] (gate | up fused), fc2
[2048, 8192]; tokens = micro-batch * sequence (default 4 * 2048). Each row times forward + backward
(median over --iters after --warmup, CUDA events) of one linear for one mode:

  bf16              F.linear (cuBLAS bf16)
  fp8_tensor        fp8_linear, per-tensor current scaling
  fp8_tensor_delayed  fp8_linear, per-tensor delayed scaling (amax history 16)
  fp8_row           fp8_linear, row-wise current scaling
  gemm_fp8_tensor   the three torch._scaled_mm calls only, operands pre-cast (the bound casts approach)

plus the MLP block fc1 -> SwiGLU -> fc2 in bf16, FP8, and FP8 with Smooth-SwiGLU (per token / per
channel), and the sums over one layer's linears with the speed-up over bf16 (issue 7 target: >= 1.2x
on the linear layers' time). ``--compile`` also times each FP8 step under torch.compile (fuses the
plain-PyTorch casts); a compile failure is recorded in the JSON, not hidden.

    python scripts/bench_fp8.py --out docs/benchmarks/fp8.json [--tokens 8192] [--compile]
    python scripts/bench_fp8.py --smoke --out /tmp/fp8.json     # CPU: arguments, plan, harness (bf16 only)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from agoq.ops.fp8_linear import fp8_linear
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.smooth_swiglu import fold_channel_scale, smooth_swiglu, unsmooth_fc2_output

LLAMA_1B = dict(hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64, layers=16)  # Llama-3.2-1B config
LINEAR_MODES = ("bf16", "fp8_tensor", "fp8_tensor_delayed", "fp8_row", "gemm_fp8_tensor")
MLP_MODES = ("bf16", "fp8", "fp8_smooth_per_token", "fp8_smooth_per_channel")
SMOKE_SHAPE = dict(tokens=64, hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16)
TARGET_SPEEDUP = 1.2  # issue 7


def linear_shapes(hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of one layer's linears."""
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "proj": (hidden, heads * head_dim),
            "fc1": (2 * ffn, hidden), "fc2": (hidden, ffn)}


def _recipe(mode: str) -> FP8Recipe:
    return {"fp8_tensor": FP8Recipe(), "fp8_tensor_delayed": FP8Recipe(scaling="delayed"),
            "fp8_row": FP8Recipe(granularity="row")}[mode]


def _timer(device: str):
    """Returns time_ms(fn, warmup, iters) -> median ms (CUDA events on GPU, perf_counter on CPU)."""
    def time_ms(fn, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    return time_ms


def _fresh_grads(step, *params):
    """Drop accumulated .grad before each run so every mode times the same work (no accumulation add)."""
    def run():
        for t in params:
            t.grad = None
        step()
    return run


def _linear_step(mode: str, x, w, g):
    """A closure running forward + backward of one linear in ``mode``."""
    if mode == "bf16":
        return lambda: F.linear(x, w).backward(g)
    if mode == "gemm_fp8_tensor":
        return _gemm_only_step(x, w, g)
    recipe = _recipe(mode)
    state = FP8ScalingState(recipe).to(x.device) if recipe.scaling == "delayed" else None
    return lambda: fp8_linear(x, w, state, recipe).backward(g)


def _gemm_only_step(x, w, g):
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device=x.device)
    x8, w8, g8 = x.detach().to(e4), w.detach().to(e4), g.to(e5)
    w8_cm, x8_cm, g8t = w8.t().contiguous().t(), x8.t().contiguous().t(), g8.t().contiguous()

    def step():
        torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
        torch._scaled_mm(g8, w8_cm, one, one, out_dtype=torch.bfloat16)
        torch._scaled_mm(g8t, x8_cm, one, one, out_dtype=torch.bfloat16)
    return step


def _mlp_step(mode: str, x, w1, w2, g):
    fp8 = mode != "bf16"
    lin = (lambda a, b: fp8_linear(a, b)) if fp8 else F.linear

    def step():
        fc1_out = lin(x, w1)
        if mode.startswith("fp8_smooth"):
            smooth_mode = mode.removeprefix("fp8_smooth_")
            z, s = smooth_swiglu(fc1_out, smooth_mode)
            y = unsmooth_fc2_output(lin(z, w2), s) if smooth_mode == "per_token" else lin(z, fold_channel_scale(w2, s))
        else:
            gate, up = fc1_out.chunk(2, dim=-1)
            y = lin(F.silu(gate) * up, w2)
        y.backward(g)
    return step


def _maybe_compiled(step, compile_: bool, errors: list, name: str):
    if not compile_:
        return None
    try:
        compiled = torch.compile(step)
        compiled()
        return compiled
    except Exception as err:  # noqa: BLE001 - recorded in the report, the eager number stands
        errors.append({"what": name, "error": f"{type(err).__name__}: {err}"[:500]})
        return None


def run(args, device: str) -> dict:
    shape = SMOKE_SHAPE if args.smoke else dict(tokens=args.tokens, hidden=args.hidden, ffn=args.ffn,
                                                  heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    linear_modes = ("bf16",) if args.smoke else args.modes
    mlp_modes = ("bf16",) if args.smoke else MLP_MODES
    time_ms, dt, rows, errors = _timer(device), torch.bfloat16, [], []
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = shape["tokens"]
    for name, (n, k) in linear_shapes(**{k: v for k, v in shape.items() if k != "tokens"}).items():
        x = torch.randn(tokens, k, device=device, dtype=dt, generator=gen).requires_grad_()
        w = (torch.randn(n, k, device=device, dtype=dt, generator=gen) / k**0.5).requires_grad_()
        g = torch.randn(tokens, n, device=device, dtype=dt, generator=gen)
        for mode in linear_modes:
            step = _fresh_grads(_linear_step(mode, x, w, g), x, w)
            row = dict(kind="linear", name=name, mode=mode, tokens=tokens, out_features=n, in_features=k,
                       ms=time_ms(step, args.warmup, args.iters), tflops=None)
            row["tflops"] = 3 * 2 * tokens * n * k / row["ms"] / 1e9
            compiled = _maybe_compiled(step, args.compile and mode.startswith("fp8"), errors, f"{name}/{mode}")
            row["ms_compiled"] = time_ms(compiled, args.warmup, args.iters) if compiled else None
            rows.append(row)
    x = torch.randn(tokens, shape["hidden"], device=device, dtype=dt, generator=gen).requires_grad_()
    w1 = (torch.randn(2 * shape["ffn"], shape["hidden"], device=device, dtype=dt, generator=gen)
          / shape["hidden"] ** 0.5).requires_grad_()
    w2 = (torch.randn(shape["hidden"], shape["ffn"], device=device, dtype=dt, generator=gen)
          / shape["ffn"] ** 0.5).requires_grad_()
    g = torch.randn(tokens, shape["hidden"], device=device, dtype=dt, generator=gen)
    for mode in mlp_modes:
        step = _fresh_grads(_mlp_step(mode, x, w1, w2, g), x, w1, w2)
        compiled = _maybe_compiled(step, args.compile and mode != "bf16", errors, f"mlp/{mode}")
        rows.append(dict(kind="mlp", name="mlp", mode=mode, tokens=tokens, ms=time_ms(step, args.warmup, args.iters),
                         ms_compiled=time_ms(compiled, args.warmup, args.iters) if compiled else None))
    return dict(shape=shape, rows=rows, summary=summarize(rows), compile_errors=errors)


def summarize(rows: list[dict]) -> dict:
    """Per mode: the sum of one layer's four linears (fwd + bwd) and the speed-up over bf16."""
    out = {}
    for mode in {r["mode"] for r in rows if r["kind"] == "linear"}:
        sel = [r for r in rows if r["kind"] == "linear" and r["mode"] == mode]
        out[mode] = dict(layer_linear_ms=sum(r["ms"] for r in sel),
                         layer_linear_ms_compiled=(sum(r["ms_compiled"] for r in sel)
                                                   if all(r["ms_compiled"] for r in sel) else None))
    base = out.get("bf16", {}).get("layer_linear_ms")
    for entry in out.values():
        entry["speedup_vs_bf16"] = base / entry["layer_linear_ms"] if base else None
        c = entry["layer_linear_ms_compiled"]
        entry["speedup_vs_bf16_compiled"] = base / c if base and c else None
        entry["meets_target"] = bool(entry["speedup_vs_bf16"] and entry["speedup_vs_bf16"] >= TARGET_SPEEDUP)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="micro-batch * sequence length (multiple of 16)")
    for key in ("hidden", "ffn", "heads", "kv_heads", "head_dim"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=LLAMA_1B[key])
    p.add_argument("--modes", nargs="+", default=list(LINEAR_MODES), choices=LINEAR_MODES)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="also time FP8 steps under torch.compile")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--smoke", action="store_true", help="CPU: check arguments, run the harness on bf16 only")
    args = p.parse_args()
    if args.tokens % 16 or args.tokens < 16:
        p.error(f"--tokens {args.tokens}: FP8 GEMMs need a positive multiple of 16")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if not args.smoke and not torch.cuda.is_available():
        p.error("the FP8 benchmark needs a CUDA GPU (sm_89+); use --smoke on CPU")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.warmup, args.iters = 1, 2  # the smoke run checks the harness, not speed
    report = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), smoke=args.smoke,
        torch=torch.__version__, python=platform.python_version(),
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        args=vars(args), target_speedup=TARGET_SPEEDUP, **run(args, device),
    )
    text = json.dumps(report, indent=2)
    print(json.dumps(report["summary"], indent=2))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
