"""Launch helpers for the quantization kernels: QuantFormat -> constexpr table, grids, small tables."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from agoq.formats import NF4_CODEBOOK, QuantFormat
from agoq.ref.quant import ref_code_values

# Elements one program instance handles: ROWS = ELEMS_PER_PROGRAM // block blocks per program.
# 4096 bf16 elements = 8 KiB read per program keeps enough bytes in flight per SM on H100; tuned in
# scripts/bench_quant.py (docs/benchmarks/quant.md records the sweep device and date).
ELEMS_PER_PROGRAM = 4096
NUM_WARPS = 4

KIND_IDS = {"int": 0, "nf": 1, "fp8": 2, "cint": 3, "cuint": 4}
SCALE_IDS = {"fp32": 0, "fp16": 1, "pow2": 2}
TL_OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
TORCH_SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "pow2": torch.uint8}
HASH_SEED_MUL = 0x9E3779B9  # same constant as agoq.ref.quant (golden-ratio seed mix)


def rows_per_program(fmt: QuantFormat) -> int:
    return max(1, ELEMS_PER_PROGRAM // fmt.block)


def grid(fmt: QuantFormat, num_blocks: int) -> tuple[int]:
    return (triton.cdiv(num_blocks, rows_per_program(fmt)),)


def constexprs(fmt: QuantFormat) -> dict:
    """The format as kernel compile-time constants."""
    planes = fmt.planes + (0,) * (2 - len(fmt.planes))
    return dict(
        KIND=KIND_IDS[fmt.kind],
        BITS=fmt.bits,
        BLOCK=fmt.block,
        ROWS=rows_per_program(fmt),
        SCALE=SCALE_IDS[fmt.scale],
        STOCHASTIC=fmt.rounding == "stochastic",
        QMAX=float(fmt.qmax),
        PLANE0=planes[0],
        PLANE1=planes[1],
        FP8_DTYPE=TL_FP8.get(fmt.variant, tl.float8e4nv),
    )


def seed_mix(seed: int | None) -> int:
    """(seed * golden) mod 2**32 as a signed int32 launch argument (bit-cast back in the kernel)."""
    mixed = ((seed or 0) * HASH_SEED_MUL) & 0xFFFFFFFF
    return mixed - (1 << 32) if mixed >= (1 << 31) else mixed


@functools.lru_cache(maxsize=16)  # one small upload per device, not one per call
def nf4_midpoints(device: str) -> torch.Tensor:
    """fp32 midpoints between NF4 entries (15; fp64 mean rounded once, as agoq.ref), padded to 16."""
    cb64 = torch.tensor(NF4_CODEBOOK, dtype=torch.float64)
    mids = ((cb64[1:] + cb64[:-1]) / 2).to(torch.float32)
    return torch.cat([mids, mids[-1:]]).to(device)


@functools.lru_cache(maxsize=64)
def code_values(fmt: QuantFormat, device: str) -> torch.Tensor:
    """Per-code fp32 values for lookup-table dequantize (nf, cint, cuint), from agoq.ref itself, so
    the kernel's values are the reference's by construction (no per-element division on GPU)."""
    if fmt.kind not in ("nf", "cint", "cuint"):
        return torch.zeros(1, dtype=torch.float32, device=device)
    return ref_code_values(fmt, device)
