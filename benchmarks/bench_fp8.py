"""Benchmark agoq's FP8 linears (fused Triton casts + torch._scaled_mm) at ~1B LLaMA shapes, one GPU.

One command runs all parts and writes one JSON (< 4 min on an H100):

    python benchmarks/bench_fp8.py --profile --out fp8.json

(a) Linear layers alone, forward + backward, hidden 2048, tokens 8192, for each --ffn (default 5632
    and 8192; 32 query / 8 KV heads of 64). ``ms``: median over --reps blocks of --iters iterations
    run back to back between two CUDA events (host and GPU overlap, as in a training step);
    ``ms_synced``: median of single iterations each followed by a synchronize (the host time is
    exposed; the pre-2026-11-23 reports' ``ms``).
    - each linear (qkv, proj, fc1 = [gate | up], fc2) in: bf16 (F.linear), fp8_delayed / fp8_current
      (per-tensor scaling), fp8_rowwise, all three with the FP8 weight cache agoq's Megatron layers use
      (the weight is cast once per weight version: these rows are micro-batches after the first of a
      step), fp8_delayed_uncached (weight cast in every forward and re-cast in every backward), and
      gemm_fp8 (the three FP8 GEMMs on pre-cast operands: the bound that fused casts approach);
    - the MLP block fc1 -> SwiGLU -> fc2 in bf16, FP8 (delayed), FP8 + Smooth-SwiGLU per token and
      per channel unfused (the ops agoq's Megatron MLP ran before issue 27; SavePaths(fuse_smooth_fp8=False))
      and ``..._fused`` (agoq.ops.smooth_swiglu_fp8, what it runs now; ``..._fused_epilogue``: the per-token
      un-smoothing after a tensor-wise GEMM, the op's unsmooth="epilogue");
    - one layer's linear time = qkv + proj + MLP block, per variant, with the speed-up over bf16
      (issue 7 target: >= 1.2x on the linear layers' time);
    - the casts alone (GB/s and the ratio to a bf16 copy of the same tensor), to judge the kernels.
(b) --profile: per linear of the last --ffn and per mode, host vs GPU time, per-phase breakdown (cast x,
    cast w, GEMM fwd, cast g, GEMMs bwd), top CUDA kernels and CPU operators (benchmarks/bench_fp8_profile.py),
    plus the cost of one weight-cache refresh.
(d) --host: per linear and mode (bf16, FP8 delayed with direct Triton launches and with Triton's
    dispatch, FP8 current), host ms vs GPU ms vs wall ms of one forward + backward without the profiler,
    host us per call of the FP8 path's primitives, CPU op / launch counts (benchmarks/bench_fp8_host.py).
(c) Whole training steps of a ~1B LLaMA (16 x 2048, ffn 8192, seq 2048, micro-batch 2 x 4, 30
    iterations) through scripts/pretrain_llama.py: bf16 vs --agoq-fp8 delayed vs --agoq-fp8 delayed
    --agoq-smooth-swiglu per-token (``benchmarks/bench_pretrain.py --suite fp8``; needs megatron-core),
    with tokens/s, peak memory and the loss curves side by side. ``--no-step`` skips it.

    python benchmarks/bench_fp8.py --smoke --out /tmp/fp8.json   # CPU: arguments and harness (bf16 only)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_fp8_host, fp8_shapes (also when run in-process)

from bench_fp8_host import print_host  # noqa: E402
from bench_fp8_host import run as run_host_section  # noqa: E402
from fp8_shapes import FFNS, LLAMA_1B, linear_shapes  # noqa: E402

from agoq.ops.fp8_linear import fp8_linear  # noqa: E402
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState  # noqa: E402
from agoq.ops.fp8_weight_cache import FP8WeightCache  # noqa: E402
from agoq.ops.saved_swiglu import swiglu_reference  # noqa: E402
from agoq.ops.smooth_swiglu import glu_smooth_scale, unsmooth_fc2_output  # noqa: E402

LINEAR_MODES = ("bf16", "fp8_delayed", "fp8_current", "fp8_rowwise", "fp8_delayed_uncached", "gemm_fp8")
PROFILE_MODES = ("bf16", "fp8_delayed", "fp8_current", "fp8_rowwise", "fp8_delayed_uncached")
MLP_MODES = ("bf16", "fp8_delayed", "fp8_delayed_smooth_per_token", "fp8_delayed_smooth_per_channel",
             "fp8_delayed_smooth_per_token_fused", "fp8_delayed_smooth_per_token_fused_epilogue",
             "fp8_delayed_smooth_per_channel_fused")
SMOKE_SHAPE = dict(tokens=64, hidden=64, heads=4, kv_heads=2, head_dim=16, ffns=(128,))
TARGET_SPEEDUP = 1.2  # issue 7: >= 1.2x over bf16 on the linear layers' time
RECIPES = {"fp8_delayed": FP8Recipe(scaling="delayed"), "fp8_current": FP8Recipe(scaling="current"),
           "fp8_rowwise": FP8Recipe(granularity="row"), "fp8_delayed_uncached": FP8Recipe(scaling="delayed")}


def _timer(device: str, reps: int):
    """time_ms(fn, warmup, iters) -> (ms, ms_synced): ``ms`` the median over ``reps`` blocks of ``iters``
    back-to-back calls (CUDA events around each block), ``ms_synced`` the median of single calls each
    followed by a synchronize. On CPU both are perf_counter medians of single calls."""
    def time_ms(fn, warmup: int, iters: int) -> tuple[float, float]:
        for _ in range(warmup):
            fn()
        single = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                single.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                single.append((time.perf_counter() - t0) * 1e3)
        if device != "cuda":
            return statistics.median(single), statistics.median(single)
        blocks = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            blocks.append(start.elapsed_time(end) / iters)
        return statistics.median(blocks), statistics.median(single)
    return time_ms


def _fresh_grads(step, *params):
    """Drop accumulated .grad before each run so every mode times the same work (no accumulation add)."""
    def run():
        for t in params:
            t.grad = None
        step()
    return run


def _fp8(mode: str, device):
    """(recipe, state, weight cache) of an FP8 mode; a fresh delayed-scaling state and weight cache per
    linear (no cache for the _uncached mode)."""
    recipe = RECIPES[mode]
    state = FP8ScalingState(recipe, device=device) if recipe.scaling == "delayed" else None
    return recipe, state, (None if mode.endswith("_uncached") else FP8WeightCache())


def _linear_step(mode: str, x, w, g):
    if mode == "bf16":
        return lambda: F.linear(x, w).backward(g)
    if mode == "gemm_fp8":
        return _gemm_only_step(x, w, g)
    recipe, state, cache = _fp8(mode, x.device)
    return lambda: fp8_linear(x, w, state, recipe, weight_cache=cache).backward(g)


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
    """fc1 -> SwiGLU -> fc2 as agoq's Megatron MLP computes it (agoq.megatron.mlp.AgoqMLP)."""
    if mode.endswith(("_fused", "_fused_epilogue")):
        return _fused_mlp_step(mode, x, w1, w2, g)
    smooth = {"fp8_delayed_smooth_per_token": "per_token", "fp8_delayed_smooth_per_channel": "per_channel",
              "bf16_smooth_per_token": "per_token"}.get(mode)
    if mode.startswith("fp8"):
        (r1, s1, c1), (r2, s2, c2) = _fp8("fp8_delayed", x.device), _fp8("fp8_delayed", x.device)

        def fc1(a):
            return fp8_linear(a, w1, s1, r1, weight_cache=c1)

        def fc2(a, col=None):  # per-channel Smooth-SwiGLU (col) bypasses the cache: W * s changes
            return fp8_linear(a, w2, s2, r2, w_col_scale=col, weight_cache=c2)
    else:
        def fc1(a):
            return F.linear(a, w1)

        def fc2(a, col=None):
            return F.linear(a, w2 if col is None else (w2.float() * col).to(w2.dtype))

    def step():
        h = fc1(x)
        glu = swiglu_reference(h)
        if smooth is None:
            y = fc2(glu)
        else:
            s = glu_smooth_scale(h, glu, smooth)
            z = glu / s.to(glu.dtype)
            y = unsmooth_fc2_output(fc2(z), s) if smooth == "per_token" else fc2(z, s)
        y.backward(g)
    return step


def _fused_mlp_step(mode: str, x, w1, w2, g):
    """fc1 -> the fused Smooth-SwiGLU + FP8 fc2 op (agoq.ops.smooth_swiglu_fp8), as AgoqMLP runs it under
    delayed scaling; ``_epilogue``: the per-token un-smoothing after a tensor-wise GEMM."""
    from agoq.ops import smooth_swiglu_fp8 as op
    from agoq.ops.fp8_weight_cache import FP8WeightCache

    (r1, s1, c1), (r2, s2, _) = _fp8("fp8_delayed", x.device), _fp8("fp8_delayed", x.device)
    cache, per_token = FP8WeightCache(), "per_token" in mode
    unsmooth = "epilogue" if mode.endswith("_epilogue") else "gemm"

    def step():
        h = fp8_linear(x, w1, s1, r1, weight_cache=c1)
        op.smooth_swiglu_fp8_fc2(h, w2, s2, r2, per_token=per_token, weight_cache=cache, unsmooth=unsmooth).backward(g)
    return step


def _cast_rows(tensors: dict, time_ms, args) -> list[dict]:
    """The fused casts alone vs a bf16 copy (bytes: read 2 + write 1 + 1 per element for both layouts;
    current scaling reads the tensor twice)."""
    from agoq.kernels.fp8 import fp8_amax_2d
    from agoq.kernels.fp8_fused import fp8_cast_current_2d
    from agoq.ops.fp8_linear import fp8_cast_ops

    rows = []
    for name, t in tensors.items():
        state = FP8ScalingState(RECIPES["fp8_delayed"], device=t.device)
        ops = fp8_cast_ops(t.device)
        state.cast("x", t, ops, rowmajor=False, transposed=False)  # bootstrap: later calls are delayed

        def delayed(t=t, state=state, ops=ops):
            state.cast("x", t, ops, rowmajor=True, transposed=True)

        def current(t=t):
            fp8_cast_current_2d(t, "e4m3", rowmajor=True, transposed=True)

        for what, fn, nbytes in (("copy_bf16", lambda t=t: t.clone(), 4), ("amax", lambda t=t: fp8_amax_2d(t), 2),
                                 ("cast_delayed_both_layouts", delayed, 4), ("cast_current_both_layouts", current, 6)):
            ms, ms_synced = time_ms(fn, args.warmup, args.iters)
            rows.append(dict(kind="cast", name=name, mode=what, shape=list(t.shape), ms=ms, ms_synced=ms_synced,
                             gb_per_s=nbytes * t.numel() / ms / 1e6))
    for row in rows:
        copy = next(r for r in rows if r["name"] == row["name"] and r["mode"] == "copy_bf16")
        row["bandwidth_vs_copy"] = row["gb_per_s"] / copy["gb_per_s"]
    return rows


def run_linears(args, device: str) -> dict:
    smoke = args.smoke
    shape = SMOKE_SHAPE if smoke else dict(tokens=args.tokens, hidden=args.hidden, heads=args.heads,
                                           kv_heads=args.kv_heads, head_dim=args.head_dim, ffns=tuple(args.ffn))
    linear_modes = ("bf16",) if smoke else LINEAR_MODES
    mlp_modes = ("bf16", "bf16_smooth_per_token") if smoke else MLP_MODES
    time_ms, dt, rows = _timer(device, args.reps), torch.bfloat16, []
    gen = torch.Generator(device=device).manual_seed(0)
    tokens, hidden = shape["tokens"], shape["hidden"]
    timed: dict[tuple[int, int], dict] = {}  # (out, in) -> rows already timed (qkv / proj repeat per ffn)
    for ffn in shape["ffns"]:
        dims = {k: shape[k] for k in ("hidden", "heads", "kv_heads", "head_dim")}
        for name, (n, k) in linear_shapes(ffn=ffn, **dims).items():
            if (n, k) not in timed:
                x = torch.randn(tokens, k, device=device, dtype=dt, generator=gen).requires_grad_()
                w = (torch.randn(n, k, device=device, dtype=dt, generator=gen) / k**0.5).requires_grad_()
                g = torch.randn(tokens, n, device=device, dtype=dt, generator=gen)
                timed[(n, k)] = {mode: time_ms(_fresh_grads(_linear_step(mode, x, w, g), x, w), args.warmup,
                                               args.iters) for mode in linear_modes}
            for mode, (ms, ms_synced) in timed[(n, k)].items():
                rows.append(dict(kind="linear", ffn=ffn, name=name, mode=mode, tokens=tokens, out_features=n,
                                 in_features=k, ms=ms, ms_synced=ms_synced, tflops=3 * 2 * tokens * n * k / ms / 1e9))
        x = torch.randn(tokens, hidden, device=device, dtype=dt, generator=gen).requires_grad_()
        w1 = (torch.randn(2 * ffn, hidden, device=device, dtype=dt, generator=gen) / hidden**0.5).requires_grad_()
        w2 = (torch.randn(hidden, ffn, device=device, dtype=dt, generator=gen) / ffn**0.5).requires_grad_()
        g = torch.randn(tokens, hidden, device=device, dtype=dt, generator=gen)
        for mode in mlp_modes:
            ms, ms_synced = time_ms(_fresh_grads(_mlp_step(mode, x, w1, w2, g), x, w1, w2), args.warmup, args.iters)
            rows.append(dict(kind="mlp", ffn=ffn, name="mlp", mode=mode, tokens=tokens, ms=ms, ms_synced=ms_synced))
        if not smoke:
            h = torch.randn(tokens, 2 * ffn, device=device, dtype=dt, generator=gen)
            rows += [dict(r, ffn=ffn) for r in _cast_rows({"x [tokens, hidden]": x.detach(),
                                                            "fc1 out / grad [tokens, 2 ffn]": h}, time_ms, args)]
    return dict(shape=shape, rows=rows, summary=summarize(rows))


def run_profile(args, device: str, linear_rows: list[dict]) -> dict:
    """(b): per linear of the last --ffn and per mode, host vs GPU time, phases, kernels, CPU ops."""
    from bench_fp8_profile import profile_step

    dt, gen, cuda = torch.bfloat16, torch.Generator(device=device).manual_seed(1), device == "cuda"
    shape = SMOKE_SHAPE if args.smoke else dict(tokens=args.tokens, hidden=args.hidden, heads=args.heads,
                                                kv_heads=args.kv_heads, head_dim=args.head_dim, ffns=args.ffn)
    dims = {key: shape[key] for key in ("hidden", "heads", "kv_heads", "head_dim")}
    ffn, tokens, out = shape["ffns"][-1], shape["tokens"], {}
    profile_modes = PROFILE_MODES if cuda else ("bf16",)  # the FP8 linear needs an FP8 GPU
    for name, (n, k) in linear_shapes(ffn=ffn, **dims).items():
        x = torch.randn(tokens, k, device=device, dtype=dt, generator=gen).requires_grad_()
        w = (torch.randn(n, k, device=device, dtype=dt, generator=gen) / k**0.5).requires_grad_()
        g = torch.randn(tokens, n, device=device, dtype=dt, generator=gen)
        modes = {}
        for mode in profile_modes:
            modes[mode] = profile_step(_fresh_grads(_linear_step(mode, x, w, g), x, w), args.warmup,
                                       args.profile_iters, cuda)
            wall = [r for r in linear_rows if r["kind"] == "linear" and r["ffn"] == ffn and r["name"] == name
                    and r["mode"] == mode]
            modes[mode]["wall_ms"] = wall[0]["ms"] if wall else None
        out[f"{name} [{tokens} x {k}] @ [{n} x {k}]^T"] = modes
        if not cuda:
            continue
        recipe, state, cache = _fp8("fp8_delayed", x.device)
        fp8_linear(x, w, state, recipe, weight_cache=cache)  # bootstrap the w slot

        def refresh(cache=cache, state=state, recipe=recipe, x=x, w=w):
            cache.clear()
            fp8_linear(x.detach(), w, state, recipe, weight_cache=cache)  # forward only: x cast + w cast + GEMM

        modes["weight_refresh_fwd"] = profile_step(refresh, args.warmup, args.profile_iters)
    summary = {}
    for mode in profile_modes:
        per = [m[mode] for m in out.values()]
        summary[mode] = {key: sum(p[key] for p in per) for key in ("host_ms", "gpu_ms")}
        summary[mode]["wall_ms"] = sum(p["wall_ms"] or 0.0 for p in per)
        summary[mode]["bound"] = "host" if summary[mode]["host_ms"] > summary[mode]["gpu_ms"] else "gpu"
    return {"ffn": ffn, "tokens": tokens, "iters": args.profile_iters, "linears": out, "four_linears": summary}


def run_host(args) -> dict:
    """(d): benchmarks/bench_fp8_host.py on this run's shape (the last --ffn) and iteration counts."""
    host_args = argparse.Namespace(**{k: getattr(args, k) for k in ("tokens", "hidden", "heads", "kv_heads",
                                                                      "head_dim", "warmup", "iters", "reps", "smoke")},
                                   ffn=args.ffn[-1])
    return run_host_section(host_args)


def summarize(rows: list[dict]) -> dict:
    """Per ffn: the four linears' sum per mode, and one layer's linear time (qkv + proj + MLP block)
    per variant, each with the speed-up over bf16."""
    out = {}
    for ffn in sorted({r["ffn"] for r in rows}):
        lin = [r for r in rows if r["kind"] == "linear" and r["ffn"] == ffn]
        modes = dict.fromkeys(r["mode"] for r in lin)
        linears = {mode: sum(r["ms"] for r in lin if r["mode"] == mode) for mode in modes}
        attn = {mode: sum(r["ms"] for r in lin if r["mode"] == mode and r["name"] in ("qkv", "proj"))
                for mode in linears}
        mlp = {r["mode"]: r["ms"] for r in rows if r["kind"] == "mlp" and r["ffn"] == ffn}
        layer = {}
        for variant, ms in mlp.items():
            attn_mode = "fp8_delayed" if variant.startswith("fp8") else "bf16"
            if attn_mode in attn:
                layer[variant] = attn[attn_mode] + ms
        synced = {mode: sum(r.get("ms_synced", r["ms"]) for r in lin if r["mode"] == mode) for mode in linears}
        out[str(ffn)] = {"four_linears_ms": _with_speedup(linears), "layer_linears_and_swiglu_ms": _with_speedup(layer),
                         "four_linears_ms_synced": _with_speedup(synced)}
    return out


def _with_speedup(ms_by_mode: dict) -> dict:
    base = ms_by_mode.get("bf16")
    return {mode: dict(ms=ms, speedup_vs_bf16=base / ms if base else None,
                       meets_target=bool(base and base / ms >= TARGET_SPEEDUP))
            for mode, ms in ms_by_mode.items()}


def run_whole_step(args) -> dict:
    """benchmarks/bench_pretrain.py --suite fp8 in a child process (torchrun), summarised with the losses."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_pretrain.py"), "--suite", "fp8", "--out", str(out),
               "--timeout", str(args.step_timeout)] + (["--smoke"] if args.smoke else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
        if not out.exists():
            return {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
                    "error_tail": (proc.stdout + proc.stderr)[-4000:]}
        report = json.loads(out.read_text())
    variants = {v["name"].split("/", 1)[1]: v for v in report["variants"]}
    summary = {s["name"].split("/", 1)[1]: s for s in report["summary"]}
    losses = {name: [r["lm_loss"] for r in v.get("records", [])] for name, v in variants.items()}
    base = summary.get("bf16", {})
    for name, s in summary.items():
        if s.get("failed") or base.get("failed") or not base:
            continue
        s["tokens_per_second_vs_bf16"] = s["tokens_per_second_median"] / base["tokens_per_second_median"]
        diffs = [a - b for a, b in zip(losses[name], losses["bf16"], strict=False)]
        s["loss_max_abs_diff_vs_bf16"] = max((abs(d) for d in diffs), default=None)
        tail = diffs[-10:]
        s["loss_mean_diff_vs_bf16_last10"] = sum(tail) / len(tail) if tail else None
    return {"command": report.get("command"), "environment": report.get("environment"), "summary": summary,
            "losses": losses, "returncode": proc.returncode,
            "failed": [n for n, s in summary.items() if s.get("failed")],
            "error_tails": {n: v["error_tail"] for n, v in variants.items() if "error_tail" in v}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="micro-batch * sequence length (multiple of 16)")
    p.add_argument("--ffn", type=int, nargs="+", default=list(FFNS))
    for key in ("hidden", "heads", "kv_heads", "head_dim"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=LLAMA_1B[key])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=3, help="blocks of --iters back-to-back iterations (GPU timing)")
    p.add_argument("--profile", action="store_true", help="(b): host vs GPU time, phases, kernels, CPU ops")
    p.add_argument("--profile-iters", type=int, default=5)
    p.add_argument("--host", action="store_true",
                   help="(d): host vs GPU ms per linear without the profiler, host us per primitive "
                        "(benchmarks/bench_fp8_host.py; last --ffn)")
    p.add_argument("--no-step", action="store_true", help="skip (b), the whole-step runs")
    p.add_argument("--step-timeout", type=float, default=240, help="seconds per whole-step variant")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: check arguments, run the harness on bf16 only (the whole step only with --step-smoke)")
    p.add_argument("--step-smoke", action="store_true", help="with --smoke: also run the tiny CPU whole-step suite")
    args = p.parse_args()
    if args.tokens % 16 or args.tokens < 16:
        p.error(f"--tokens {args.tokens}: FP8 GEMMs need a positive multiple of 16")
    if args.iters < 1 or args.warmup < 0 or args.reps < 1 or args.profile_iters < 1:
        p.error("--iters, --reps and --profile-iters must be >= 1 and --warmup >= 0")
    if not args.smoke and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        p.error("the FP8 benchmark needs a CUDA GPU with FP8 tensor cores (sm_89+); use --smoke on CPU")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.warmup, args.iters = 1, 2  # the smoke run checks the harness, not speed
    started = time.perf_counter()
    report = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), smoke=args.smoke,
        command=" ".join([Path(sys.executable).name, *sys.argv]), torch=torch.__version__,
        python=platform.python_version(),
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        args=vars(args), target_speedup=TARGET_SPEEDUP, linears=run_linears(args, device),
    )
    report["profile"] = run_profile(args, device, report["linears"]["rows"]) if args.profile else None
    report["host"] = run_host(args) if args.host else None
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to the whole-step runs
    run_step = not args.no_step and (not args.smoke or args.step_smoke)
    report["whole_step"] = run_whole_step(args) if run_step else None
    report["seconds"] = time.perf_counter() - started
    if report["host"]:
        print_host(report["host"])
    if report["profile"]:
        from bench_fp8_profile import print_profile

        print_profile(report["profile"])
        print(json.dumps({"profile_four_linears": report["profile"]["four_linears"]}, indent=1))
    print(json.dumps({"linears": report["linears"]["summary"],
                      "whole_step": report["whole_step"] and report["whole_step"]["summary"]}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["whole_step"] and (report["whole_step"].get("failed") or "error_tail" in report["whole_step"]) \
        else 0


if __name__ == "__main__":
    sys.exit(main())
