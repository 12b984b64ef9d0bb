"""Reference block quantization in plain PyTorch: the executable spec of every agoq format.

Runs on CPU and GPU, any shape and numel (tail block zero-padded), bf16 / fp16 / fp32 inputs.
The Triton kernels in :mod:`agoq.kernels.quant` reproduce these codes bit for bit, so every step
below is a single IEEE fp32 operation (no fused multiply-add, no approximate division or sqrt).

Per block of ``fmt.block`` consecutive elements of the flattened tensor:

1. ``absmax`` = max |x| (for cuint: max sqrt(x)); ``raw = absmax / fmt.qmax`` (fp32 division).
2. Scale ``s`` = raw stored as fp32 (at least 2**-126 unless raw is 0), rounded to fp16 (RNE), or
   for pow2 the smallest power of two >= raw (exponent clamped to [-126, 127], stored as the biased
   byte e + 127).
3. ``p = x * (1 / s)`` (``1 / s`` correctly rounded; 0 when s == 0, i.e. an all-zero block).
4. Codes: int: round(p) clamped to [-qmax, qmax], stored offset-binary (q + 2**(bits-1));
   nf: index of the nearest NF4 entry (a tie goes to the lower index); fp8: RNE cast of p clamped to
   +-max, stored as the fp8 bit pattern; cint: round(127 * 2p / (1 + |p|)) stored as q + 128;
   cuint: round(255 * p) with p = sqrt(x) / s (sqrt correctly rounded, ``sqrt_rn``).
5. Codes are packed in bit planes (``QuantFormat.planes``), block after block.

Rounding "nearest" is round half away from zero, computed exactly as ``f = floor(|y|)``,
``f + (|y| - f >= 0.5)`` (both steps exact in fp32). "stochastic" is ``floor(y + u)`` with
``u = hash32(seed, flat_index) / 2**32`` (23 bits), a counter-based hash the kernels reproduce.

Non-finite policy (docs/numerics.md): a block holding NaN or +-Inf (for cuint also a negative value,
whose sqrt is NaN), or whose scale overflows its storage dtype, gets a NaN scale (pow2: byte 255)
and the codes of p = 0, so the whole dequantized block is NaN and downstream NaN checks fire.
Dequantize saturates: values past the output dtype's range (a scale rounded up near the dtype maximum)
become +-its largest finite value, never Inf (``saturate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agoq.formats import NF4_CODEBOOK, QuantFormat, parse_format

__all__ = [
    "QuantizedTensor", "ref_quantize", "ref_dequantize", "hash_uniform", "ref_code_values", "sqrt_rn", "saturate",
]  # fmt: skip

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "pow2": torch.uint8}
_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POW2_NAN_BYTE = 255  # biased exponent byte that encodes a NaN scale (exponents use 1..254)
POW2_MIN_EXP, POW2_MAX_EXP = -126, 127  # normal fp32 powers of two: the kernel builds them from bits
# fp32 scales are at least the smallest normal fp32 (a nonzero absmax below 2**-126 * qmax uses it):
# 1 / s is then finite, so p = x * (1 / s) is never inf or 0 * inf = NaN (docs/numerics.md)
FP32_SCALE_MIN = 2.0**-126
# Stochastic-rounding hash: golden-ratio seed mix, then multiply / xorshift / multiply with the
# constants of murmur3's fmix32 finaliser (public domain), without its outer xorshifts: those only
# mix high bits into low ones, and u uses the top bits (docs/numerics.md: uniformity and serial
# correlation measured). Five integer ops per element in the kernel instead of nine.
HASH_SEED_MUL = 0x9E3779B9
HASH_MUL1, HASH_MUL2 = 0x85EBCA6B, 0xC2B2AE35
HASH_SHIFT = 13
_MASK32 = 0xFFFFFFFF
SR_RANDOM_BITS = 23  # u = (h >> 9) * 2**-23: exact in fp32, u in [0, 1); the kernel builds it as 1.m - 1


@dataclass
class QuantizedTensor:
    """Quantized storage: packed codes, per-block scales, and what is needed to restore the tensor.

    codes: flat uint8, ``fmt.code_bytes(numel)`` bytes (for bf16/fp16/fp32 formats: the raw bytes).
    scales: flat, one per block; float32 (fp32), float16 (fp16) or uint8 biased exponent (pow2).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: QuantFormat
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        """Exact storage bytes (codes + scales); equals ``fmt.storage_bytes(numel)``."""
        return (
            self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()
        )


def check_input(x: torch.Tensor, fmt: QuantFormat, seed: int | None) -> None:
    """Shared argument checks of ref_quantize and the kernel launcher."""
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize expects a bf16/fp16/fp32 tensor, got {got}; cast it first")
    if fmt.rounding == "stochastic" and seed is None:
        raise ValueError(f"format {fmt.name!r} uses stochastic rounding: pass seed=<int>")
    if seed is not None and not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {type(seed).__name__}")


def hash_uniform(index_i64: torch.Tensor, seed: int) -> torch.Tensor:
    """Counter-based uniform in [0, 1) (fp32, 23 random bits) of (seed, flat element index).

    h = (index + seed * HASH_SEED_MUL) mod 2**32, then multiply / xorshift / multiply (the core of
    murmur3's fmix32), u = (h >> 9) * 2**-23 from the top 23 bits."""
    h = (index_i64 + ((seed * HASH_SEED_MUL) & _MASK32)) & _MASK32
    h = (h * HASH_MUL1) & _MASK32  # int64 product may wrap; the low 32 bits stay exact
    h = h ^ (h >> HASH_SHIFT)
    h = (h * HASH_MUL2) & _MASK32
    return (h >> (32 - SR_RANDOM_BITS)).to(torch.float32) * 2.0**-SR_RANDOM_BITS


def _div(num_f32: torch.Tensor, divisor: float) -> torch.Tensor:
    """Correctly rounded num / divisor on every device.

    PyTorch's CUDA kernel for tensor / Python-scalar multiplies by the scalar's reciprocal (not an
    IEEE division), which changes the last bit; a tensor divisor gives a true division everywhere.
    """
    return num_f32 / torch.full_like(num_f32, divisor)


def sqrt_rn(x_f32: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (the kernels' ``sqrt_rn``). PyTorch's CPU fp32 sqrt is not: its
    vectorised path is 1 ulp off for a share of inputs that depends on the CPU (0.6 % to ~20 % measured,
    torch 2.14, 2026), which moved cuint codes. sqrt in fp64 then one rounding to fp32 is
    correctly rounded (53 >= 2 * 24 + 2 bits: no double rounding); negative -> NaN, as torch.sqrt."""
    return torch.sqrt(x_f32.to(torch.float64)).to(torch.float32)


def _round_nearest(y: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exact in fp32: floor(|y|) + (frac >= 0.5), sign restored."""
    a = y.abs()
    f = torch.floor(a)
    r = f + (a - f >= 0.5).to(torch.float32)
    return torch.where(y < 0, -r, r)


def _round(y: torch.Tensor, fmt: QuantFormat, seed: int | None) -> torch.Tensor:
    if fmt.rounding == "nearest":
        return _round_nearest(y)
    index = torch.arange(y.numel(), device=y.device, dtype=torch.int64).view(y.shape)
    return torch.floor(y + hash_uniform(index, seed))


def _encode_scale(raw_f32: torch.Tensor, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale storage and its fp32 value; a non-finite value marks a bad block."""
    if scale == "fp32":
        s = torch.where(raw_f32 > 0, raw_f32.clamp_min(FP32_SCALE_MIN), raw_f32)
        return s, s
    if scale == "fp16":
        s16 = raw_f32.to(torch.float16)  # RNE; overflow -> inf -> treated as non-finite block
        return s16, s16.to(torch.float32)
    bits = raw_f32.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    exp = biased - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # ceil(log2(raw)) for normals
    exp = torch.where(biased == 0, POW2_MIN_EXP, exp).clamp_min(POW2_MIN_EXP)
    ok = exp <= POW2_MAX_EXP
    byte = torch.where(ok, exp + 127, POW2_NAN_BYTE).to(torch.uint8)
    return byte, _pow2_value(byte)


def _pow2_value(byte_u8: torch.Tensor) -> torch.Tensor:
    """fp32 value of a pow2 scale byte: 2**(byte - 127) built from its bits, NaN for byte 255."""
    byte = byte_u8.to(torch.int32)
    bits = (byte << 23) | torch.where(byte == POW2_NAN_BYTE, 0x400000, 0).to(torch.int32)
    return bits.to(torch.int32).view(torch.float32)


def _codes(p: torch.Tensor, fmt: QuantFormat, seed: int | None) -> torch.Tensor:
    """Unsigned codes (int32, < 2**bits) of normalised values p (fp32, [num_blocks, block])."""
    if fmt.kind == "int":
        q = _round(p, fmt, seed).clamp(-fmt.qmax, fmt.qmax)
        return q.to(torch.int32) + 2 ** (fmt.bits - 1)
    if fmt.kind == "nf":
        # number of midpoints strictly below p = index of the nearest entry, ties to the lower one
        return torch.searchsorted(_nf4_midpoints(p.device), p.contiguous()).to(torch.int32)
    if fmt.kind == "fp8":
        y = p.clamp(-fmt.qmax, fmt.qmax).to(_FP8_DTYPES[fmt.variant])
        return y.view(torch.uint8).to(torch.int32)
    if fmt.kind == "cint":
        pc = p.clamp(-1.0, 1.0)
        phi = (pc * 2.0) / (pc.abs() + 1.0)
        q = _round(phi * 127.0, fmt, seed).clamp(-127.0, 127.0)
        return q.to(torch.int32) + 128
    pc = p.clamp(0.0, 1.0)  # cuint
    return _round(pc * 255.0, fmt, seed).clamp(0.0, 255.0).to(torch.int32)


def _nf4_midpoints(device: torch.device) -> torch.Tensor:
    """fp32 midpoints between neighbouring NF4 entries (computed in fp64, rounded once)."""
    cb = torch.tensor(NF4_CODEBOOK, dtype=torch.float64)
    return ((cb[1:] + cb[:-1]) / 2).to(torch.float32).to(device)


def pack_codes(codes_i32: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """[num_blocks, block] unsigned codes -> flat uint8 in the bit-plane layout of fmt.planes."""
    parts, shift = [], 0
    for width in fmt.planes:
        plane = (codes_i32 >> shift) & ((1 << width) - 1)
        per_byte = 8 // width
        plane = plane.view(plane.shape[0], fmt.block // per_byte, per_byte)
        weights = torch.tensor(
            [1 << (width * j) for j in range(per_byte)], dtype=torch.int32, device=plane.device
        )
        parts.append((plane * weights).sum(-1, dtype=torch.int32))
        shift += width
    return torch.cat(parts, dim=1).to(torch.uint8).reshape(-1)


def unpack_codes(codes_u8: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Inverse of pack_codes: flat uint8 -> [num_blocks, block] int32 codes."""
    rows = codes_u8.view(-1, fmt.block * fmt.bits // 8).to(torch.int32)
    out = torch.zeros(rows.shape[0], fmt.block, dtype=torch.int32, device=rows.device)
    start, shift = 0, 0
    for width in fmt.planes:
        per_byte = 8 // width
        nbytes = fmt.block // per_byte
        plane = rows[:, start : start + nbytes].unsqueeze(-1)
        shifts = torch.arange(per_byte, dtype=torch.int32, device=rows.device) * width
        values = ((plane >> shifts) & ((1 << width) - 1)).reshape(rows.shape[0], fmt.block)
        out |= values << shift
        start, shift = start + nbytes, shift + width
    return out


def ref_quantize(x: torch.Tensor, fmt: QuantFormat | str, *, seed: int | None = None) -> QuantizedTensor:
    """Quantize x (any shape, bf16/fp16/fp32) to fmt. seed is required for stochastic rounding."""
    fmt = parse_format(fmt)
    check_input(x, fmt, seed)
    if not fmt.quantized:
        flat = x.detach().reshape(-1).to(_PLAIN_DTYPES[fmt.variant]).contiguous()
        empty = torch.empty(0, dtype=torch.float32, device=x.device)
        return QuantizedTensor(flat.view(torch.uint8), empty, fmt, x.shape, x.dtype)
    numel = x.numel()
    num_blocks = fmt.num_blocks(numel)
    xb = torch.zeros(num_blocks * fmt.block, dtype=torch.float32, device=x.device)
    xb[:numel] = x.detach().reshape(-1).to(torch.float32)
    xb = xb.view(num_blocks, fmt.block)
    if fmt.kind == "cuint":
        xb = sqrt_rn(xb)  # negative -> NaN -> non-finite block (second moments are >= 0)
    bad = ~torch.isfinite(xb).all(dim=1)
    absmax = xb.abs().amax(dim=1) if num_blocks else torch.zeros(0, device=x.device)
    stored, s = _encode_scale(_div(absmax, fmt.qmax), fmt.scale)
    bad |= ~torch.isfinite(s)
    inv = torch.where(s > 0, torch.ones_like(s) / s, 0.0)  # correctly rounded reciprocal
    p = torch.where(bad.unsqueeze(1), 0.0, xb * torch.where(bad, 0.0, inv).unsqueeze(1))
    codes = pack_codes(_codes(p, fmt, seed), fmt)
    if fmt.scale == "pow2":
        stored = torch.where(bad, POW2_NAN_BYTE, stored.to(torch.int32)).to(torch.uint8)
    else:
        stored = torch.where(bad, float("nan"), stored.to(torch.float32)).to(SCALE_DTYPES[fmt.scale])
    return QuantizedTensor(codes, stored, fmt, x.shape, x.dtype)


def scale_values(q: QuantizedTensor) -> torch.Tensor:
    """fp32 value of every block scale (NaN for non-finite blocks)."""
    if q.fmt.scale == "pow2":
        return _pow2_value(q.scales)
    return q.scales.to(torch.float32)


def _values(codes_i32: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Normalised fp32 values of unsigned codes (before multiplying by the scale)."""
    if fmt.kind == "int":
        return (codes_i32 - 2 ** (fmt.bits - 1)).to(torch.float32)
    if fmt.kind == "nf":
        cb = torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=codes_i32.device)
        return cb[codes_i32.long()]
    if fmt.kind == "fp8":
        return codes_i32.to(torch.uint8).view(_FP8_DTYPES[fmt.variant]).to(torch.float32)
    if fmt.kind == "cint":
        z = _div((codes_i32 - 128).to(torch.float32), 127.0)
        return z / (2.0 - z.abs())
    return _div(codes_i32.to(torch.float32), 255.0)  # cuint: sqrt domain


def ref_code_values(fmt: QuantFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalised fp32 value of every code (2**bits entries, before the scale): the lookup table a
    kernel may gather from instead of recomputing; identical to what ref_dequantize computes."""
    return _values(torch.arange(2**fmt.bits, dtype=torch.int32, device=device), fmt)


def ref_dequantize(q: QuantizedTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize to q.shape in out_dtype (default: the original dtype)."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in INPUT_DTYPES:
        raise ValueError(f"out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    fmt = q.fmt
    if not fmt.quantized:
        return q.codes.view(_PLAIN_DTYPES[fmt.variant]).to(out_dtype).reshape(q.shape)
    if q.numel == 0:
        return torch.empty(q.shape, dtype=out_dtype, device=q.codes.device)
    y = _values(unpack_codes(q.codes, fmt), fmt) * scale_values(q).unsqueeze(1)
    if fmt.kind == "cuint":
        y = y * y
    return saturate(y.reshape(-1)[: q.numel], out_dtype).to(out_dtype).reshape(q.shape)


def saturate(y_f32: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Clamp fp32 values to +-(out_dtype's largest finite value); NaN stays NaN (non-finite blocks).

    A finite block's code value times its scale can exceed the output dtype's range although every
    input was finite: the scale rounds up (fp16: 65504 / 127 -> 516, and 127 * 516 = 65532 rounds to
    fp16 inf; pow2: 3e38 / 7 -> 2**126, and code 4 * 2**126 = 2**128 overflows fp32). The codes'
    values are those of the finite grid, so the nearest finite value is the right answer;
    a dequantized Inf would only ever mean "near the maximum". docs/numerics.md."""
    lim = torch.finfo(out_dtype).max
    return y_f32.clamp(-lim, lim)  # clamp keeps NaN
