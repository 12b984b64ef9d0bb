"""Shared Triton math of the quantize kernels: rounding, scales, NF4 codes, stochastic-rounding hash.

Every function mirrors one step of agoq.ref.quant bit for bit (see each docstring for how); the
kernels in agoq/kernels/quant.py, _quant_tile.py and optim.py compose them.
"""

import triton
import triton.language as tl

# Inline PTX on GPU; Triton's CPU interpreter cannot run it, so there the functions below take their
# tl.* twins. Whether Triton interprets is Triton's setting (TRITON_INTERPRET, which Triton reads): ask Triton
# (triton.knobs.runtime.interpret, what its @triton.jit consults when it decorates the kernels below, at import
# as here); agoq reads no environment. agoq/kernels/fastlaunch.py needs triton.knobs too.
if not hasattr(triton, "knobs"):
    raise ImportError(f"agoq.kernels needs a Triton with triton.knobs (Triton 3.6 and 3.8 are tested); found "
                      f"triton {triton.__version__}")
USE_PTX = tl.constexpr(not triton.knobs.runtime.interpret)

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
def saturate(y, OUT_DTYPE: tl.constexpr):
    """agoq.ref.quant.saturate: fp32 y clamped to +-(OUT_DTYPE's largest finite value), NaN kept (a
    compare with NaN is false, so NaN passes the where; fmin / fmax would drop it)."""
    if OUT_DTYPE == tl.float16:
        lim = 65504.0
    elif OUT_DTYPE == tl.bfloat16:
        lim = 3.3895313892515355e38  # (2 - 2**-7) * 2**127, exact in fp32
    else:
        lim = 3.4028234663852886e38  # fp32 max
    return tl.where(tl.abs(y) > lim, tl.where(y < 0, -lim, lim), y)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


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
def gather_nc(table_ptr, index):
    """table_ptr[index] for a small read-only table (4- or 8-byte entries), elementwise.

    GPU: inline ``ld.global.nc``. A ``tl.load`` gather is a layout anchor for Triton's coalescing pass,
    which gives it a one-element-per-thread layout and then moves the surrounding tile through shared
    memory into it (Triton 3.6; benchmarks/xc_quant.py shows the conversions); inline asm is elementwise
    and keeps the tile's layout. Interpreter: the ``tl.load`` twin."""
    if USE_PTX:
        ty = table_ptr.dtype.element_ty
        addr = table_ptr.to(tl.int64) + index.to(tl.int64) * (ty.primitive_bitwidth // 8)
        if ty.primitive_bitwidth == 64:
            v = tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1];", "=l,l", [addr], dtype=ty, is_pure=True, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [addr], dtype=ty, is_pure=True, pack=1)
    else:
        v = tl.load(table_ptr + index)
    return v


@triton.jit
def _nf4_code(p, nf4_lut_ptr):
    """#(NF4 midpoints < p) (ties to the lower code, as searchsorted) from a 32-bucket table.

    Bucket b = trunc(16 p + 16) (clamped to 31) covers [-1 + b/16, -1 + (b+1)/16), narrower than the
    smallest gap between NF4 midpoints (0.085), so it holds at most one midpoint thr[b] (+inf if
    none) and code = below[b] + (p > thr[b]). One int64 entry per bucket holds both (thr's fp32 bits
    low, below high): one convert and one 8-byte L1-resident gather per element. _launch.nf4_lut
    builds the table; tests check it against searchsorted around every bucket edge and midpoint.

    The gather is gather_nc (inline PTX on GPU, see there).

    p is clamped to [-1, 1] first (every midpoint lies inside, so the code is unchanged): an fp16
    scale can round below absmax (subnormal scales lose up to a third, |p| < 1.5), and an unclamped
    p < -1.0625 made 16 p + 16 negative, which the unsigned clamp sent to the top bucket, i.e. code
    15 (+1) for the most negative element. NaN p (non-finite blocks, whose codes are
    replaced) clamps to a finite value, as fmax / fmin return the non-NaN operand.
    """
    pc = tl.minimum(tl.maximum(p, -1.0), 1.0)
    bucket = tl.minimum((pc * 16.0 + 16.0).to(tl.int32), 31)  # pc in [-1, 1]: 16 pc + 16 in [0, 32]
    entry = gather_nc(nf4_lut_ptr, bucket)
    thr = entry.to(tl.int32).to(tl.float32, bitcast=True)  # low 32 bits
    below = (entry >> 32).to(tl.int32)
    return below + (p > thr).to(tl.int32)


@triton.jit
def _int_code(p, local_u32, base_mul, KIND: tl.constexpr, BITS: tl.constexpr, SCALE: tl.constexpr,
              STOCHASTIC: tl.constexpr, QMAX: tl.constexpr):  # fmt: skip
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
        y = _div_unit(pc * 2.0, tl.abs(pc) + 1.0) * 127.0  # |y| <= 127: the ref clamp is a no-op
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
def _div_unit(num, den):
    """Correctly rounded num / den for den in [1, 2] and |num| <= 2 (cint's softsign).

    GPU: the fast path of the CUDA division (reciprocal estimate, one Newton step, quotient, residual,
    corrected quotient: the MUFU.RCP + 5 FFMA sequence ptxas emits for div.rn.f32) without its
    range check (FCHK) and slow-path call, which only matter for huge / tiny operands or quotients:
    here either |num| >= 2**-23 (normal, quotient normal) or den == 1.0 exactly (|num| < 2**-23 makes
    1 + |num| round to 1), where the estimate of 1 / 1 is exact and the quotient is num itself.
    Interpreter: tl.math.div_rn."""
    if USE_PTX:
        y0 = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [den], dtype=tl.float32,
                                       is_pure=True, pack=1)  # fmt: skip
        y1 = tl.fma(y0, tl.fma(-den, y0, 1.0), y0)
        q0 = num * y1
        q = tl.fma(y1, tl.fma(-den, q0, num), q0)
    else:
        q = tl.math.div_rn(num, den)
    return q
