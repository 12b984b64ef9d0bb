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
MIN_NORMAL = tl.constexpr(2.0**-126)  # agoq.ref.quant.FP32_SCALE_MIN
SIGN_BIT = tl.constexpr(-(2**31))


@triton.jit
def _round_half_away_i32(y):
    half = ((y.to(tl.int32, bitcast=True) & SIGN_BIT) | HALF_BELOW_BITS).to(tl.float32, bitcast=True)
    return (y + half).to(tl.int32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _hash_uniform(local_u32, base_mul):
    """agoq.ref.quant.hash_uniform on uint32 lanes (wrap-around arithmetic). The first multiply of
    (flat index + seed mix) is split as in-program offset * HASH_MUL1 + base_mul, where base_mul =
    (program's first index + seed mix) * HASH_MUL1 is one scalar: a single IMAD per element. The
    uniform is built from its bits, 1.m - 1 with the 23 top hash bits as m (no int->float convert)."""
    h = local_u32 * 0x85EBCA6B + base_mul.to(tl.uint32, bitcast=True)
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return ((h >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _nf4_code(p, nf4_lut_ptr, PTX: tl.constexpr):
    """#(NF4 midpoints < p) (ties to the lower code, as searchsorted) from a 32-bucket table.

    Bucket b = trunc(16 p + 16) (clamped to 31) covers [-1 + b/16, -1 + (b+1)/16), narrower than the
    smallest gap between NF4 midpoints (0.085), so it holds at most one midpoint thr[b] (+inf if
    none) and code = below[b] + (p > thr[b]). One int64 entry per bucket holds both (thr's fp32 bits
    low, below high): one convert and one 8-byte L1-resident gather per element. _launch.nf4_lut
    builds the table; tests check it against searchsorted around every bucket edge and midpoint.

    PTX (GPU): the gather is an inline ``ld.global.nc.b64``. A ``tl.load`` gather would be a
    layout anchor for Triton's coalescing pass, which then moves the whole fp32 tile through shared
    memory into a one-element-per-thread layout (Triton 3.6, scripts/xc_quant.py shows it); inline
    asm is elementwise and keeps the tile's layout. The interpreter runs the ``tl.load`` twin.
    """
    bucket = tl.minimum((p * 16.0 + 16.0).to(tl.int32).to(tl.uint32), 31).to(tl.int32)  # NaN-safe
    if PTX:
        addr = nf4_lut_ptr.to(tl.int64) + bucket.to(tl.int64) * 8
        entry = tl.inline_asm_elementwise(
            "ld.global.nc.b64 $0, [$1];", "=l,l", [addr], dtype=tl.int64, is_pure=True, pack=1
        )
    else:
        entry = tl.load(nf4_lut_ptr + bucket)
    thr = entry.to(tl.int32).to(tl.float32, bitcast=True)  # low 32 bits
    below = (entry >> 32).to(tl.int32)
    return below + (p > thr).to(tl.int32)


@triton.jit
def _store_plane(codes_ptr, plane, bad, rows, row_ok, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                 ROW_BYTES: tl.constexpr, PLANE_OFF: tl.constexpr, WIDTH: tl.constexpr, SUB: tl.constexpr,
                 BAD_FIELD: tl.constexpr):  # fmt: skip
    """Store one bit plane of [ROWS, BLOCK] codes (< 2**WIDTH) at byte PLANE_OFF of every row; rows
    flagged ``bad`` store BAD_FIELD in every field instead.

    Sub-byte planes: the tile is viewed as [ROWS, BLOCK/SUB, SUB] (SUB consecutive codes, the
    elements one thread loaded with one 16-byte load) and packed in registers with shifts and a sum
    into one WIDTH*SUB-bit little-endian word per chunk: code k at bit WIDTH*k (pack_codes layout)."""
    if WIDTH == 8:
        plane = tl.where(bad[:, None], BAD_FIELD, plane)
        ptrs = codes_ptr + (rows * ROW_BYTES + PLANE_OFF)[:, None] + tl.arange(0, BLOCK)[None, :]
        tl.store(ptrs, plane.to(tl.uint8), mask=row_ok[:, None])
    else:
        G: tl.constexpr = BLOCK // SUB
        shifts = (tl.arange(0, SUB) * WIDTH)[None, None, :]
        word = tl.sum(tl.reshape(plane, [ROWS, G, SUB]) << shifts, axis=2)  # disjoint fields: sum = OR
        WB: tl.constexpr = SUB * WIDTH // 8  # bytes per word
        BAD_WORD: tl.constexpr = BAD_FIELD * (((1 << (WIDTH * SUB)) - 1) // ((1 << WIDTH) - 1))
        # as a signed value of the word's width (the stored bits are the same)
        BAD_SIGNED: tl.constexpr = BAD_WORD - (1 << (8 * WB)) if BAD_WORD >= (1 << (8 * WB - 1)) else BAD_WORD
        word = tl.where(bad[:, None], BAD_SIGNED, word)
        # word pointers from a word-typed base: row and plane offsets are whole words (block * bits / 8
        # and block * PLANE0 / 8 are multiples of 4 for block >= 32), so Triton's axis analysis sees
        # the words of a row as contiguous (a bit-cast byte-pointer tensor hides that, and Triton then
        # spreads a warp's stores over 32 rows)
        if WB == 4:
            wbase = codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            word = word.to(tl.int32)
        elif WB == 2:
            wbase = codes_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
            word = word.to(tl.int16)
        else:
            wbase = codes_ptr
            word = word.to(tl.uint8)
        ptrs = wbase + (rows * (ROW_BYTES // WB) + PLANE_OFF // WB)[:, None] + tl.arange(0, G)[None, :]
        tl.store(ptrs, word, mask=row_ok[:, None])


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
        s = tl.where(raw > 0, tl.maximum(raw, MIN_NORMAL), raw)  # 1 / s stays finite
        stored = s
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
    nf4_lut_ptr,  # int64 [32]: NF4 bucket threshold bits | base code << 32 (_launch.nf4_lut); KIND == 1
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
    SUB: tl.constexpr,  # codes per packed word of a sub-byte plane (8: one 16-byte bf16 load)
    PTX: tl.constexpr,  # inline PTX (GPU) or its tl.* twin (interpreter): NF4 gather, cint division
):
    # -- load ROWS whole blocks as a [ROWS, BLOCK] tile: addresses are contiguous along the tile's
    # last axis, so Triton gives each thread 16-byte vector loads and a warp whole 512-byte spans
    # (a [ROWS, G, SUB] view at load time made Triton spread a warp over 32 rows: strided, slow).
    # 64-bit program base, 32-bit offsets inside the program (cheaper per-element address math).
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    elem_base = first_row * BLOCK
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    elems_left = tl.minimum(numel - elem_base, ROWS * BLOCK).to(tl.int32)
    x = tl.load(x_ptr + elem_base + local, mask=local < elems_left, other=0.0).to(tl.float32)
    if KIND == 4:
        x = tl.math.sqrt_rn(x)  # negative -> NaN -> non-finite block
    # -- absmax (NaN-propagating max: a NaN or Inf element makes the block non-finite), scale --------
    absmax = tl.reduce(tl.abs(x), 1, _max_nan)
    bad = (absmax != absmax) | (absmax == float("inf"))
    if QMAX == 1.0:
        raw = absmax  # nf, cint, cuint: absmax / 1 is exact
    else:
        raw = tl.math.div_rn(absmax, QMAX)
    stored, s = _encode_scale(raw, SCALE)
    bad = bad | (s != s) | (s == float("inf"))
    inv = tl.where((s > 0) & (~bad), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
    # A non-finite block has inv = 0, so its p is 0 or NaN; its codes are replaced by the code of
    # p = 0 (agoq.ref's value for such blocks) once per packed word in _store_plane, not per element.
    p = x * inv[:, None]
    # -- codes ----------------------------------------------------------------------------------
    if KIND == 1:
        code = _nf4_code(p, nf4_lut_ptr, PTX)
    elif KIND == 2:
        y = tl.minimum(tl.maximum(p, -QMAX), QMAX)
        code = y.to(FP8_DTYPE).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        base_mul = (elem_base.to(tl.uint32) + seed_mix.to(tl.uint32, bitcast=True)) * 0x85EBCA6B
        code = _int_code(p, local.to(tl.uint32), base_mul, KIND, BITS, SCALE, STOCHASTIC, QMAX, PTX)
    # -- pack bit planes and store -------------------------------------------------------------
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    codes_ptr += first_row * row_bytes
    # code of p = 0 (non-finite blocks): int 2**(bits-1), nf 7 (NF4's exact zero), cint 128, else 0
    ZERO: tl.constexpr = 2 ** (BITS - 1) if KIND == 0 else (7 if KIND == 1 else (128 if KIND == 3 else 0))
    if PLANE1 > 0:  # codes of finite blocks are < 2**BITS: only the low plane needs a mask
        plane0 = code & ((1 << PLANE0) - 1)
    else:
        plane0 = code
    _store_plane(codes_ptr, plane0, bad, rows, row_ok, ROWS, BLOCK, row_bytes, 0, PLANE0, SUB,
                 ZERO & ((1 << PLANE0) - 1))  # fmt: skip
    if PLANE1 > 0:
        _store_plane(codes_ptr, code >> PLANE0, bad, rows, row_ok, ROWS, BLOCK, row_bytes, BLOCK * PLANE0 // 8,
                     PLANE1, SUB, ZERO >> PLANE0)  # fmt: skip
    scales_ptr += first_row
    if SCALE == 2:
        stored = tl.where(bad, 255, stored).to(tl.uint8)
    else:
        stored = tl.where(bad, float("nan"), stored.to(tl.float32)).to(scales_ptr.dtype.element_ty)
    tl.store(scales_ptr + rows, stored, mask=row_ok)


@triton.jit
def _int_code(p, local_u32, base_mul, KIND: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr,
              STOCHASTIC: tl.constexpr, QMAX: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Signed-offset codes of int (KIND 0), cint (3) and cuint (4), with agoq.ref's rounding and clamps.

    Round to nearest of int with fp32 or pow2 scales skips the clamp: then s >= absmax / qmax
    (rounded) and 1 / s is finite (fp32 scales are >= 2**-126), so |p| <= qmax * (1 + 3 * 2**-24)
    rounds to at most qmax. fp16 scales can round down (and go subnormal): clamped as in agoq.ref.
    """
    if KIND == 0:
        y = p
        lim = QMAX
    elif KIND == 3:
        pc = tl.minimum(tl.maximum(p, -1.0), 1.0)
        y = _div_unit(pc * 2.0, tl.abs(pc) + 1.0, PTX) * 127.0  # |y| <= 127: the ref clamp is a no-op
        lim = 127.0
    else:
        y = tl.minimum(tl.maximum(p, 0.0), 1.0) * 255.0
        lim = 255.0
    if STOCHASTIC:
        # floor(clamp(z)) == clamp(floor(z)) for an integer limit (floor is monotone)
        z = tl.minimum(tl.maximum(y + _hash_uniform(local_u32, base_mul), -lim), lim)
        r = tl.floor(z).to(tl.int32)
    elif KIND == 0 and SCALE == 1:
        r = _round_half_away_i32(tl.minimum(tl.maximum(y, -lim), lim))  # clamp before: same result
    else:
        r = _round_half_away_i32(y)  # int: see above; cint: |y| <= 127; cuint: 0 <= y <= 255
    offset: tl.constexpr = 2 ** (BITS - 1) if KIND == 0 else (128 if KIND == 3 else 0)
    return r + offset


@triton.jit
def _div_unit(num, den, PTX: tl.constexpr):
    """Correctly rounded num / den for den in [1, 2] and |num| <= 2 (cint's softsign).

    PTX: the fast path of the CUDA division (reciprocal estimate, one Newton step, quotient, residual,
    corrected quotient: the MUFU.RCP + 5 FFMA sequence ptxas emits for div.rn.f32) without its
    range check (FCHK) and slow-path call, which only matter for huge / tiny operands or quotients:
    here either |num| >= 2**-23 (normal, quotient normal) or den == 1.0 exactly (|num| < 2**-23 makes
    1 + |num| round to 1), where the estimate of 1 / 1 is exact and the quotient is num itself.
    Interpreter: tl.math.div_rn."""
    if PTX:
        y0 = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [den], dtype=tl.float32,
                                       is_pure=True, pack=1)  # fmt: skip
        y1 = tl.fma(y0, tl.fma(-den, y0, 1.0), y0)
        q0 = num * y1
        q = tl.fma(y1, tl.fma(-den, q0, num), q0)
    else:
        q = tl.math.div_rn(num, den)
    return q


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
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    codes_ptr += first_row * BLOCK
    tl.store(codes_ptr + local, code, mask=row_ok[:, None])
    scales_ptr += first_row
    if SCALE == 2:
        stored = tl.where(bad, 255, stored).to(tl.uint8)
    else:
        stored = tl.where(bad, float("nan"), stored.to(tl.float32)).to(scales_ptr.dtype.element_ty)
    tl.store(scales_ptr + rows, stored, mask=row_ok)


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
            SUB=_launch.SUB_ELEMS, PTX=not _launch.INTERPRET, **ce,
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
