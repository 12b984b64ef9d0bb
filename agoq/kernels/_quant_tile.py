"""The tile quantize kernel: ROWS whole blocks per program, absmax + scale + codes + bit-plane packing
in registers, one read of the input (agoq.kernels.quant.quantize_with_config launches it).

Layout notes (Triton 3.6, checked with benchmarks/xc_quant.py): every load and store is written with
offsets that are contiguous along the tile's last axis, because Triton's coalescing pass orders a
tensor's threads by the contiguity it can prove; offsets it cannot prove contiguous (a [ROWS, G, SUB]
view, a bit-cast byte-pointer tensor, a gather) make it spread a warp over 32 rows (strided, slow).
"""

import triton
import triton.language as tl

from agoq.kernels._quant_math import _encode_scale, _int_code, _max_nan, _nf4_code


@triton.jit
def _pack_words(plane, ROWS: tl.constexpr, W: tl.constexpr, WIDTH: tl.constexpr, SUB: tl.constexpr):
    """[ROWS, W] codes < 2**WIDTH -> [ROWS, W / SUB] int32 words of SUB consecutive codes, code k at
    bit WIDTH * k (the pack_codes layout). SUB codes are the elements one thread loaded with one
    16-byte load, so the view [ROWS, W / SUB, SUB] and the sum stay in registers."""
    shifts = (tl.arange(0, SUB) * WIDTH)[None, None, :]
    return tl.sum(tl.reshape(plane, [ROWS, W // SUB, SUB]) << shifts, axis=2)  # disjoint fields: sum = OR


@triton.jit
def _interleave(w0, w1, w2, w3, SPLIT: tl.constexpr):
    """Words of the SPLIT parts ([ROWS, N] each; part J holds chunks m * SPLIT + J) in block order."""
    if SPLIT == 1:
        w = w0
    elif SPLIT == 2:
        w = tl.join(w0, w1)  # [ROWS, N, 2]: [.., m, j] = part j's word m
        w = tl.reshape(w, [w.shape[0], w.shape[1] * 2])
    else:
        w = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [.., m, a, b] = part 2a + b's word m
        w = tl.reshape(w, [w.shape[0], w.shape[1] * 4])
    return w


@triton.jit
def _store_words(codes_ptr, word, bad, rows, row_ok, ROW_BYTES: tl.constexpr, PLANE_OFF: tl.constexpr,
                 WIDTH: tl.constexpr, SUB: tl.constexpr, BAD_FIELD: tl.constexpr):  # fmt: skip
    """Store [ROWS, NW] packed words of one sub-byte plane at byte PLANE_OFF of every row; rows flagged
    ``bad`` store BAD_FIELD in every field instead."""
    WB: tl.constexpr = SUB * WIDTH // 8  # bytes per word
    BAD_WORD: tl.constexpr = BAD_FIELD * (((1 << (WIDTH * SUB)) - 1) // ((1 << WIDTH) - 1))
    # as a signed value of the word's width (the stored bits are the same)
    BAD_SIGNED: tl.constexpr = BAD_WORD - (1 << (8 * WB)) if BAD_WORD >= (1 << (8 * WB - 1)) else BAD_WORD
    word = tl.where(bad[:, None], BAD_SIGNED, word)
    # word pointers from a word-typed base: row and plane offsets are whole words (block * bits / 8 and
    # block * PLANE0 / 8 are multiples of 4 for block >= 32), so Triton's axis analysis sees the words
    # of a row as contiguous (a bit-cast byte-pointer tensor hides that, and Triton then spreads a
    # warp's stores over 32 rows)
    if WB == 4:
        wbase = codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        word = word.to(tl.int32)
    elif WB == 2:
        wbase = codes_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        word = word.to(tl.int16)
    else:
        wbase = codes_ptr
        word = word.to(tl.uint8)
    ptrs = wbase + (rows * (ROW_BYTES // WB) + PLANE_OFF // WB)[:, None] + tl.arange(0, word.shape[1])[None, :]
    tl.store(ptrs, word, mask=row_ok[:, None])


@triton.jit
def _load_part(x_ptr, elem_base, elems_left, rows, BLOCK: tl.constexpr, SUB: tl.constexpr,
               SPLIT: tl.constexpr, J: tl.constexpr, KIND: tl.constexpr):  # fmt: skip
    """Part J of the program's [ROWS, BLOCK] tile: chunks J, J + SPLIT, J + 2 SPLIT, ... (SUB elements
    each) of every row, as fp32 [ROWS, BLOCK / SPLIT], with their in-program offsets and columns.

    Triton gives each thread one SUB-element (16-byte) vector per part, and SPLIT parts give it SPLIT
    consecutive chunks of one row: the per-block work (scale, reciprocal) is then shared by SPLIT * SUB
    elements instead of SUB, while a warp's loads still cover whole 32-byte sectors between its parts.
    SPLIT = 1 is the plain tile, contiguous along rows: a warp reads whole 512-byte spans."""
    W: tl.constexpr = BLOCK // SPLIT
    c = tl.arange(0, W)
    if SPLIT == 1:
        col = c
    else:
        col = (c // SUB) * (SUB * SPLIT) + J * SUB + c % SUB
    local = rows[:, None] * BLOCK + col[None, :]
    x = tl.load(x_ptr + elem_base + local, mask=local < elems_left, other=0.0).to(tl.float32)
    if KIND == 4:
        x = tl.math.sqrt_rn(x)  # negative -> NaN -> non-finite block
    return x, local, col


@triton.jit
def _part_codes(x, local, col, inv, bad, codes_ptr, rows, row_ok, nf4_lut_ptr, base_mul,
                KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                SCALE: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr, PLANE0: tl.constexpr,
                PLANE1: tl.constexpr, FP8_DTYPE: tl.constexpr, SUB: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """Codes of one part of the tile (_load_part). Whole-byte codes are stored here (their part
    columns are 16-byte runs: no repacking needed); sub-byte planes come back as packed words
    (plane 0, plane 1) for the caller to interleave and store."""
    # A non-finite block gets p = 0, agoq.ref's value. Sub-byte planes apply it once per packed word
    # in _store_words (inv = 0 here, so p is 0 or NaN until then); whole-byte codes here.
    p = x * inv[:, None]
    if PLANE0 == 8:
        p = tl.where(bad[:, None], 0.0, p)
    if KIND == 1:
        code = _nf4_code(p, nf4_lut_ptr)
    elif KIND == 2:
        y = tl.minimum(tl.maximum(p, -QMAX), QMAX)
        code = y.to(FP8_DTYPE).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = _int_code(p, local.to(tl.uint32), base_mul, KIND, BITS, SCALE, STOCHASTIC, QMAX)
    W: tl.constexpr = BLOCK // SPLIT
    if PLANE0 == 8:
        ptrs = codes_ptr + (rows * BLOCK)[:, None] + col[None, :]
        tl.store(ptrs, code.to(tl.uint8), mask=row_ok[:, None])
        w0 = code  # unused
        w1 = code
    elif PLANE1 > 0:  # codes of finite blocks are < 2**BITS: only the low plane needs a mask
        w0 = _pack_words(code & ((1 << PLANE0) - 1), ROWS, W, PLANE0, SUB)
        w1 = _pack_words(code >> PLANE0, ROWS, W, PLANE1, SUB)
    else:
        w0 = _pack_words(code, ROWS, W, PLANE0, SUB)
        w1 = w0  # unused
    return w0, w1


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
    SPLIT: tl.constexpr,  # 1, 2 or 4 parts per tile (_load_part): chunks per thread and row
):
    # -- load ROWS whole blocks as a [ROWS, BLOCK] tile in SPLIT parts (_load_part). Offsets are
    # contiguous along the last axis, so Triton gives each thread 16-byte vector loads (a [ROWS, G,
    # SUB] view made Triton spread a warp over 32 rows: strided, slow). 64-bit program base, 32-bit
    # offsets inside the program (cheaper per-element address math).
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    elem_base = first_row * BLOCK
    rows = tl.arange(0, ROWS)
    elems_left = tl.minimum(numel - elem_base, ROWS * BLOCK).to(tl.int32)
    x0, l0, c0 = _load_part(x_ptr, elem_base, elems_left, rows, BLOCK, SUB, SPLIT, 0, KIND)
    # -- absmax (NaN-propagating max: a NaN or Inf element makes the block non-finite), scale --------
    absmax = tl.reduce(tl.abs(x0), 1, _max_nan)
    if SPLIT >= 2:
        x1, l1, c1 = _load_part(x_ptr, elem_base, elems_left, rows, BLOCK, SUB, SPLIT, 1, KIND)
        absmax = _max_nan(absmax, tl.reduce(tl.abs(x1), 1, _max_nan))
    if SPLIT == 4:
        x2, l2, c2 = _load_part(x_ptr, elem_base, elems_left, rows, BLOCK, SUB, SPLIT, 2, KIND)
        x3, l3, c3 = _load_part(x_ptr, elem_base, elems_left, rows, BLOCK, SUB, SPLIT, 3, KIND)
        absmax = _max_nan(absmax, _max_nan(tl.reduce(tl.abs(x2), 1, _max_nan), tl.reduce(tl.abs(x3), 1, _max_nan)))
    bad = (absmax != absmax) | (absmax == float("inf"))
    if QMAX == 1.0:
        raw = absmax  # nf, cint, cuint: absmax / 1 is exact
    else:
        raw = tl.math.div_rn(absmax, QMAX)
    stored, s = _encode_scale(raw, SCALE)
    bad = bad | (s != s) | (s == float("inf"))
    inv = tl.where((s > 0) & (~bad), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
    # -- codes, packed bit planes ---------------------------------------------------------------
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    codes_ptr += first_row * row_bytes
    base_mul = (elem_base.to(tl.uint32) + seed_mix.to(tl.uint32, bitcast=True)) * 0x85EBCA6B  # SR only
    a0, b0 = _part_codes(x0, l0, c0, inv, bad, codes_ptr, rows, row_ok, nf4_lut_ptr, base_mul, KIND, BITS,
                         BLOCK, ROWS, SCALE, STOCHASTIC, QMAX, PLANE0, PLANE1, FP8_DTYPE, SUB, SPLIT)  # fmt: skip
    a1, b1, a2, b2, a3, b3 = a0, b0, a0, b0, a0, b0  # placeholders for SPLIT < 4
    if SPLIT >= 2:
        a1, b1 = _part_codes(x1, l1, c1, inv, bad, codes_ptr, rows, row_ok, nf4_lut_ptr, base_mul, KIND,
                             BITS, BLOCK, ROWS, SCALE, STOCHASTIC, QMAX, PLANE0, PLANE1, FP8_DTYPE, SUB,
                             SPLIT)  # fmt: skip
    if SPLIT == 4:
        a2, b2 = _part_codes(x2, l2, c2, inv, bad, codes_ptr, rows, row_ok, nf4_lut_ptr, base_mul, KIND,
                             BITS, BLOCK, ROWS, SCALE, STOCHASTIC, QMAX, PLANE0, PLANE1, FP8_DTYPE, SUB,
                             SPLIT)  # fmt: skip
        a3, b3 = _part_codes(x3, l3, c3, inv, bad, codes_ptr, rows, row_ok, nf4_lut_ptr, base_mul, KIND,
                             BITS, BLOCK, ROWS, SCALE, STOCHASTIC, QMAX, PLANE0, PLANE1, FP8_DTYPE, SUB,
                             SPLIT)  # fmt: skip
    if PLANE0 < 8:
        # code of p = 0 (non-finite blocks): int 2**(bits-1), nf 7 (NF4's exact zero), cint 128, else 0
        ZERO: tl.constexpr = 2 ** (BITS - 1) if KIND == 0 else (7 if KIND == 1 else (128 if KIND == 3 else 0))
        _store_words(codes_ptr, _interleave(a0, a1, a2, a3, SPLIT), bad, rows, row_ok, row_bytes, 0, PLANE0, SUB,
                     ZERO & ((1 << PLANE0) - 1))  # fmt: skip
        if PLANE1 > 0:
            _store_words(codes_ptr, _interleave(b0, b1, b2, b3, SPLIT), bad, rows, row_ok, row_bytes,
                         BLOCK * PLANE0 // 8, PLANE1, SUB, ZERO >> PLANE0)  # fmt: skip
    scales_ptr += first_row
    if SCALE == 2:
        stored = tl.where(bad, 255, stored).to(tl.uint8)
    else:
        stored = tl.where(bad, float("nan"), stored.to(tl.float32)).to(scales_ptr.dtype.element_ty)
    tl.store(scales_ptr + rows, stored, mask=row_ok)
