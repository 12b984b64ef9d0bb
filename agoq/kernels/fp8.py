"""Fused FP8 casts for agoq.ops.fp8_linear: amax, scales, and one-pass casts into the GEMM layouts.

Each launcher has a same-signature twin in :mod:`agoq.ref.fp8` (results equal; FP8 codes checked on
GPU, see tests/kernels/test_fp8_kernels.py):

  fp8_amax_2d(x2d, rowcol=False)             -> amax [] | (amax_rows [M], amax_cols [N])
  fp8_scales(amax, variant, margin, pow2)    -> (scale, scale_inv), amax's shape
  fp8_cast_2d(x2d, variant, scale, scale_t=None, *, rowmajor=True, transposed=False, record_amax=False,
              amax_out=None)         -> (out [M,N] | None, out_t [N,M] | None, amax [] | None)
  fp8_history_update(history, amax, variant, margin, pow2, reset_amax=False)
                                             -> (new_history [L], scale [], scale_inv [])

How the FP8 linear uses them (``torch._scaled_mm`` wants a row-major ``a`` and a column-major ``b``,
so every operand is needed both as is and transposed; one read of the bf16 tensor writes both):

  delayed scaling  fp8_cast_2d(..., record_amax=True, amax_out=acc) with the history's scale: one pass
                   casts and max-accumulates this tensor's amax into a persistent accumulator;
                   fp8_history_update(..., reset_amax=True) folds it into the history, computes the
                   next scale and its inverse, and zeroes the accumulator (two launches per operand).
  current scaling  fp8_amax_2d (one read) -> fp8_scales -> fp8_cast_2d (one read, both layouts).
  row-wise         fp8_amax_2d(rowcol=True) gives the per-row and per-column amaxes in one read; the
                   cast writes the row-major copy with row scales and the transposed copy with
                   column scales (each GEMM scales along its own contraction dimension).

amax is reduced as int32 bits: for non-negative floats the bit pattern orders like the value, and a
NaN (|x| bits above +inf's) wins every max, so ``atomic_max`` on the bits is exact and NaN-propagating
(no float atomics, deterministic). Casts saturate (clamp to +-FP8_MAX, NaN kept) and round to nearest
even with the hardware conversion (``cvt.rn.satfinite``), as ``torch.Tensor.to(float8)`` after the
reference's clamp.

Interpreter note (TRITON_INTERPRET=1, Triton 3.8): the interpreter's fp32 -> fp8 cast is wrong for
values that must round (ties away from even, and a rounding carry into the next binade is lost, e.g.
125.98 -> 64 instead of 128; NaN -> 384). Values already on the FP8 grid convert exactly, so the
interpreter tests feed grid values; rounding and NaN codes are compared on GPU only.

Subnormal amax values (< 2**-126, a tensor that is zero for every practical purpose) are outside the
contract: a GPU that flushes subnormals may give scale 1 where the reference gives inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.formats import FP8_MAX

__all__ = ["fp8_amax_2d", "fp8_scales", "fp8_cast_2d", "fp8_history_update", "CAST_TILE"]

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ABS_MASK = tl.constexpr(0x7FFFFFFF)
EXP_MASK = tl.constexpr(0x7F800000)
SIGN_EXP_MASK = tl.constexpr(-8388608)  # 0xFF800000 as int32: sign and exponent, mantissa cleared
TWO_POW_24 = tl.constexpr(16777216.0)
TWO_POW_M24 = tl.constexpr(5.9604644775390625e-08)

# Launch shapes. Chosen, not swept: the cast tile is [CAST_TILE[0] rows, CAST_TILE[1] columns] with
# CAST_TILE[2] warps (a 64x64 bf16 tile is 8 KiB in, two 4 KiB fp8 tiles out; the transposed store goes
# through shared memory). benchmarks/bench_fp8.py reports each cast's bandwidth against a bf16 copy.
CAST_TILE = (64, 64, 4)
AMAX_BLOCK = 4096  # elements per step of the flat amax loop (4 warps, 32 per thread)
AMAX_MAX_PROGRAMS = 1024  # a grid-stride loop caps the programs, so at most 1024 atomics hit one word


def _variant(variant: str) -> None:
    if variant not in _TL_FP8:
        raise ValueError(f"FP8 variant {variant!r} unknown; use one of {sorted(_TL_FP8)}")


def _check_2d(x2d: torch.Tensor, name: str) -> torch.Tensor:
    if x2d.dim() != 2:
        raise ValueError(f"{name} takes a 2-D tensor, got shape {tuple(x2d.shape)}")
    if x2d.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} takes bf16/fp16/fp32, got {x2d.dtype}")
    return x2d.contiguous()


@triton.jit
def _abs_bits(x):
    """|x| (fp32) as int32 bits: ordered like |x| for finite and inf values; NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & ABS_MASK


@triton.jit
def _scale_from_amax(amax, FMAX_DIV: tl.constexpr, POW2: tl.constexpr):
    """agoq.ref.fp8.fp8_scale_from_amax, elementwise: FMAX_DIV / amax (correctly rounded), optionally
    rounded down to a power of two (mantissa cleared; subnormal ratios scaled up by 2**24 first so the
    clear is exact), 1 for amax 0, NaN for a non-finite amax."""
    ratio = tl.math.div_rn(tl.full(amax.shape, FMAX_DIV, tl.float32), amax)
    if POW2:
        bits = ratio.to(tl.int32, bitcast=True)
        normal = (bits & EXP_MASK) != 0
        floor_normal = (bits & SIGN_EXP_MASK).to(tl.float32, bitcast=True)
        up_bits = (ratio * TWO_POW_24).to(tl.int32, bitcast=True)
        floor_sub = (up_bits & SIGN_EXP_MASK).to(tl.float32, bitcast=True) * TWO_POW_M24
        ok = (ratio > 0) & (ratio < float("inf"))
        ratio = tl.where(ok, tl.where(normal, floor_normal, floor_sub), ratio)
    scale = tl.where(amax == 0, 1.0, ratio)
    finite = (amax == amax) & (tl.abs(amax) < float("inf"))
    return tl.where(finite, scale, float("nan"))


@triton.jit
def _sat_cast(v, FMAX: tl.constexpr, FP8: tl.constexpr):
    """Clamp to +-FMAX (NaN kept, as torch.clamp: both comparisons are false for NaN) and cast with
    round-to-nearest-even.

    The clamp is two compare-and-selects, not ``tl.minimum/tl.maximum(propagate_nan=ALL)``: with those
    (PTX ``min.NaN.f32`` / ``max.NaN.f32``) Triton 3.6 on sm_90 corrupted the *transposed* FP8 store
    of the same tile (a row of out_t all 0x7F for fp32 input, 64 x 64, e4m3, while the row-major
    store was right; triton-lang/triton#11111 reports the same pattern for e5m2). The PTX of the
    shared-memory transpose itself is correct (checked by simulating its addresses), so the fault is
    below PTX; the select form avoids it. Regression: tests/kernels/test_fp8_kernels.py
    ``test_cast_transposed_store_multiple_of_16_shapes*``."""
    v = tl.where(v > FMAX, FMAX, v)
    v = tl.where(v < -FMAX, -FMAX, v)
    return v.to(FP8)


@triton.jit
def _amax_flat_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    """max |x| over a flat tensor: grid-stride loop, running max of the bits, one atomic per program."""
    pid = tl.program_id(0)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid.to(tl.int64) * BLOCK, numel, step):
        idx = start + offs
        x = tl.load(x_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _amax_rowcol_kernel(x_ptr, rows_ptr, cols_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """Per-row and per-column max |x| of a [M, N] tensor in one read (atomics on the bits)."""
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (r[:, None] < M) & (c[None, :] < N)
    x = tl.load(x_ptr + r[:, None] * N + c[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    tl.atomic_max(rows_ptr + r, tl.max(bits, axis=1), mask=r < M)
    tl.atomic_max(cols_ptr + c, tl.max(bits, axis=0), mask=c < N)


@triton.jit
def _scales_kernel(amax_ptr, scale_ptr, scale_inv_ptr, n, FMAX_DIV: tl.constexpr, POW2: tl.constexpr,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    amax = tl.load(amax_ptr + i, mask=i < n, other=1.0)
    scale = _scale_from_amax(amax, FMAX_DIV, POW2)
    tl.store(scale_ptr + i, scale, mask=i < n)
    tl.store(scale_inv_ptr + i, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=i < n)


@triton.jit
def _cast_kernel(
    x_ptr,  # [M, N] bf16/fp16/fp32, row-major
    out_ptr,  # [M, N] fp8 (ROWMAJOR)
    out_t_ptr,  # [N, M] fp8 (TRANSPOSED)
    scale_ptr,  # fp32: one value, or [M] (ROW_SCALES) for the row-major output
    scale_t_ptr,  # fp32: one value, or [N] (COL_SCALES) for the transposed output
    amax_ptr,  # int32 bits of max |x| (RECORD_AMAX), zero-initialised by the launcher
    M, N,
    FMAX: tl.constexpr, FP8: tl.constexpr,
    ROW_SCALES: tl.constexpr, COL_SCALES: tl.constexpr, SHARED: tl.constexpr,
    ROWMAJOR: tl.constexpr, TRANSPOSED: tl.constexpr, RECORD_AMAX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """One read of a [BM, BN] tile: optional amax record, the row-major cast and the transposed cast
    (SHARED: both use the same scalar scale, so one cast serves both stores)."""
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (r[:, None] < M) & (c[None, :] < N)
    x = tl.load(x_ptr + r[:, None] * N + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if RECORD_AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
    if ROWMAJOR:
        if ROW_SCALES:
            s = tl.load(scale_ptr + r, mask=r < M, other=1.0)[:, None]
        else:
            s = tl.load(scale_ptr)
        q = _sat_cast(x * s, FMAX, FP8)
        tl.store(out_ptr + r[:, None] * N + c[None, :], q, mask=mask)
    if TRANSPOSED:
        if SHARED:
            qt = q
        else:
            if COL_SCALES:
                st = tl.load(scale_t_ptr + c, mask=c < N, other=1.0)[None, :]
            else:
                st = tl.load(scale_t_ptr)
            qt = _sat_cast(x * st, FMAX, FP8)
        tl.store(out_t_ptr + c[:, None] * M + r[None, :], tl.trans(qt), mask=tl.trans(mask))


@triton.jit
def _history_kernel(hist_ptr, amax_ptr, new_hist_ptr, scale_ptr, scale_inv_ptr, L, FMAX_DIV: tl.constexpr,
                    POW2: tl.constexpr, RESET_AMAX: tl.constexpr, BL: tl.constexpr):
    """new_history = [amax, history[:-1]]; scale (and 1 / scale) from max |new_history|; optionally
    zero the amax word for the next accumulation (one program)."""
    i = tl.arange(0, BL)
    prev = tl.load(hist_ptr + i - 1, mask=(i >= 1) & (i < L), other=0.0)
    amax = tl.load(amax_ptr + i * 0, mask=i == 0, other=0.0)  # the amax in lane 0, zeros elsewhere
    new = tl.where(i == 0, amax, prev)
    tl.store(new_hist_ptr + i, new, mask=i < L)
    top_bits = tl.max(tl.where(i < L, _abs_bits(new), 0), axis=0, keep_dims=True)
    scale = _scale_from_amax(top_bits.to(tl.float32, bitcast=True), FMAX_DIV, POW2)
    one = tl.arange(0, 1)
    tl.store(scale_ptr + one, scale)
    tl.store(scale_inv_ptr + one, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
    if RESET_AMAX:
        tl.store(amax_ptr + one, tl.zeros([1], dtype=tl.float32))


def _fmax_div(variant: str, margin: int) -> float:
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin={margin!r}: use an int >= 0")
    return FP8_MAX[variant] / 2.0**margin  # exact in fp32 (a power-of-two division)


def fp8_amax_2d(x2d: torch.Tensor, rowcol: bool = False):
    """Triton twin of agoq.ref.fp8.ref_fp8_amax_2d."""
    x = _check_2d(x2d, "fp8_amax_2d")
    m, n = x.shape
    if rowcol:
        rows = torch.zeros(m, dtype=torch.int32, device=x.device)
        cols = torch.zeros(n, dtype=torch.int32, device=x.device)
        if x.numel():
            bm, bn, warps = CAST_TILE
            _amax_rowcol_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](x, rows, cols, m, n, BM=bm, BN=bn,
                                                                           num_warps=warps)
        return rows.view(torch.float32), cols.view(torch.float32)
    amax = torch.zeros((), dtype=torch.int32, device=x.device)
    if x.numel():
        grid = (min(triton.cdiv(x.numel(), AMAX_BLOCK), AMAX_MAX_PROGRAMS),)
        _amax_flat_kernel[grid](x, amax, x.numel(), BLOCK=AMAX_BLOCK, num_warps=4)
    return amax.view(torch.float32)


def fp8_scales(amax_f32: torch.Tensor, variant: str, margin: int = 0,
               pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of agoq.ref.fp8.ref_fp8_scales."""
    _variant(variant)
    amax = amax_f32.to(torch.float32).contiguous()
    scale, scale_inv = torch.empty_like(amax), torch.empty_like(amax)
    n = amax.numel()
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _scales_kernel[(triton.cdiv(n, block),)](amax, scale, scale_inv, n, FMAX_DIV=_fmax_div(variant, margin),
                                                 POW2=bool(pow2), BLOCK=block, enable_fp_fusion=False)
    return scale, scale_inv


def fp8_cast_2d(x2d: torch.Tensor, variant: str, scale_f32: torch.Tensor, scale_t_f32: torch.Tensor | None = None,
                *, rowmajor: bool = True, transposed: bool = False, record_amax: bool = False,
                amax_out: torch.Tensor | None = None):
    """Triton twin of agoq.ref.fp8.ref_fp8_cast_2d: (out [M,N] | None, out_t [N,M] | None, amax | None).

    ``amax_out``: a 0-dim fp32 accumulator (>= 0 or NaN) that the cast max-accumulates into (in place)
    instead of a fresh zero; it is returned as the amax."""
    _variant(variant)
    x = _check_2d(x2d, "fp8_cast_2d")
    m, n = x.shape
    if scale_t_f32 is None:
        if scale_f32.dim() != 0:
            raise ValueError("scale_t is required when scale is per row (the transposed copy is scaled per column)")
        scale_t_f32 = scale_f32
    if scale_f32.shape not in ((), (m, 1)) or scale_t_f32.shape not in ((), (1, n)):
        raise ValueError(f"scale {tuple(scale_f32.shape)} must be () or ({m}, 1) and scale_t "
                         f"{tuple(scale_t_f32.shape)} () or (1, {n}) for x {tuple(x2d.shape)}")
    if scale_f32.dtype != torch.float32 or scale_t_f32.dtype != torch.float32:
        raise ValueError("fp8_cast_2d scales must be float32 (agoq.ref.fp8.fp8_scale_from_amax)")
    fp8 = _TORCH_FP8[variant]
    out = torch.empty((m, n), dtype=fp8, device=x.device) if rowmajor else None
    out_t = torch.empty((n, m), dtype=fp8, device=x.device) if transposed else None
    if amax_out is not None and (not record_amax or amax_out.shape != () or amax_out.dtype != torch.float32):
        raise ValueError("amax_out must be a 0-dim float32 accumulator and needs record_amax=True")
    if not record_amax:
        amax = None
    elif amax_out is not None:
        amax = amax_out.view(torch.int32)  # |amax| bits: the same order as the kernel's atomics
    else:
        amax = torch.zeros((), dtype=torch.int32, device=x.device)
    if x.numel() and (rowmajor or transposed or record_amax):
        scale, scale_t = scale_f32.contiguous(), scale_t_f32.contiguous()
        row_scales, col_scales = scale.dim() == 2, scale_t.dim() == 2
        shared = rowmajor and transposed and not row_scales and not col_scales and (
            scale.data_ptr() == scale_t.data_ptr())
        bm, bn, warps = CAST_TILE
        placeholder = scale  # unused pointer arguments still need a tensor
        # fp32 input with both layouts: two launches (row-major, then transposed). Triton 3.6 on sm_90
        # corrupted one of the two stores of the same fp32-loaded tile (a row of 0x7F codes, 64 x 64,
        # H100 2026-11-22 and -24, with min/max or compare-and-select clamps alike), while each layout
        # alone is right. fp32 operands are rare in bf16 training; bf16/fp16 keep the single pass.
        passes = [(True, False), (False, True)] if (x.dtype == torch.float32 and rowmajor and transposed) \
            else [(rowmajor, transposed)]
        for i, (rm, tr) in enumerate(passes):
            rec = record_amax and i == 0
            _cast_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                x, out if rm else placeholder, out_t if tr else placeholder, scale, scale_t,
                amax if rec else placeholder, m, n,
                FMAX=FP8_MAX[variant], FP8=_TL_FP8[variant], ROW_SCALES=row_scales, COL_SCALES=col_scales,
                SHARED=shared and len(passes) == 1, ROWMAJOR=rm, TRANSPOSED=tr, RECORD_AMAX=rec, BM=bm, BN=bn,
                num_warps=warps,
            )  # fmt: skip
    return out, out_t, (amax.view(torch.float32) if record_amax else None)


def fp8_history_update(history_f32: torch.Tensor, amax_f32: torch.Tensor, variant: str, margin: int = 0,
                       pow2: bool = False, reset_amax: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of agoq.ref.fp8.ref_fp8_history_update: (new_history, scale, scale_inv), new tensors;
    the history is not modified, the amax is zeroed in place when ``reset_amax``."""
    _variant(variant)
    if history_f32.dim() != 1 or history_f32.numel() < 1 or amax_f32.numel() != 1:
        raise ValueError(f"history must be 1-D non-empty and amax one value, got {tuple(history_f32.shape)} "
                         f"and {tuple(amax_f32.shape)}")
    if reset_amax and (amax_f32.dtype != torch.float32 or not amax_f32.is_contiguous()):
        raise ValueError("reset_amax needs the amax accumulator itself (contiguous float32), not a converted copy")
    history = history_f32.to(torch.float32).contiguous()
    amax = amax_f32.to(torch.float32).reshape(1).contiguous()
    new = torch.empty_like(history)
    scale = torch.empty((), dtype=torch.float32, device=history.device)
    scale_inv = torch.empty_like(scale)
    length = history.numel()
    _history_kernel[(1,)](history, amax, new, scale, scale_inv, length, FMAX_DIV=_fmax_div(variant, margin),
                          POW2=bool(pow2), RESET_AMAX=bool(reset_amax), BL=triton.next_power_of_2(length),
                          enable_fp_fusion=False)
    return new, scale, scale_inv
