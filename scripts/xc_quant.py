"""Cross-compile the quantize / dequantize kernels for sm_90 with Triton 3.6 (no GPU) and report, per
format and launch shape: registers, spills, shared memory and a SASS instruction profile per element.

Run with Triton 3.6 first on the path (the H100 machine's version, installed at /tmp/t36 here)::

    PYTHONPATH=/tmp/t36:$PWD python scripts/xc_quant.py [--formats int6_b64 nf4_b64] [--variants]
        [--json out.json]

A kernel that does not compile under Triton 3.6 fails the run. The profile is static: these kernels
have no loops, so every SASS instruction runs once per warp. Columns (per element of the tile):

  regs / spill   registers per thread, spilled bytes (any spill is a bad launch shape)
  smem           shared memory bytes per program (layout conversions go through it)
  ipe            warp-level SASS instructions x warps / elements: issue slots per element (an SM
                 issues 4 per clock; an H100 at copy speed moves ~4 elements per SM per clock)
  cvt            F2I/I2F/F2F/FRND per element (quarter-rate pipe on sm_90)
  ldst           LDG/STG/LDS/STS/SHFL per element (memory-instruction pipe)

These are launch-shape smoke tests for the H100 runs, not timings (docs/benchmarks/quant.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from agoq.formats import parse_format
from agoq.kernels import _launch
from agoq.kernels import quant as kq

TARGET = GPUTarget("cuda", 90, 32)
_CVT = ("F2I", "I2F", "F2F", "FRND", "I2I", "F2FP")
_LDST = ("LDG", "STG", "LDS", "STS", "SHFL", "LD", "ST", "LDSM", "STSM")
_NON_ISSUE = ("NOP",)


def _nvdisasm() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


_INSN = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?(.*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def _sass_opcodes(cubin: bytes) -> collections.Counter:
    """Opcode counts along the main path (an estimate of what every warp executes once).

    The kernel body runs from the entry to the first EXIT (subroutines follow it). A conditional
    branch that jumps over a CALL (the correctly rounded division's slow path, taken only for
    denormal / huge operands) counts as taken; every other conditional branch as not taken, so
    predicated stores and guards count in full (a slight overestimate)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_nvdisasm(), "-c", f.name], check=True, capture_output=True, text=True).stdout
    lines = text.splitlines()
    label_at = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.strip()))}
    ops = collections.Counter()
    i = 0
    while i < len(lines):
        m = _INSN.match(lines[i])
        i += 1
        if not m or m.group(2) in _NON_ISSUE:
            continue
        op = m.group(2)
        ops[op] += 1
        if op == "EXIT" and not m.group(1):
            break
        if op == "BRA":
            target = re.search(r"\(?(\.L_x_\d+)\)?", m.group(4))
            j = label_at.get(target.group(1)) if target else None
            if j is None:
                continue
            if not m.group(1):  # unconditional
                i = j
            elif j > i and any("CALL" in line for line in lines[i:j]):
                i = j
    return ops


# Launch-time specialisation as at the benchmark sizes: pointers 16-byte aligned (torch allocations),
# numel and num_blocks multiples of 16 (Triton marks such ints "tt.divisibility 16" and vectorises).
_ALIGNED_INTS = ("numel", "num_blocks")


def _compile(fn, signature: dict, constexprs: dict, num_warps: int):
    names = list(signature)
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n, ty in signature.items()
        if ty.startswith("*") or n in _ALIGNED_INTS
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": False}
    return triton.compile(src, target=TARGET, options=opts)


def quantize_kernel_args(fmt, elems: int):
    """(jit fn, signature, constexprs) of the quantize launch quantize_with_config would make."""
    ce = _launch.constexprs(fmt)
    rows = _launch.rows_for(fmt, elems)
    scale_ty = {"fp32": "*fp32", "fp16": "*fp16", "pow2": "*u8"}[fmt.scale]
    if _launch.uses_bytes_kernel(fmt):
        sig = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": scale_ty, "numel": "i32", "num_blocks": "i32"}
        const = dict(KIND=ce["KIND"], BLOCK=fmt.block, ROWS=rows, SCALE=ce["SCALE"], QMAX=ce["QMAX"],
                     FP8_DTYPE=ce["FP8_DTYPE"])  # fmt: skip
        return kq._quantize_bytes_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const
    sig = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": scale_ty, "nf4_lut_ptr": "*i64",
           "numel": "i32", "num_blocks": "i32", "seed_mix": "i32"}  # fmt: skip
    const = dict(ROWS=rows, SUB=_launch.SUB_ELEMS, PTX=True, **ce)
    return kq._quantize_fwd_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const


def dequantize_kernel_args(fmt):
    ce = _launch.constexprs(fmt)
    rows = _launch.rows_for(fmt, _launch.DEQUANT_ELEMS_PER_PROGRAM)
    scale_ty = {"fp32": "*fp32", "fp16": "*fp16", "pow2": "*u8"}[fmt.scale]
    sig = {"codes_ptr": "*u8", "scales_ptr": scale_ty, "out_ptr": "*bf16", "values_ptr": "*fp32",
           "numel": "i32", "num_blocks": "i32"}  # fmt: skip
    const = dict(ROWS=rows, **ce)
    return kq._dequantize_fwd_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const


def profile(fn, sig, const, num_warps: int, elems: int) -> dict:
    k = _compile(fn, sig, const, num_warps)
    k._init_handles() if hasattr(k, "_init_handles") and False else None
    ops = _sass_opcodes(k.asm["cubin"])
    total = sum(ops.values())
    per = num_warps / elems  # warp instructions x warps / elements

    def count(prefixes):
        return sum(n for op, n in ops.items() if op.startswith(prefixes))

    meta = k.metadata
    return dict(
        n_regs=_regs(k),
        n_spills=_spills(k),
        smem=int(getattr(meta, "shared", 0)),
        sass=total,
        ipe=round(total * per, 3),
        cvt=round(count(_CVT) * per, 3),
        ldst=round(count(_LDST) * per, 3),
        top=dict(ops.most_common(8)),
    )


def _regs(k) -> int:
    """Registers from the cubin's resource usage (no CUDA driver needed)."""
    return _cuobjdump_res(k)["REG"]


def _spills(k) -> int:
    res = _cuobjdump_res(k)
    return res.get("STACK", 0) + res.get("LOCAL", 0)


_RES_CACHE: dict = {}


def _cuobjdump_res(k) -> dict:
    key = id(k)
    if key not in _RES_CACHE:
        tool = os.path.join(os.path.dirname(_nvdisasm()), "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            text = subprocess.run([tool, "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
        _RES_CACHE[key] = {m[0]: int(m[1]) for m in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    return _RES_CACHE[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=None)
    parser.add_argument("--variants", action="store_true", help="every launch shape of bench_quant's variant set")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    assert triton.__version__.startswith("3.6"), f"needs Triton 3.6 first on PYTHONPATH, got {triton.__version__}"
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_quant import DEFAULT_FORMATS, variant_configs

    names = args.formats or DEFAULT_FORMATS
    rows = []
    for name in names:
        fmt = parse_format(name)
        default = _launch.quant_config(fmt)
        cfgs = variant_configs(fmt) if args.variants else [default]
        for cfg in cfgs:
            fn, sig, const = quantize_kernel_args(fmt, cfg.elems_per_program)
            r = profile(fn, sig, const, cfg.num_warps, _launch.rows_for(fmt, cfg.elems_per_program) * fmt.block)
            rows.append(dict(format=name, op="quantize", elems=cfg.elems_per_program, warps=cfg.num_warps,
                             default=cfg == default, **r))  # fmt: skip
            _print(rows[-1])
        fn, sig, const = dequantize_kernel_args(fmt)
        elems = _launch.rows_for(fmt, _launch.DEQUANT_ELEMS_PER_PROGRAM) * fmt.block
        rows.append(dict(format=name, op="dequantize", elems=elems, warps=_launch.DEQUANT_NUM_WARPS, default=True,
                         **profile(fn, sig, const, _launch.DEQUANT_NUM_WARPS, elems)))  # fmt: skip
        _print(rows[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, target="sm_90", rows=rows), f, indent=1)


def _print(r: dict) -> None:
    flag = " SPILL" if r["n_spills"] else ""
    print(f"{r['format']:15s} {r['op']:10s} {r['elems']:6d}/{r['warps']}{'*' if r['default'] else ' '} "
          f"regs {r['n_regs']:3d} spill {r['n_spills']:4d} smem {r['smem']:6d} ipe {r['ipe']:6.3f} "
          f"cvt {r['cvt']:5.3f} ldst {r['ldst']:5.3f}{flag}  {r['top']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
