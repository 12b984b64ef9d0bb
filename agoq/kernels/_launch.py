"""Launch helpers for the quantization kernels: QuantFormat -> constexpr table, grids, small tables."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl

from agoq.formats import NF4_CODEBOOK, QuantFormat
from agoq.ref.quant import ref_code_values

KIND_IDS = {"int": 0, "nf": 1, "fp8": 2, "cint": 3, "cuint": 4}
SCALE_IDS = {"fp32": 0, "fp16": 1, "pow2": 2}
TL_OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
TORCH_SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "pow2": torch.uint8}
HASH_SEED_MUL = 0x9E3779B9  # same constant as agoq.ref.quant (golden-ratio seed mix)

MAX_LAUNCH_SITES = 512
"""Most launch sites one per-size site cache keeps (quant._QUANT_SITES / _DEQUANT_SITES,
swiglu_quant._FWD_SITES / _DQ_SITES: keyed by format and tensor size or shape). Why a bound: a training run
sees a few dozen keys (one per saved role and micro-batch shape, per pipeline chunk), but varying sequence
lengths or evaluation shapes bring new sizes without end, and each site holds host objects (and an NF4
value table per device) for the process lifetime. 512 is over 10x a training run's working set (a ~1B
LLaMA step with the agoq policy: < 40 keys per cache). When full, the oldest site is dropped (insertion
order): inserting is rare, so lookups stay one plain ``dict.get`` on the hot path."""


def remember_site(sites: dict, key, site, limit: int | None = None):
    """``sites[key] = site``, dropping the oldest entries first so that ``len(sites) <= limit``
    (default :data:`MAX_LAUNCH_SITES`); returns site."""
    limit = MAX_LAUNCH_SITES if limit is None else limit
    while len(sites) >= limit:
        del sites[next(iter(sites))]
    sites[key] = site
    return site



@dataclass(frozen=True)
class QuantConfig:
    """Quantize launch shape: elements per program instance (ROWS = elems // block blocks), warps, and
    (tile kernel) parts per tile: each thread holds ``split`` consecutive 8-element chunks of a block."""

    elems_per_program: int = 4096
    num_warps: int = 4
    split: int = 1

    def __post_init__(self) -> None:
        if self.split not in (1, 2, 4):
            raise ValueError(f"QuantConfig.split={self.split} is not allowed; use 1, 2 or 4")

    @property
    def label(self) -> str:
        return f"{self.elems_per_program}/{self.num_warps}/s{self.split}"


# Quantize launch shape per format family (kind, bits, stochastic); the codes never depend on it.
# Tile kernel (_quantize_fwd_kernel) shapes: chosen from the Triton 3.6 sm_90 cross-compile profile
# (benchmarks/xc_quant.py --variants: no spills, fewest SASS instructions per element) until an H100 run
# of `benchmarks/bench_quant.py --variants` replaces them with measured choices (docs/benchmarks/quant.md).
# split=4 (two 16-byte chunks per block row for b32, capped by split_for) halves the per-block scale
# work per element twice and stores 16 contiguous bytes of packed words per thread; one-byte codes
# keep split=1, whose [rows, block] tile stores 16 contiguous code bytes per thread.
DEFAULT_QUANT_CONFIG = QuantConfig()
QUANT_CONFIGS: dict[tuple[str, int, bool], QuantConfig] = {
    ("int", 8, False): QuantConfig(4096, 4),  # _quantize_bytes_kernel: see below
    ("int", 6, False): QuantConfig(4096, 4, 4),
    ("int", 5, False): QuantConfig(4096, 4, 4),
    ("int", 4, False): QuantConfig(4096, 4, 4),
    ("int", 3, False): QuantConfig(4096, 4, 4),
    ("int", 2, False): QuantConfig(4096, 4, 4),
    ("nf", 4, False): QuantConfig(4096, 4, 4),
    ("fp8", 8, False): QuantConfig(4096, 4),  # _quantize_bytes_kernel: see below
    ("cint", 8, False): QuantConfig(4096, 4),
    ("cuint", 8, False): QuantConfig(4096, 4),
    ("int", 8, True): QuantConfig(4096, 4),
}
# int8 (round to nearest) and fp8 use the [ROWS, BLOCK] _quantize_bytes_kernel with 4096 elements and
# 4 warps: measured on NVIDIA H100 80GB HBM3 / Triton 3.6.0 at 2026-11-22T04:28Z (0.93-1.02 of copy,
# quant.md run C).


# Consecutive elements per thread in the quantize kernel: 8 bf16 = one 16-byte load, and 8 codes of
# a 4/2/1-bit plane make one 32/16/8-bit word.
SUB_ELEMS = 8
# Dequantize: 4096 bf16 elements (8 KiB) per program, 4 warps (H100 run of 2026-11-22, quant.md).
DEQUANT_ELEMS_PER_PROGRAM = 4096
DEQUANT_NUM_WARPS = 4


def quant_config(fmt: QuantFormat) -> QuantConfig:
    return QUANT_CONFIGS.get((fmt.kind, fmt.bits, fmt.rounding == "stochastic"), DEFAULT_QUANT_CONFIG)


def rows_for(fmt: QuantFormat, elems_per_program: int) -> int:
    return max(1, elems_per_program // fmt.block)


# A tile part keeps at least two 16-byte chunks per block row (a warp's load instruction then still
# reads whole 32-byte sectors of every row it touches): split <= block / (2 * SUB_ELEMS).
def split_for(fmt: QuantFormat, config: QuantConfig) -> int:
    """The tile kernel's parts per tile: config.split, capped for small blocks (see above)."""
    return max(1, min(config.split, fmt.block // (2 * SUB_ELEMS)))


@functools.lru_cache(maxsize=256)  # per launch on the host path: build the dict once per format
def constexprs(fmt: QuantFormat) -> dict:
    """The format as kernel compile-time constants (a shared dict: read it, never mutate it)."""
    planes = fmt.planes + (0,) * (2 - len(fmt.planes))
    return dict(
        KIND=KIND_IDS[fmt.kind],
        BITS=fmt.bits,
        BLOCK=fmt.block,
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


NF4_BUCKETS = 32  # buckets of width 1/16 over [-1, 1): narrower than the smallest midpoint gap


def nf4_midpoints_f32() -> torch.Tensor:
    """The 15 fp32 midpoints between NF4 entries (fp64 mean rounded once, as agoq.ref)."""
    cb64 = torch.tensor(NF4_CODEBOOK, dtype=torch.float64)
    return ((cb64[1:] + cb64[:-1]) / 2).to(torch.float32)


def nf4_lut_cpu() -> torch.Tensor:
    """int64 [32]: bucket b = [-1 + b/16, -1 + (b+1)/16) -> thr[b] | below[b] << 32, where thr[b] is
    the fp32 bits of the midpoint in the bucket (+inf if none) and below[b] = #(midpoints < bucket
    start). Kernel: code = below[b] + (p > thr[b]) from one 8-byte gather."""
    mids = nf4_midpoints_f32()
    starts = torch.arange(NF4_BUCKETS, dtype=torch.float32) / 16.0 - 1.0  # exact in fp32
    thr = torch.full((NF4_BUCKETS,), float("inf"))
    for m in mids.tolist():
        b = int((m + 1.0) * 16.0)
        if thr[b] != float("inf"):
            raise ValueError("NF4 bucket holds two midpoints: raise NF4_BUCKETS")
        thr[b] = m
    below = (mids[None, :] < starts[:, None]).sum(1).to(torch.int64)
    thr_bits = thr.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return thr_bits | (below << 32)


def nf4_lut_split(lut_i64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(thr fp32 [32], below int32 [32]) of an nf4_lut_cpu table, decoded as the kernel does."""
    low = lut_i64 & 0xFFFFFFFF
    thr = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).view(torch.float32)
    return thr, (lut_i64 >> 32).to(torch.int32)


@functools.lru_cache(maxsize=16)  # one small upload per device, not one per call
def nf4_lut(device: str) -> torch.Tensor:
    return nf4_lut_cpu().to(device)


@functools.lru_cache(maxsize=64)
def code_values(fmt: QuantFormat, device: str) -> torch.Tensor:
    """Per-code fp32 values for lookup-table dequantize (nf, cint, cuint), from agoq.ref itself, so
    the kernel's values are the reference's by construction (no per-element division on GPU)."""
    if fmt.kind not in ("nf", "cint", "cuint"):
        return torch.zeros(1, dtype=torch.float32, device=device)
    return ref_code_values(fmt, device)
