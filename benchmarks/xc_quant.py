"""Cross-compile agoq's quantization kernels for sm_90 with Triton 3.6 (no GPU needed) and report, per
kernel launch: registers, spills, shared memory and a SASS instruction profile per element.

Run with Triton 3.6 first on the path (the H100 machine's version, installed at /tmp/t36 here)::

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/xc_quant.py [--formats int6_b64 nf4_b64] [--variants]
        [--optim] [--json out.json]

Launches are captured, not guessed: the real Python launchers (quantize_with_config, dequantize, the
fused optimizer step) run on CPU tensors while JITFunction.run is replaced by a recorder, and each
recorded launch is compiled with its argument types, constexprs, options (num_warps,
enable_fp_fusion) and Triton's launch-time specialisation (16-byte aligned pointers, ints divisible by
16). A kernel that does not compile under Triton 3.6 fails the run. The profile is static: these
kernels have no loops, so every SASS instruction on the main path runs once per warp. Columns:

  regs / spill   registers per thread, stack bytes (any spill marks a bad launch shape)
  smem           shared memory bytes per program (layout conversions go through it)
  ipe            SASS instructions x warps / elements: warp issue slots per element (an SM issues 4
                 per clock; an H100 at copy speed moves about 4 bf16 elements per SM per clock)
  cvt            F2I/I2F/F2F/FRND per element (quarter-rate pipe on sm_90)
  ldst           LDG/STG/LDS/STS/SHFL per element (memory-instruction pipe)

These are launch-shape smoke tests for the H100 runs, not timings (docs/benchmarks/quant.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from agoq.formats import parse_format
from agoq.kernels import _launch
from agoq.kernels.quant import dequantize, quantize_with_config

TARGET = GPUTarget("cuda", 90, 32)
_CVT = ("F2I", "I2F", "F2F", "FRND", "I2I", "F2FP")
_LDST = ("LDG", "STG", "LDS", "STS", "SHFL", "LD", "ST", "LDSM", "STSM")
_TORCH_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
_INSN = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?(.*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _run_tool(name: str, args: list[str], cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool(name), *args, f.name], check=True, capture_output=True, text=True).stdout


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """Opcode counts along the main path (an estimate of what every warp executes once).

    The kernel body runs from the entry to the first EXIT (subroutines follow it). A conditional
    branch that jumps over a CALL (the correctly rounded division's slow path, taken only for
    denormal / huge operands) counts as taken; every other conditional branch as not taken, so
    predicated stores and guards count in full (a slight overestimate)."""
    lines = _run_tool("nvdisasm", ["-c"], cubin).splitlines()
    label_at = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line.strip()))}
    ops = collections.Counter()
    i = 0
    while i < len(lines):
        m = _INSN.match(lines[i])
        i += 1
        if not m or m.group(2) == "NOP":
            continue
        op = m.group(2)
        ops[op] += 1
        if op == "EXIT" and not m.group(1):
            break
        target = re.search(r"(\.L_x_\d+)", m.group(4)) if op == "BRA" else None
        j = label_at.get(target.group(1)) if target else None
        if j is not None and (not m.group(1) or (j > i and any("CALL" in line for line in lines[i:j]))):
            i = j
    return ops


def resources(cubin: bytes) -> dict:
    """Registers, stack / local bytes of the kernel, from cuobjdump (no CUDA driver needed)."""
    text = _run_tool("cuobjdump", ["-res-usage"], cubin)
    return {m[0]: int(m[1]) for m in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


@contextlib.contextmanager
def captured_launches():
    """Record fn[grid](...) launches instead of running them: yields the list of records."""
    records: list[tuple] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        records.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield records
    finally:
        JITFunction.run = original


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type launch argument {value!r}")


def _aligned(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def compile_record(record):
    """Compile one recorded launch for sm_90 as Triton's launcher would specialise it."""
    fn, args, kwargs = record
    params = [p.name for p in fn.params]
    values = dict(zip(params, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in params})
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(params):
        value = values.get(name)
        if name in constexpr_names or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            signature[name] = _arg_type(value)
            if _aligned(value):
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    options.setdefault("num_stages", 1)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options), options.get("num_warps", 4)


def profile(record, elems: int) -> dict:
    kernel, num_warps = compile_record(record)
    cubin = kernel.asm["cubin"]
    ops, res = sass_opcodes(cubin), resources(cubin)
    per = num_warps / elems  # warp instructions x warps / elements

    def count(prefixes):
        return sum(n for op, n in ops.items() if op.startswith(prefixes))

    return dict(
        kernel=record[0].__name__,
        n_regs=res.get("REG", 0),
        n_spills=res.get("STACK", 0) + res.get("LOCAL", 0),  # spill slots live in the local stack frame
        smem=int(getattr(kernel.metadata, "shared", 0)),
        sass=sum(ops.values()),
        ipe=round(sum(ops.values()) * per, 3),
        cvt=round(count(_CVT) * per, 3),
        ldst=round(count(_LDST) * per, 3),
        top=dict(ops.most_common(6)),
    )


def _sample(fmt, numel: int = 1 << 20) -> torch.Tensor:
    x = torch.randn(numel, dtype=torch.bfloat16)
    return x.abs() if fmt.kind == "cuint" else x


def quantize_rows(name: str, configs) -> list[dict]:
    fmt = parse_format(name)
    x = _sample(fmt)
    default = _launch.quant_config(fmt)
    out = []
    for cfg in configs:
        with captured_launches() as records:
            quantize_with_config(x, fmt, cfg, seed=1)
        elems = _launch.rows_for(fmt, cfg.elems_per_program) * fmt.block
        out.append(dict(format=name, op="quantize", config=cfg.label, default=cfg == default,
                        **profile(records[0], elems)))  # fmt: skip
        _print(out[-1])
    return out


def dequantize_row(name: str) -> dict:
    from agoq.ref.quant import ref_quantize

    fmt = parse_format(name)
    q = ref_quantize(_sample(fmt, 1 << 16), fmt, seed=1)
    with captured_launches() as records:
        dequantize(q, torch.bfloat16)
    elems = _launch.rows_for(fmt, _launch.DEQUANT_ELEMS_PER_PROGRAM) * fmt.block
    row = dict(format=name, op="dequantize", config=f"{elems}/{_launch.DEQUANT_NUM_WARPS}", default=True,
               **profile(records[0], elems))  # fmt: skip
    _print(row)
    return row


def optim_rows() -> list[dict]:
    """The fused AdamW step (agoq.kernels.optim) with quantized states: it shares the scale code."""
    from agoq.kernels import optim
    from agoq.ref.quant import ref_quantize

    out = []
    for m_fmt, v_fmt in (("cint8_b32", "cuint8_b32"), ("int8_b128", "int8_b128_sp2"), ("nf4_b64", "int4_b64")):
        n = 1 << 16
        param, grad = torch.zeros(n, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
        master = torch.zeros(n, dtype=torch.int16)
        m = ref_quantize(torch.zeros(n), m_fmt)
        v = ref_quantize(torch.zeros(n), v_fmt)
        block = optim.fused_block(m, v)
        with captured_launches() as records:
            optim.adamw_step(param, grad, master, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                             weight_decay=0.1, step=3)  # fmt: skip
        for record in records:
            row = dict(format=f"adamw {m_fmt}/{v_fmt}", op="optim", config="-", default=True,
                       **profile(record, max(1, optim.ELEMS_PER_PROGRAM // block) * block))  # fmt: skip
            out.append(row)
            _print(row)
    return out


def _print(r: dict) -> None:
    flag = " SPILL" if r["n_spills"] else ""
    print(f"{r['format']:28s} {r['op']:10s} {r['config']:14s}{'*' if r['default'] else ' '} "
          f"regs {r['n_regs']:3d} spill {r['n_spills']:4d} smem {r['smem']:6d} ipe {r['ipe']:6.3f} "
          f"cvt {r['cvt']:5.3f} ldst {r['ldst']:5.3f}{flag}  {r['top']}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=None)
    parser.add_argument("--variants", action="store_true", help="every launch shape of bench_quant's VARIANT_CONFIGS")
    parser.add_argument("--optim", action="store_true", help="also the fused optimizer step kernel")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not triton.__version__.startswith("3.6"):
        raise SystemExit(f"needs Triton 3.6 first on PYTHONPATH (the H100's version), got {triton.__version__}")
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_quant import DEFAULT_FORMATS, VARIANT_CONFIGS, VARIANT_FORMATS

    rows = []
    for name in args.formats or DEFAULT_FORMATS:
        fmt = parse_format(name)
        configs = VARIANT_CONFIGS if args.variants and name in VARIANT_FORMATS else [_launch.quant_config(fmt)]
        rows += quantize_rows(name, configs)
        rows.append(dequantize_row(name))
    if args.optim:
        rows += optim_rows()
    spills = [r for r in rows if r["n_spills"]]
    print(f"{len(rows)} kernels compiled for sm_90 with Triton {triton.__version__}; {len(spills)} spill")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, target="sm_90", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
