"""Smooth-SwiGLU fused with fc2's FP8 input cast (delayed scaling), Triton.

Twins of :mod:`agoq.ref.smooth_swiglu_fp8` (same signatures; T = tokens, all leading dims of h; F = FFN
width per TP rank; h = fc1 output [T.., 2F] = [gate | up], bf16 / fp16)::

  smooth_swiglu_amax(h, per_token) -> amax fp32: [T] = max_f |up| (per token), [F] = max_t |glu| (per channel)
  smooth_swiglu_cast_delayed(h, amax, variant, meta, workspace, margin=0, pow2=False, *, per_token,
                             rowmajor=True, transposed=False, t_colmajor=False, new_meta=None)
      -> (out [T, F] fp8 | None, out_t | None, new_meta, s, scale_a [T, 1] | None)

``amax=None`` (with ``per_token=False``) is plain SwiGLU feeding a plain FP8 fc2 (s = 1; docs/numerics.md): no smoothing
amax launch, no division, z = glu cast as is; s and scale_a are None (the SMOOTH=False specialisation of the
same cast kernel).

Why: the unfused Smooth-SwiGLU on an FP8 fc2 ran silu, mul, |up|, amax, the pow2 rounding (five small
launches on [T]), the division by s, the FP8 cast of z, and after fc2 the un-smoothing (fp32 convert,
multiply, convert back): about nine passes over [T, F]-sized tensors where plain FP8 runs three
(Megatron's silu and mul, the cast). Here the amax is one read of h (its up half per token) and the
cast is one more read of h writing only the FP8 codes (z in the model dtype is never materialised); the
per-token un-smoothing goes into fc2's GEMM as its row-wise ``scale_a`` (``s * scale_inv``, written by
this kernel), so it costs no pass at all.

Numerics (the reference's, step for step): glu = silu(gate) * up with ATen's two roundings to the model
dtype (agoq.kernels.swiglu_quant._silu_megatron: Megatron's unfused SwiGLU values); s = pow2_ceil(amax)
(0 -> 1, inf / NaN kept), computed from the integer bits (subnormal amaxes too, no flush to zero);
z = glu / s rounded to the model dtype (exact for a power of two barring underflow); codes =
saturating RNE cast of z * scale (scale = meta[1], the delayed scale) as agoq.kernels.fp8_fused;
new_meta = the history push of max |z| (agoq.kernels.fp8_fused._history_push; same workspace
protocol: int32 [2], zero on entry and exit, one launch at a time). So on GPU the codes equal those of
the unfused path bit for bit. Interpreter (TRITON_INTERPRET=1): numpy's exp and the interpreter's fp8
conversion (agoq.kernels.fp8_fused's note) hold there; tests feed inputs for which both are exact.

TP: the per-token amax is taken over the local F; the caller all-reduces it (MAX) between the two
launches, so every rank casts with the TP-global s (agoq.ops.smooth_swiglu_fp8).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from agoq.formats import FP8_MAX
from agoq.kernels._quant_math import USE_PTX
from agoq.kernels.fastlaunch import FastKernel
from agoq.kernels.fp8 import _TL_FP8, _TORCH_FP8, EXP_MASK, _abs_bits, _fmax_div, _sat_cast, _variant
from agoq.kernels.fp8_fused import FUSED_CAST_TILE, META_HEADER, _history_push, fp8_outputs
from agoq.kernels.swiglu_quant import _silu_megatron

__all__ = ["smooth_swiglu_amax", "smooth_swiglu_cast_delayed", "fusable_smooth", "SMOOTH_DTYPES"]

SMOOTH_DTYPES = (torch.bfloat16, torch.float16)  # fp32 h: the unfused path (no fused transposed fp32 store,
# agoq.kernels.fp8's Triton 3.6 note)
MANT_MASK = tl.constexpr(0x7FFFFF)
EXP_ONE = tl.constexpr(0x800000)  # one unit of the fp32 exponent field
# per-token amax: [AMAX_ROWS rows, AMAX_COLS columns] per step, one program per AMAX_ROWS rows (chosen, not
# swept: 8 KiB of bf16 per step as agoq.kernels.fp8.CAST_TILE's tile; the rows are written, not atomics)
AMAX_ROWS, AMAX_COLS = 8, 512


def fusable_smooth(h: torch.Tensor) -> bool:
    """Whether the fused kernels take this fc1 output: bf16 / fp16, contiguous, even non-zero width."""
    width = h.shape[-1] if h.dim() else 0
    return h.dtype in SMOOTH_DTYPES and h.is_contiguous() and width > 0 and width % 2 == 0


@triton.jit
def _pow2_ceil_bits(bits):
    """Smallest power of two >= x for a normal positive fp32 x given as int32 bits (bits of the result)."""
    exp_bits = bits & EXP_MASK
    return tl.where((bits & MANT_MASK) != 0, exp_bits + EXP_ONE, exp_bits)


@triton.jit
def _pow2_ceil(x):
    """agoq.ref.swiglu.pow2_ceil of an amax (x >= 0 or NaN): 0 -> 1; inf and NaN kept; a subnormal x
    through its integer mantissa (a subnormal power of two's bits are that power as an integer)."""
    bits = x.to(tl.int32, bitcast=True)
    mant = bits & MANT_MASK
    sub_pow = _pow2_ceil_bits(mant.to(tl.float32).to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    out_bits = tl.where((bits & EXP_MASK) == 0, sub_pow.to(tl.int32), _pow2_ceil_bits(bits))
    out = tl.where(x == 0, 1.0, out_bits.to(tl.float32, bitcast=True))
    return tl.where(x < float("inf"), out, x)  # inf stays inf; NaN (every comparison false) stays NaN


@triton.jit
def _glu(h_ptr, r, c, mask, F, EXACT_EXP: tl.constexpr):
    """Megatron's glu = silu(gate) * up for rows r, columns c of h [T, 2F], each product rounded to h's
    dtype, returned in fp32; and |up| (fp32)."""
    base = h_ptr + r[:, None] * 2 * F + c[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + F, mask=mask, other=0.0).to(tl.float32)
    silu = _silu_megatron(gate, EXACT_EXP).to(h_ptr.dtype.element_ty).to(tl.float32)
    return (silu * up).to(h_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _token_amax_kernel(
    h_ptr,  # fc1 output [T, 2F] bf16/fp16, row-major
    amax_ptr,  # fp32 [T]: max_f |up[t, f]|
    T, F,  # int: tokens, FFN width
    BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    acc = tl.zeros([BR, BC], dtype=tl.int32)
    for c0 in range(0, F, BC):
        c = c0 + tl.arange(0, BC)
        mask = (r[:, None] < T) & (c[None, :] < F)
        up = tl.load(h_ptr + r[:, None] * 2 * F + F + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(up))
    tl.store(amax_ptr + r, tl.max(acc, axis=1).to(tl.float32, bitcast=True), mask=r < T)


@triton.jit
def _channel_amax_kernel(
    h_ptr,  # fc1 output [T, 2F] bf16/fp16, row-major
    amax_ptr,  # int32 [F], zero on entry: bits of max_t |glu[t, f]| (atomic max of the bits)
    T, F,  # int: tokens, FFN width
    EXACT_EXP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TILES_M: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for t in range(TILES_M):
        r = (tl.program_id(0).to(tl.int64) * TILES_M + t) * BM + tl.arange(0, BM)
        mask = (r[:, None] < T) & (c[None, :] < F)
        acc = tl.maximum(acc, _abs_bits(_glu(h_ptr, r, c, mask, F, EXACT_EXP)))
    tl.atomic_max(amax_ptr + c, tl.max(acc, axis=0), mask=c < F)


@triton.jit
def _smooth_cast_kernel(
    h_ptr,  # fc1 output [T, 2F] bf16/fp16, row-major
    amax_ptr,  # fp32 [T] (PER_TOKEN) or [F]: the (TP-global) smoothing amax; unused without SMOOTH
    out_ptr,  # fp8 [T, F] row-major (ROWMAJOR)
    out_t_ptr,  # fp8 [F, T] row-major = [T, F] column-major (TRANSPOSED)
    s_ptr,  # fp32 [T] or [F]: s = pow2_ceil(amax), written (SMOOTH)
    scale_a_ptr,  # fp32 [T] (SMOOTH and PER_TOKEN): s * meta[0], fc2's row-wise scale_a, written
    meta_ptr,  # fp32 [4 + L]: [scale_inv, scale, 0, 0, history]; the cast uses meta[1]
    new_meta_ptr,  # fp32 [4 + L]: written by the last program (history push of max |z|)
    ws_ptr,  # int32 [2]: [amax bits, arrivals], zero on entry and exit
    T, F, L,  # int: tokens, FFN width, history length
    FMAX: tl.constexpr, FMAX_DIV: tl.constexpr, POW2: tl.constexpr, FP8: tl.constexpr, SMOOTH: tl.constexpr,
    PER_TOKEN: tl.constexpr, ROWMAJOR: tl.constexpr, TRANSPOSED: tl.constexpr, EXACT_EXP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, TILES_M: tl.constexpr, BL: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    scale = tl.load(meta_ptr + 1)
    c = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    if SMOOTH and not PER_TOKEN:  # this program's column strip has one s per column
        s_col = _pow2_ceil(tl.load(amax_ptr + c, mask=c < F, other=0.0))
        if pid_m == 0:
            tl.store(s_ptr + c, s_col, mask=c < F)
    amax_bits = tl.zeros([BM, BN], dtype=tl.int32)
    for t in range(TILES_M):
        r = (pid_m.to(tl.int64) * TILES_M + t) * BM + tl.arange(0, BM)
        mask = (r[:, None] < T) & (c[None, :] < F)
        glu = _glu(h_ptr, r, c, mask, F, EXACT_EXP)
        if not SMOOTH:  # plain SwiGLU (s = 1): glu is already in the model dtype
            z = glu
        elif PER_TOKEN:
            s_row = _pow2_ceil(tl.load(amax_ptr + r, mask=r < T, other=0.0))
            if pid_n == 0:
                tl.store(s_ptr + r, s_row, mask=r < T)
                tl.store(scale_a_ptr + r, s_row * tl.load(meta_ptr), mask=r < T)
            z = tl.math.div_rn(glu, s_row[:, None])
        else:
            z = tl.math.div_rn(glu, s_col[None, :])
        z = tl.where(mask, z.to(h_ptr.dtype.element_ty).to(tl.float32), 0.0)  # z in the model dtype
        amax_bits = tl.maximum(amax_bits, _abs_bits(z))
        q = _sat_cast(z * scale, FMAX, FP8)
        if ROWMAJOR:
            tl.store(out_ptr + r[:, None] * F + c[None, :], q, mask=mask)
        if TRANSPOSED:
            tl.store(out_t_ptr + c[:, None] * T + r[None, :], tl.trans(q), mask=tl.trans(mask))
    tl.atomic_max(ws_ptr, tl.max(tl.max(amax_bits, axis=1), axis=0))
    arrived = tl.atomic_add(ws_ptr + 1, 1)  # acq_rel: this program's max is visible before its count
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        total = tl.atomic_xchg(ws_ptr, 0)
        tl.atomic_xchg(ws_ptr + 1, 0)
        _history_push(meta_ptr, new_meta_ptr, total.to(tl.float32, bitcast=True), L, FMAX_DIV, POW2, BL)


_TOKEN_AMAX = FastKernel(_token_amax_kernel, num_warps=4)
_CHANNEL_AMAX = FastKernel(_channel_amax_kernel, num_warps=FUSED_CAST_TILE[3], enable_fp_fusion=False)
_CAST = FastKernel(_smooth_cast_kernel, num_warps=FUSED_CAST_TILE[3], enable_fp_fusion=False)


def _check_h(h: torch.Tensor, what: str) -> tuple[int, int]:
    if not fusable_smooth(h):
        raise ValueError(f"{what}: fc1 output {tuple(h.shape)} {h.dtype} must be contiguous bf16/fp16 with an even "
                         "last dim [gate | up]; use agoq.ref.smooth_swiglu_fp8 (or the unfused Smooth-SwiGLU)")
    ffn = h.shape[-1] // 2
    return h.numel() // h.shape[-1], ffn


def _grid(tokens: int, ffn: int) -> tuple[int, int]:
    bm, bn, tiles, _ = FUSED_CAST_TILE
    return triton.cdiv(tokens, bm * tiles), triton.cdiv(ffn, bn)


def smooth_swiglu_amax(h: torch.Tensor, per_token: bool) -> torch.Tensor:
    """Triton twin of agoq.ref.smooth_swiglu_fp8.ref_smooth_swiglu_amax (module docstring)."""
    tokens, ffn = _check_h(h, "smooth_swiglu_amax")
    if per_token:
        amax = torch.empty(tokens, dtype=torch.float32, device=h.device)
        if tokens == 0:
            return amax
        if ffn == 0:
            return amax.zero_()
        _TOKEN_AMAX((triton.cdiv(tokens, AMAX_ROWS),), h, amax, tokens, ffn, AMAX_ROWS, AMAX_COLS)
        return amax
    bits = torch.zeros(ffn, dtype=torch.int32, device=h.device)
    if tokens:
        bm, bn, tiles, _ = FUSED_CAST_TILE
        _CHANNEL_AMAX(_grid(tokens, ffn), h, bits, tokens, ffn, USE_PTX.value, bm, bn, tiles)
    return bits.view(torch.float32)


@functools.lru_cache(maxsize=64)
def _plan(variant: str, margin: int, pow2: bool, length: int) -> tuple:
    _variant(variant)
    return (FP8_MAX[variant], _fmax_div(variant, margin), bool(pow2), _TL_FP8[variant], _TORCH_FP8[variant],
            triton.next_power_of_2(max(length, 1)))


def _check_amax(amax: torch.Tensor | None, per_token: bool, want: tuple[int]) -> None:
    if amax is None:
        if per_token:
            raise ValueError("smooth_swiglu_cast_delayed: per_token smoothing needs its amax (smooth_swiglu_amax); "
                             "amax=None is plain SwiGLU (s = 1) and takes per_token=False")
        return
    if amax.shape != want or amax.dtype != torch.float32 or not amax.is_contiguous():
        raise ValueError(f"smooth_swiglu_cast_delayed: amax must be contiguous fp32 {want}, got {amax.dtype} "
                         f"{tuple(amax.shape)} (smooth_swiglu_amax)")


def smooth_swiglu_cast_delayed(h: torch.Tensor, amax: torch.Tensor | None, variant: str, meta: torch.Tensor,
                               workspace: torch.Tensor, margin: int = 0, pow2: bool = False, *, per_token: bool,
                               rowmajor: bool = True, transposed: bool = False, t_colmajor: bool = False,
                               new_meta: torch.Tensor | None = None):
    """Triton twin of agoq.ref.smooth_swiglu_fp8.ref_smooth_swiglu_cast_delayed (module docstring).

    ``amax=None``: no smoothing (plain SwiGLU, s = 1; s and scale_a returned as None). ``t_colmajor``: out_t as
    the [T, F] column-major tensor (fc2's wgrad operand, agoq.kernels.fp8_fused); ``new_meta``: where the next
    meta goes (default: a new tensor). An empty h pushes amax 0 through the reference (no program would run the
    push)."""
    tokens, ffn = _check_h(h, "smooth_swiglu_cast_delayed")
    smooth = amax is not None
    want = (tokens,) if per_token else (ffn,)
    _check_amax(amax, per_token, want)
    if meta.dtype != torch.float32 or meta.dim() != 1 or meta.numel() <= META_HEADER or not meta.is_contiguous():
        raise ValueError(f"meta must be a contiguous fp32 [4 + L] vector, got {meta.dtype} {tuple(meta.shape)}")
    if workspace.dtype != torch.int32 or workspace.numel() < 2:
        raise ValueError("workspace must be int32 [2], zero on entry (FP8ScalingState keeps one per slot)")
    if tokens == 0 or ffn == 0:
        from agoq.ref.smooth_swiglu_fp8 import ref_smooth_swiglu_cast_delayed

        out, out_t, new, s, scale_a = ref_smooth_swiglu_cast_delayed(
            h, amax, variant, meta, workspace, margin, pow2, per_token=per_token, rowmajor=rowmajor,
            transposed=transposed, t_colmajor=t_colmajor)
        return out, out_t, (new if new_meta is None else new_meta.copy_(new)), s, scale_a
    fmax, fmax_div, pow2_, tl_fp8, fp8, bl = _plan(variant, margin, pow2, meta.numel() - META_HEADER)
    device = h.device
    out, out_t = fp8_outputs(tokens, ffn, fp8, device, rowmajor=rowmajor, transposed=transposed,
                             t_colmajor=t_colmajor)
    s = torch.empty(want, dtype=torch.float32, device=device) if smooth else None
    scale_a = torch.empty((tokens, 1), dtype=torch.float32, device=device) if smooth and per_token else None
    new = torch.empty_like(meta) if new_meta is None else new_meta
    bm, bn, tiles, _ = FUSED_CAST_TILE
    # without smoothing the amax, s and scale_a pointers are never read or written: h stands in for them
    _CAST(_grid(tokens, ffn), h, amax if smooth else h, out if rowmajor else h, out_t if transposed else h,
          s if smooth else h, scale_a if scale_a is not None else (s if smooth else h), meta, new, workspace, tokens,
          ffn, meta.numel() - META_HEADER, fmax, fmax_div, pow2_, tl_fp8, smooth, bool(per_token), bool(rowmajor),
          bool(transposed), USE_PTX.value, bm, bn, tiles, bl)
    return out, out_t, new, s, scale_a
