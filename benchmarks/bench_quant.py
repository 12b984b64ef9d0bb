"""Benchmark agoq's Triton quantize / dequantize against a device-to-device copy (one GPU).

For every format and tensor size (bf16 input, Gaussian data) it times quantize (bf16 -> codes +
scales) and dequantize (-> bf16) with triton.testing.do_bench (median, L2 flushed between runs), and
a plain ``dst.copy_(src)`` of the same bf16 tensor in the same run. Reported per format and size:

  bf16_gbps   bf16 bytes (quantize input / dequantize output) per second
  moved_gbps  all bytes read + written (bf16 side + codes + scales) per second
  vs_copy     moved_gbps / copy moved_gbps (the copy reads and writes the bf16 tensor once)

Target (issue 3): vs_copy >= 0.85 for every format at >= 256 MiB. Also SQNR per format on
Gaussian and heavy-tailed data, and (--check) kernel-vs-reference code equality at a Llama shape.

    python benchmarks/bench_quant.py --check --variants --out quant.json   # the full H100 run
    python benchmarks/bench_quant.py --variants-only --out variants.json
    python benchmarks/bench_quant.py --configs-from variants.json --out quant.json

--variants times quantize of the tile-kernel formats (VARIANT_FORMATS) under every launch shape of
VARIANT_CONFIGS (elements per program, warps, tile parts) at VARIANT_MIB, checks that each shape's
codes and scales equal the committed shape's (codes never depend on the launch shape), and prints the
shape to commit per QUANT_CONFIGS family (agoq/kernels/_launch.py): the best worst case over the
family's formats and both sizes. --configs-from applies such a choice before the normal run.
--smoke runs every code path on CPU under TRITON_INTERPRET=1 with tiny tensors (wall-clock "timings").
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch
import triton

from agoq.formats import parse_format
from agoq.kernels import _launch
from agoq.kernels.quant import dequantize, quantize, quantize_with_config
from agoq.ref.quant import ref_dequantize, ref_quantize
from agoq.testing.numerics import gaussian_floor_db, heavy_tailed_floor_db, make_test_data, sqnr_db

DEFAULT_FORMATS = [
    "int8_b128", "int8_b256", "int6_b64", "int5_b64", "int4_b64", "int2_b64", "nf4_b64", "fp8e4m3_b128",
    "fp8e5m2_b128", "cint8_b32", "cuint8_b32", "int8_b128_sp2", "int4_b64_s16", "int8_b256_sr",
]  # fmt: skip
# Formats on the tile kernel (_quantize_fwd_kernel); int8-nearest and fp8 use the byte kernel.
VARIANT_FORMATS = [
    "int6_b64", "int5_b64", "int4_b64", "int2_b64", "nf4_b64", "cint8_b32", "cuint8_b32", "int4_b64_s16",
    "int8_b256_sr",
]  # fmt: skip
VARIANT_CONFIGS = [
    _launch.QuantConfig(elems, warps, split)
    for split in (1, 2, 4)
    for elems, warps in ((2048, 4), (4096, 4), (8192, 4), (4096, 8), (8192, 8), (16384, 8))
]
VARIANT_MIB = (256, 1024)
VARIANT_CHECK_NUMEL = 1 << 24
SQNR_NUMEL = 1 << 24  # 16M elements: SQNR estimate std << 0.1 dB
TARGET_VS_COPY = 0.85  # issue 3
TARGET_MIN_MIB = 256
SMOKE_MIB = 1 / 64  # --smoke: 16 KiB tensors on CPU


def _family(name: str) -> tuple[str, int, bool]:
    fmt = parse_format(name)
    return (fmt.kind, fmt.bits, fmt.rounding == "stochastic")


class Bench:
    """Timing and data on the benchmark device (CUDA; CPU + Triton interpreter for --smoke)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"

    def time_ms(self, fn, rep: int = 200) -> float:
        if self.smoke:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))

    def numel(self, size_mib: float) -> int:
        return int(size_mib * (1 << 20)) // 2

    def gaussian(self, numel: int) -> torch.Tensor:
        if self.smoke:
            return make_test_data("gaussian", numel, seed=0, dtype=torch.bfloat16)
        return torch.randn(numel, device="cuda", dtype=torch.bfloat16)

    def copy_moved_gbps(self, x: torch.Tensor) -> tuple[float, float]:
        dst = torch.empty_like(x)
        ms = self.time_ms(lambda: dst.copy_(x))
        return ms, 2 * x.nbytes / ms / 1e6


def bench_size(b: Bench, size_mib: float, names: list[str]) -> list[dict]:
    x = b.gaussian(b.numel(size_mib))
    copy_ms, copy_moved = b.copy_moved_gbps(x)
    rows = [dict(size_mib=size_mib, format="copy", op="copy", ms=copy_ms, bf16_gbps=x.nbytes / copy_ms / 1e6,
                 moved_gbps=copy_moved, vs_copy=1.0)]  # fmt: skip
    for name in names:
        fmt = parse_format(name)
        xin = x.abs() if fmt.kind == "cuint" else x
        q = quantize(xin, fmt, seed=1)
        moved = xin.nbytes + q.nbytes
        q_ms = b.time_ms(lambda: quantize(xin, fmt, seed=1))  # noqa: B023 (timed before the next loop)
        d_ms = b.time_ms(lambda: dequantize(q, torch.bfloat16))  # noqa: B023
        for op, ms in (("quantize", q_ms), ("dequantize", d_ms)):
            rows.append(dict(size_mib=size_mib, format=name, op=op, ms=ms, bf16_gbps=x.nbytes / ms / 1e6,
                             moved_gbps=moved / ms / 1e6, vs_copy=moved / ms / 1e6 / copy_moved))  # fmt: skip
    return rows


def sqnr_rows(b: Bench, names: list[str], numel: int) -> list[dict]:
    out = []
    dists = (("gaussian", gaussian_floor_db), ("heavy_tailed", heavy_tailed_floor_db))
    data = {dist: make_test_data(dist, numel, seed=0, device=b.device, dtype=torch.bfloat16) for dist, _ in dists}
    for name in names:
        fmt = parse_format(name)
        for dist, floor_fn in dists:
            x = data[dist].abs() if fmt.kind == "cuint" else data[dist]
            y = dequantize(quantize(x, fmt, seed=1), torch.float32)
            try:
                floor = floor_fn(fmt)
            except NotImplementedError:
                floor = None
            out.append(dict(format=name, dist=dist, sqnr_db=sqnr_db(x, y), floor_db=floor))
    return out


def _same_quant(q, r) -> bool:
    """Codes and scales bit-equal (scales compared as bytes: NaN scales of bad blocks included)."""
    return torch.equal(q.codes, r.codes) and torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN == NaN (NaN payloads may differ)."""
    return bool(torch.isclose(a.float(), b.float(), rtol=0, atol=0, equal_nan=True).all())


def check_rows(b: Bench, names: list[str], shape: tuple[int, int]) -> list[dict]:
    """Kernel vs reference at a Llama-sized shape on the GPU: codes, scales and values bit-equal."""
    out = []
    x0 = make_test_data("heavy_tailed", shape[0] * shape[1], seed=2, device=b.device, dtype=torch.bfloat16)
    for name in names:
        fmt = parse_format(name)
        x = (x0.abs() if fmt.kind == "cuint" else x0.clone()).view(*shape)
        x[min(7, shape[0] - 1), :300] = float("nan")
        q, r = quantize(x, fmt, seed=5), ref_quantize(x, fmt, seed=5)
        # fp32 values (exact everywhere); bf16 on GPU only (the interpreter truncates fp32 -> bf16)
        values_equal = _bit_equal(dequantize(q, torch.float32), ref_dequantize(r, torch.float32))
        if not b.smoke:
            values_equal = values_equal and _bit_equal(dequantize(q), ref_dequantize(r))
        out.append(dict(format=name, codes_equal=torch.equal(q.codes, r.codes),
                        scales_equal=_bit_equal(q.scales, r.scales), values_equal=values_equal))  # fmt: skip
    return out


def _warm(name: str) -> str:
    """Compile every kernel one format needs (run in a worker process; fills Triton's disk cache)."""
    fmt = parse_format(name)
    x = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    x = x.abs() if fmt.kind == "cuint" else x
    if name in VARIANT_FORMATS:
        for cfg in VARIANT_CONFIGS:
            quantize_with_config(x, fmt, cfg, seed=1)
    dequantize(quantize(x, fmt, seed=1), torch.bfloat16)
    torch.cuda.synchronize()
    return name


def warm_all(names: list[str]) -> float:
    """Parallel compiles (spawned workers share Triton's disk cache with this process); seconds."""
    import multiprocessing as mp

    start = time.perf_counter()
    with mp.get_context("spawn").Pool(min(len(names), os.cpu_count() or 1, 16)) as pool:
        pool.map(_warm, names)
    return time.perf_counter() - start


def variant_rows(b: Bench, names: list[str], sizes_mib, configs, check_numel: int) -> list[dict]:
    """Quantize time of every launch shape per format and size, and its code equality with the
    committed shape (_launch.quant_config) on heavy-tailed data with a NaN run."""
    xc = make_test_data("heavy_tailed", check_numel, seed=3, device=b.device, dtype=torch.bfloat16)
    xc[1000:1100] = float("nan")
    out = []
    for size_mib in sizes_mib:
        x = b.gaussian(b.numel(size_mib))
        _, copy_moved = b.copy_moved_gbps(x)
        for name in names:
            fmt = parse_format(name)
            xin, xci = (x.abs(), xc.abs()) if fmt.kind == "cuint" else (x, xc)
            default = _launch.quant_config(fmt)
            ref = quantize_with_config(xci, fmt, default, seed=7)
            moved = xin.nbytes + fmt.storage_bytes(xin.numel())
            for cfg in configs:
                same = _same_quant(quantize_with_config(xci, fmt, cfg, seed=7), ref)
                ms = b.time_ms(lambda: quantize_with_config(xin, fmt, cfg, seed=1), rep=50)  # noqa: B023
                row = dict(size_mib=size_mib, format=name, config=cfg.label, elems_per_program=cfg.elems_per_program,
                           num_warps=cfg.num_warps, split=cfg.split, effective_split=_launch.split_for(fmt, cfg),
                           is_default=cfg == default, ms=ms, vs_copy=moved / ms / 1e6 / copy_moved,
                           codes_equal_default=same)  # fmt: skip
                out.append(row)
                print(f"variant {size_mib:6g} MiB {name:14s} {cfg.label:14s}{'*' if row['is_default'] else ' '} "
                      f"{ms:7.3f} ms {row['vs_copy']:.3f}x copy same-codes={same}", flush=True)  # fmt: skip
    return out


def choose_configs(rows: list[dict]) -> dict[tuple[str, int, bool], dict]:
    """Per QUANT_CONFIGS family: the code-equal launch shape with the best worst-case vs_copy over the
    family's formats and sizes (the committed shape wins a tie), with the committed shape's score."""
    scores: dict = {}
    for row in rows:
        key = _family(row["format"])
        cfg = (row["elems_per_program"], row["num_warps"], row["split"])
        score = row["vs_copy"] if row["codes_equal_default"] else float("-inf")
        fam = scores.setdefault(key, {})
        fam[cfg] = min(fam.get(cfg, math.inf), score)
    out = {}
    for key, by_cfg in scores.items():
        cur = _launch.QUANT_CONFIGS.get(key, _launch.DEFAULT_QUANT_CONFIG)
        cur_t = (cur.elems_per_program, cur.num_warps, cur.split)
        best = max(by_cfg, key=lambda c: (by_cfg[c], c == cur_t))
        if by_cfg[best] > -math.inf:
            out[key] = dict(config=_launch.QuantConfig(*best), worst_vs_copy=by_cfg[best],
                            committed=cur, committed_worst_vs_copy=by_cfg.get(cur_t))  # fmt: skip
    return out


def _print_choice(choice: dict) -> None:
    print("launch shapes to commit (agoq/kernels/_launch.py QUANT_CONFIGS), worst vs_copy over formats/sizes:")
    for key, c in sorted(choice.items()):
        cfg, cur = c["config"], c["committed"]
        cur_score = "n/a" if c["committed_worst_vs_copy"] is None else f"{c['committed_worst_vs_copy']:.3f}"
        print(f"    {key!r}: QuantConfig({cfg.elems_per_program}, {cfg.num_warps}, {cfg.split}),  "
              f"# {c['worst_vs_copy']:.3f} (committed {cur.label}: {cur_score})", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--quick", action="store_true", help="sizes 256 and 1024 MiB only")
    parser.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS)
    parser.add_argument("--check", action="store_true", help="also check kernel == reference (Llama shape)")
    parser.add_argument("--variants", action="store_true", help="also time VARIANT_CONFIGS launch shapes")
    parser.add_argument("--variants-only", action="store_true", help="only the launch-shape variants")
    parser.add_argument("--configs-from", help="JSON of a --variants run: benchmark with its chosen shapes")
    parser.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny tensors")
    args = parser.parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment (Triton's CPU interpreter)")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_quant.py needs a CUDA GPU (or --smoke on CPU)")
    b = Bench(args.smoke)
    sizes = [SMOKE_MIB] if args.smoke else ([256, 1024] if args.quick else args.sizes_mib)
    variant_sizes = [SMOKE_MIB] if args.smoke else list(VARIANT_MIB)
    variant_names = [n for n in args.formats if n in VARIANT_FORMATS]
    started = time.perf_counter()
    result = dict(
        command=" ".join([sys.executable.split("/")[-1], *sys.argv]),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device="cpu (interpreter smoke)" if args.smoke else torch.cuda.get_device_name(),
        versions=dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                      python=platform.python_version()),  # fmt: skip
        target=dict(vs_copy=TARGET_VS_COPY, min_size_mib=TARGET_MIN_MIB),
        smoke=args.smoke,
    )
    if args.configs_from:
        with open(args.configs_from) as f:
            choice = choose_configs(json.load(f)["variants"])
        _launch.QUANT_CONFIGS.update({k: c["config"] for k, c in choice.items()})
    if not args.smoke:
        result["compile_s"] = warm_all(args.formats)
        print(f"compiled in {result['compile_s']:.1f} s", flush=True)
    result["quant_configs"] = {"/".join(map(str, k)): vars(v) for k, v in _launch.QUANT_CONFIGS.items()}
    if args.variants or args.variants_only:
        configs = VARIANT_CONFIGS[::6] if args.smoke else VARIANT_CONFIGS
        numel = 4096 if args.smoke else VARIANT_CHECK_NUMEL
        result["variants"] = variant_rows(b, variant_names, variant_sizes, configs, numel)
        choice = choose_configs(result["variants"])
        result["variant_choice"] = {
            "/".join(map(str, k)): dict(config=c["config"].label, worst_vs_copy=c["worst_vs_copy"],
                                        committed=c["committed"].label,
                                        committed_worst_vs_copy=c["committed_worst_vs_copy"])
            for k, c in choice.items()
        }  # fmt: skip
        _print_choice(choice)
    if not args.variants_only:
        print("quantize launch shapes:", result["quant_configs"], flush=True)
        if args.check:
            result["check"] = check_rows(b, args.formats, (8, 1000) if args.smoke else (4096, 11008))
            print(json.dumps(result["check"]), flush=True)
        result["throughput"] = [row for size in sizes for row in bench_size(b, size, args.formats)]
        for row in result["throughput"]:
            print(f"{row['size_mib']:6g} MiB {row['format']:15s} {row['op']:10s} {row['ms']:8.3f} ms "
                  f"bf16 {row['bf16_gbps']:7.1f} GB/s moved {row['moved_gbps']:7.1f} GB/s {row['vs_copy']:.2f}x copy",
                  flush=True)  # fmt: skip
        result["sqnr"] = sqnr_rows(b, args.formats, 1 << 12 if args.smoke else SQNR_NUMEL)
        for row in result["sqnr"]:
            print(f"SQNR {row['format']:15s} {row['dist']:12s} {row['sqnr_db']:6.2f} dB (floor {row['floor_db']})")
    result["wall_s"] = time.perf_counter() - started
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
