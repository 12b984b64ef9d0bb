"""Triton block quantize / dequantize with the signatures and codes of agoq.ref.quant.

One program handles ROWS consecutive blocks. Quantize reads the input once and does absmax, scale,
code and bit-plane packing in registers; dequantize reads codes + scales and writes the output
dtype directly. All arithmetic mirrors agoq.ref.quant step for step: divisions and sqrt are the
correctly rounded ``div_rn`` / ``sqrt_rn``, and kernels are compiled with ``enable_fp_fusion=False``
so no multiply-add is contracted into an FMA (which would change rounding and hence codes).

Interpreter note (TRITON_INTERPRET=1, Triton 3.8): the fp32 -> fp8 cast of the interpreter does not
round ties to even, so fp8 *quantize* is checked on GPU only; everything else runs there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.formats import QuantFormat, parse_format
from agoq.kernels import _launch
from agoq.ref.quant import QuantizedTensor, check_input, ref_dequantize, ref_quantize

__all__ = ["quantize", "dequantize", "quantize_with_config"]


# Round half away from zero as int32 for |y| < 2**22: trunc(y + copysign(HALF_BELOW, y)), one add
# and one truncating convert. HALF_BELOW = 0.5 - 2**-25 (the largest float below 0.5): for
# n = round_half_away(|y|), |y| + HALF_BELOW lies in [n - 2**-25, n + 1 - 2**-25 - ulp(|y|)], which
# rounds (RNE) into [n, n + 1) (a tie |y| = n - 0.5 rounds up to n; |y| just below n + 0.5 stays below
# n + 1), while plain floor(|y| + 0.5) fails at |y| = 0.49999997. Checked exhaustively against the
# reference rounding for every fp32 |y| < 1024 (docs/benchmarks/quant.md).
HALF_BELOW_BITS = tl.constexpr(0x3EFFFFFF)
SIGN_BIT = tl.constexpr(-(2**31))


@triton.jit
def _round_half_away_i32(y):
    half = ((y.to(tl.int32, bitcast=True) & SIGN_BIT) | HALF_BELOW_BITS).to(tl.float32, bitcast=True)
    return (y + half).to(tl.int32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _hash_uniform(local_u32, hash_base):
    """agoq.ref.quant.hash_uniform on uint32 lanes: flat index + seed mix (mod 2**32) = in-program
    offset + hash_base (program's first index + seed mix, one scalar add); wrap-around multiplies."""
    h = local_u32 + hash_base.to(tl.uint32, bitcast=True)
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _nf4_code(p, nf4_lut_ptr):
    """#(NF4 midpoints < p) (ties to the lower code, as searchsorted) from a 32-bucket table.

    Bucket b = trunc(16 p + 16) (clamped to 31) covers [-1 + b/16, -1 + (b+1)/16), narrower than the
    smallest gap between NF4 midpoints (0.085), so it holds at most one midpoint thr[b] (+inf if
    none) and code = below[b] + (p > thr[b]): one convert and two L1-resident gathers instead of a
    4-level search. _launch.nf4_lut builds the table; tests check it against searchsorted for every
    fp32 p in [-1.01, 1.01] (rounding of 16 p + 16 near a bucket edge included).
    """
    bucket = tl.minimum((p * 16.0 + 16.0).to(tl.int32).to(tl.uint32), 31).to(tl.int32)  # NaN-safe
    thr = tl.load(nf4_lut_ptr + bucket)
    below = tl.load(nf4_lut_ptr + 32 + bucket).to(tl.int32, bitcast=True)
    return below + (p > thr).to(tl.int32)


@triton.jit
def _store_plane(codes_ptr, plane, row_off, chunk, row_ok, WIDTH: tl.constexpr, SUB: tl.constexpr):
    """Store one bit plane of [ROWS, G, SUB] codes (< 2**WIDTH). SUB consecutive codes of a block are
    held by one thread, so a plane packs in registers with shifts and adds into one WIDTH*SUB-bit
    little-endian word per chunk: code k of the chunk at bit WIDTH*k, i.e. the pack_codes layout."""
    if WIDTH == 8:
        k = tl.arange(0, SUB)[None, None, :]
        ptrs = codes_ptr + row_off[:, None, None] + chunk[None, :, None] * SUB + k
        tl.store(ptrs, plane.to(tl.uint8), mask=row_ok[:, None, None])
    else:
        shifts = (tl.arange(0, SUB) * WIDTH)[None, None, :]
        word = tl.sum(plane << shifts, axis=2)  # disjoint bit fields: the sum is an OR
        ptrs = codes_ptr + row_off[:, None] + chunk[None, :] * (SUB * WIDTH // 8)  # byte address
        if WIDTH == 4:
            tl.store(ptrs.to(tl.pointer_type(tl.int32), bitcast=True), word, mask=row_ok[:, None])
        elif WIDTH == 2:
            tl.store(ptrs.to(tl.pointer_type(tl.int16), bitcast=True), word.to(tl.int16), mask=row_ok[:, None])
        else:
            tl.store(ptrs, word.to(tl.uint8), mask=row_ok[:, None])


@triton.jit
def _unpack_plane(byte, ROWS: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """Inverse of _pack_plane: [ROWS, BLOCK*WIDTH//8] bytes (int32) -> [ROWS, BLOCK] codes."""
    if WIDTH == 8:
        out = byte
    elif WIDTH == 4:
        out = tl.reshape(tl.join(byte & 15, byte >> 4), [ROWS, BLOCK])
    elif WIDTH == 2:
        q0 = tl.join(byte & 3, (byte >> 4) & 3)  # codes 0 and 2 of the byte (j = 0)
        q1 = tl.join((byte >> 2) & 3, (byte >> 6) & 3)  # codes 1 and 3 (j = 1)
        out = tl.reshape(tl.join(q0, q1), [ROWS, BLOCK])
    else:
        a00 = tl.join(byte & 1, (byte >> 4) & 1)  # bits (i, j, k) = 4i + 2j + k, joined i first
        a01 = tl.join((byte >> 1) & 1, (byte >> 5) & 1)
        a10 = tl.join((byte >> 2) & 1, (byte >> 6) & 1)
        a11 = tl.join((byte >> 3) & 1, (byte >> 7) & 1)
        out = tl.reshape(tl.join(tl.join(a00, a10), tl.join(a01, a11)), [ROWS, BLOCK])
    return out


@triton.jit
def _encode_scale(raw, SCALE: tl.constexpr):
    """(stored scale, its fp32 value) as agoq.ref.quant._encode_scale; pow2 stores a biased byte."""
    if SCALE == 0:
        stored = raw
        s = raw
    elif SCALE == 1:
        stored = raw.to(tl.float16)
        s = stored.to(tl.float32)
    else:
        bits = raw.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        exp = biased - 127 + tl.where((bits & 0x7FFFFF) != 0, 1, 0)
        exp = tl.maximum(tl.where(biased == 0, -126, exp), -126)
        byte = tl.where(exp <= 127, exp + 127, 255)
        stored = byte
        s = _pow2_value(byte)
    return stored, s


@triton.jit
def _pow2_value(byte_i32):
    bits = (byte_i32 << 23) | tl.where(byte_i32 == 255, 0x400000, 0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_fwd_kernel(
    x_ptr,  # input, bf16/fp16/fp32, numel elements (flat, contiguous)
    codes_ptr,  # out: uint8, num_blocks * BLOCK * BITS // 8 packed codes
    scales_ptr,  # out: fp32 / fp16 / uint8 (pow2 biased exponent), num_blocks
    nf4_lut_ptr,  # fp32 [64]: NF4 bucket thresholds, then bucket base codes (bits); KIND == 1 only
    numel,  # int: number of valid input elements
    num_blocks,  # int: ceil(numel / BLOCK)
    seed_mix,  # int32: (seed * 0x9E3779B9) mod 2**32, bit-cast; stochastic rounding only
    KIND: tl.constexpr,  # 0 int, 1 nf, 2 fp8, 3 cint, 4 cuint
    BITS: tl.constexpr,  # code width
    BLOCK: tl.constexpr,  # elements per scale
    ROWS: tl.constexpr,  # blocks per program
    SCALE: tl.constexpr,  # 0 fp32, 1 fp16, 2 pow2
    STOCHASTIC: tl.constexpr,  # seeded stochastic rounding
    QMAX: tl.constexpr,  # absmax maps to this code magnitude
    PLANE0: tl.constexpr,  # first (low) bit-plane width
    PLANE1: tl.constexpr,  # second bit-plane width or 0
    FP8_DTYPE: tl.constexpr,  # tl.float8e4nv / tl.float8e5
    SUB: tl.constexpr,  # consecutive elements per thread (a power of two <= 32)
):
    # -- load ROWS blocks as [ROWS, G, SUB]: SUB consecutive elements per thread (one 16-byte load of
    # bf16), so the codes sharing a packed word are packed in registers (no layout conversion).
    # 64-bit program base, 32-bit offsets inside the program (cheaper per-element address math).
    G: tl.constexpr = BLOCK // SUB
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    elem_base = first_row * BLOCK
    rows = tl.arange(0, ROWS)
    chunk = tl.arange(0, G)
    local = (rows[:, None, None] * BLOCK + chunk[None, :, None] * SUB) + tl.arange(0, SUB)[None, None, :]
    elems_left = tl.minimum(numel - elem_base, ROWS * BLOCK).to(tl.int32)
    x = tl.load(x_ptr + elem_base + local, mask=local < elems_left, other=0.0).to(tl.float32)
    if KIND == 4:
        x = tl.math.sqrt_rn(x)  # negative -> NaN -> non-finite block
    # -- absmax (NaN-propagating max: a NaN or Inf element makes the block non-finite), scale --------
    absmax = tl.reduce(tl.reduce(tl.abs(x), 2, _max_nan), 1, _max_nan)
    bad = (absmax != absmax) | (absmax == float("inf"))
    raw = tl.math.div_rn(absmax, QMAX)
    stored, s = _encode_scale(raw, SCALE)
    bad = bad | (s != s) | (s == float("inf"))
    inv = tl.where((s > 0) & (~bad), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
    p = tl.where(bad[:, None, None], 0.0, x * inv[:, None, None])
    # -- codes ----------------------------------------------------------------------------------
    if KIND == 1:
        code = _nf4_code(p, nf4_lut_ptr)
    elif KIND == 2:
        y = tl.minimum(tl.maximum(p, -QMAX), QMAX)
        code = y.to(FP8_DTYPE).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        hash_base = (elem_base.to(tl.uint32) + seed_mix.to(tl.uint32, bitcast=True)).to(tl.int32, bitcast=True)
        code = _int_code(p, local.to(tl.uint32), hash_base, KIND, BITS, STOCHASTIC, QMAX)
    # -- pack bit planes and store -------------------------------------------------------------
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    codes_ptr += first_row * row_bytes
    row_off = rows * row_bytes
    _store_plane(codes_ptr, code & ((1 << PLANE0) - 1), row_off, chunk, row_ok, PLANE0, SUB)
    if PLANE1 > 0:
        plane1 = (code >> PLANE0) & ((1 << PLANE1) - 1)
        _store_plane(codes_ptr, plane1, row_off + BLOCK * PLANE0 // 8, chunk, row_ok, PLANE1, SUB)
    scales_ptr += first_row
    if SCALE == 2:
        stored = tl.where(bad, 255, stored).to(tl.uint8)
    else:
        stored = tl.where(bad, float("nan"), stored.to(tl.float32)).to(scales_ptr.dtype.element_ty)
    tl.store(scales_ptr + rows, stored, mask=row_ok)


@triton.jit
def _int_code(p, local_u32, hash_base, KIND: tl.constexpr, BITS: tl.constexpr, STOCHASTIC: tl.constexpr,
              QMAX: tl.constexpr):  # fmt: skip
    """Unsigned codes of int (KIND 0), cint (3) and cuint (4), with agoq.ref's rounding and clamps."""
    if KIND == 0:
        y = p
        lim = QMAX
    elif KIND == 3:
        pc = tl.minimum(tl.maximum(p, -1.0), 1.0)
        y = tl.math.div_rn(pc * 2.0, tl.abs(pc) + 1.0) * 127.0  # |y| <= 127: the ref clamp is a no-op
        lim = 127.0
    else:
        y = tl.minimum(tl.maximum(p, 0.0), 1.0) * 255.0
        lim = 255.0
    if STOCHASTIC:
        # floor(clamp(z)) == clamp(floor(z)) for an integer limit (floor is monotone)
        z = tl.minimum(tl.maximum(y + _hash_uniform(local_u32, hash_base), -lim), lim)
        r = tl.floor(z).to(tl.int32)
    elif KIND == 0:
        r = _round_half_away_i32(tl.minimum(tl.maximum(y, -lim), lim))  # clamp before: same result
    else:
        r = _round_half_away_i32(y)  # cint: |y| <= 127; cuint: 0 <= y <= 255 (clamped p)
    offset: tl.constexpr = 2 ** (BITS - 1) if KIND == 0 else (128 if KIND == 3 else 0)
    return r + offset


@triton.jit
def quantize_tile_bytes(x, KIND: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr, FP8_DTYPE: tl.constexpr):
    """(uint8 codes [ROWS, BLOCK], stored scales [ROWS]) of an fp32 tile of ROWS blocks, one-byte codes
    (KIND 0: int8 round half away from zero; KIND 2: fp8), agoq.ref.quant's math step for step. The
    stored scales are fp32 values (SCALE 0 / 1; the caller casts to the storage dtype) or pow2 bytes."""
    xa = tl.abs(x)
    bad = tl.max(((xa != xa) | (xa == float("inf"))).to(tl.int32), axis=1) > 0
    stored, s = _encode_scale(tl.math.div_rn(tl.max(xa, axis=1), QMAX), SCALE)
    bad = bad | (s != s) | (s == float("inf"))
    inv = tl.where((s > 0) & (~bad), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
    p = tl.where(bad[:, None], 0.0, x * inv[:, None])
    if KIND == 0:
        a = tl.abs(p)  # round half away from zero: floor(|p|) + (frac >= 0.5), sign restored
        f = tl.floor(a)
        r = f + tl.where(a - f >= 0.5, 1.0, 0.0)
        r = tl.minimum(tl.maximum(tl.where(p < 0, -r, r), -QMAX), QMAX)
        code = (r.to(tl.int32) + 128).to(tl.uint8)
    else:
        y = tl.minimum(tl.maximum(p, -QMAX), QMAX)
        code = y.to(FP8_DTYPE).to(tl.uint8, bitcast=True)
    if SCALE == 2:
        stored = tl.where(bad, 255, stored).to(tl.uint8)
    else:
        stored = tl.where(bad, float("nan"), stored.to(tl.float32))
    return code, stored


@triton.jit
def decode_tile_bytes(code_u8, KIND: tl.constexpr, FP8_DTYPE: tl.constexpr):
    """fp32 code values (before the block scale) of one-byte codes (KIND 0 int8, 2 fp8)."""
    if KIND == 0:
        v = (code_u8.to(tl.int32) - 128).to(tl.float32)
    else:
        v = code_u8.to(FP8_DTYPE, bitcast=True).to(tl.float32)
    return v


@triton.jit
def load_scale_f32(ptrs, mask, SCALE: tl.constexpr):
    """fp32 value of stored scales (pow2: biased exponent byte; a masked lane reads a harmless 1.0)."""
    if SCALE == 2:
        s = _pow2_value(tl.load(ptrs, mask=mask, other=127).to(tl.int32))
    else:
        s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def _quantize_bytes_kernel(
    x_ptr, codes_ptr, scales_ptr, numel, num_blocks,  # as _quantize_fwd_kernel
    KIND: tl.constexpr,  # 0 int (8-bit, round to nearest) or 2 fp8: one whole byte per code
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
):  # fmt: skip
    """One-byte codes (int8 nearest, fp8) on a [ROWS, BLOCK] tile: nothing to pack, and this 2-D
    layout measured faster for them than the [ROWS, G, SUB] kernel (docs/benchmarks/quant.md)."""
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    elem_base = first_row * BLOCK
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    elems_left = tl.minimum(numel - elem_base, ROWS * BLOCK).to(tl.int32)
    x = tl.load(x_ptr + elem_base + local, mask=local < elems_left, other=0.0).to(tl.float32)
    code, stored = quantize_tile_bytes(x, KIND, SCALE, QMAX, FP8_DTYPE)
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    codes_ptr += first_row * BLOCK
    tl.store(codes_ptr + local, code, mask=row_ok[:, None])
    scales_ptr += first_row
    tl.store(scales_ptr + rows, stored.to(scales_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def decode_block_values(
    codes_ptr, values_ptr, rows, row_ok,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    PLANE0: tl.constexpr, PLANE1: tl.constexpr, FP8_DTYPE: tl.constexpr,
):  # fmt: skip
    """[ROWS, BLOCK] fp32 code values (before the block scale) of the rows at ``codes_ptr``.

    Shared by dequantize and the fused optimizer step (agoq/kernels/optim.py). ``values_ptr`` is the
    per-code value table for nf / cint / cuint (agoq.ref.quant.ref_code_values; 16 or 256 entries)."""
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    p0_bytes: tl.constexpr = BLOCK * PLANE0 // 8
    c0 = tl.arange(0, p0_bytes)
    b0 = tl.load(codes_ptr + rows[:, None] * row_bytes + c0[None, :], mask=row_ok[:, None], other=0)
    code = _unpack_plane(b0.to(tl.int32), ROWS, BLOCK, PLANE0)
    if PLANE1 > 0:
        p1_bytes: tl.constexpr = BLOCK * PLANE1 // 8
        c1 = tl.arange(0, p1_bytes)
        b1 = tl.load(codes_ptr + rows[:, None] * row_bytes + p0_bytes + c1[None, :], mask=row_ok[:, None], other=0)
        code = code | (_unpack_plane(b1.to(tl.int32), ROWS, BLOCK, PLANE1) << PLANE0)
    if KIND == 0:
        v = (code - 2 ** (BITS - 1)).to(tl.float32)
    elif KIND == 2:
        v = code.to(tl.uint8).to(FP8_DTYPE, bitcast=True).to(tl.float32)
    else:
        v = tl.load(values_ptr + code)
    return v


@triton.jit
def _dequantize_fwd_kernel(
    codes_ptr,  # uint8 packed codes, num_blocks * BLOCK * BITS // 8
    scales_ptr,  # fp32 / fp16 / uint8 (pow2), num_blocks
    out_ptr,  # out: bf16/fp16/fp32, numel elements
    values_ptr,  # fp32 value of every code (nf, cint, cuint lookup table; agoq.ref.ref_code_values)
    numel,  # int: number of valid output elements
    num_blocks,  # int
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,  # unused (same constexpr table as quantize)
    QMAX: tl.constexpr,  # unused
    PLANE0: tl.constexpr,
    PLANE1: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
):
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    rows = tl.arange(0, ROWS)
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    codes_ptr += first_row * row_bytes
    scales_ptr += first_row
    # -- scales ----------------------------------------------------------------------------------
    if SCALE == 2:
        s = _pow2_value(tl.load(scales_ptr + rows, mask=row_ok, other=127).to(tl.int32))
    else:
        s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    # -- unpack codes, map to values ------------------------------------------------------------
    v = decode_block_values(codes_ptr, values_ptr, rows, row_ok, KIND, BITS, BLOCK, ROWS, PLANE0, PLANE1, FP8_DTYPE)
    y = v * s[:, None]
    if KIND == 4:
        y = y * y
    elem_base = first_row * BLOCK
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    elems_left = tl.minimum(numel - elem_base, ROWS * BLOCK).to(tl.int32)
    tl.store(out_ptr + elem_base + local, y.to(out_ptr.dtype.element_ty), mask=local < elems_left)


def quantize(x: torch.Tensor, fmt: QuantFormat | str, *, seed: int | None = None) -> QuantizedTensor:
    """Triton twin of agoq.ref.quant.ref_quantize (identical codes and scales)."""
    fmt = parse_format(fmt)
    return quantize_with_config(x, fmt, _launch.quant_config(fmt), seed=seed)


def quantize_with_config(
    x: torch.Tensor, fmt: QuantFormat | str, config: _launch.QuantConfig, *, seed: int | None = None
) -> QuantizedTensor:
    """quantize with an explicit launch config (scripts/bench_quant.py --sweep); codes never depend
    on the config, only speed does."""
    fmt = parse_format(fmt)
    check_input(x, fmt, seed)
    if not fmt.quantized or x.numel() == 0:
        return ref_quantize(x, fmt, seed=seed)  # a plain cast (or nothing): no kernel needed
    x_flat = x.detach().reshape(-1).contiguous()
    num_blocks = fmt.num_blocks(x.numel())
    codes_u8 = torch.empty(fmt.code_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_blocks, dtype=_launch.TORCH_SCALE_DTYPES[fmt.scale], device=x.device)
    rows = _launch.rows_for(fmt, config.elems_per_program)
    grid = (triton.cdiv(num_blocks, rows),)
    ce = _launch.constexprs(fmt)
    if _launch.uses_bytes_kernel(fmt):
        _quantize_bytes_kernel[grid](
            x_flat, codes_u8, scales, x.numel(), num_blocks, num_warps=config.num_warps,
            enable_fp_fusion=False, KIND=ce["KIND"], BLOCK=fmt.block, ROWS=rows, SCALE=ce["SCALE"],
            QMAX=ce["QMAX"], FP8_DTYPE=ce["FP8_DTYPE"],
        )  # fmt: skip
    else:
        _quantize_fwd_kernel[grid](
            x_flat, codes_u8, scales, _launch.nf4_lut(str(x.device)), x.numel(), num_blocks,
            _launch.seed_mix(seed), num_warps=config.num_warps, enable_fp_fusion=False, ROWS=rows,
            SUB=_launch.SUB_ELEMS, **ce,
        )  # fmt: skip
    return QuantizedTensor(codes_u8, scales, fmt, x.shape, x.dtype)


def dequantize(q: QuantizedTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton twin of agoq.ref.quant.ref_dequantize."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if not q.fmt.quantized or q.numel == 0 or out_dtype not in _launch.TL_OUT_DTYPES:
        return ref_dequantize(q, out_dtype)  # plain cast, empty, or the reference's dtype error
    fmt = q.fmt
    out = torch.empty(q.shape, dtype=out_dtype, device=q.codes.device)
    num_blocks = fmt.num_blocks(q.numel)
    values_f32 = _launch.code_values(fmt, str(q.codes.device))
    rows = _launch.rows_for(fmt, _launch.DEQUANT_ELEMS_PER_PROGRAM)
    _dequantize_fwd_kernel[(triton.cdiv(num_blocks, rows),)](
        q.codes, q.scales, out, values_f32, q.numel, num_blocks,
        num_warps=_launch.DEQUANT_NUM_WARPS, enable_fp_fusion=False, ROWS=rows, **_launch.constexprs(fmt),
    )  # fmt: skip
    return out
