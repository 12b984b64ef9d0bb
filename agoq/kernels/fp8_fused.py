"""Per-tensor FP8 casts with the scale bookkeeping fused in: one launch per delayed-scaling cast,
two per current-scaling cast (amax, then cast). Twins in :mod:`agoq.ref.fp8` (same signatures):

  fp8_cast_delayed_2d(x2d, variant, meta, workspace, margin=0, pow2=False, *, rowmajor=True,
                      transposed=False)                       -> (out | None, out_t | None, new_meta)
  fp8_cast_current_2d(x2d, variant, margin=0, pow2=False, *, rowmajor=True, transposed=False)
                                                              -> (out | None, out_t | None, meta)

The FP8 linear's hot path calls ``cast_delayed_unchecked`` / ``cast_current_unchecked`` (the same
launches without the argument checks: x [..., n] read in place, the transposed copy optionally as an
[m, n] column-major tensor, the next meta optionally into a caller's buffer); the CPU twins are the
reference adapters in agoq.ops.fp8_linear. Launches go through agoq.kernels.fastlaunch (direct calls of the
compiled kernels).

``meta`` is one fp32 vector per tensor slot: ``[scale_inv, scale, 0, 0, amax_history (L, newest
first)]`` (current scaling: L = 1, the tensor's own amax). ``scale = meta[1]`` multiplies into the FP8
range; ``scale_inv = meta[0]`` is what ``torch._scaled_mm`` takes: first, so that its address is the
allocation's (cuBLAS wants scale pointers aligned to 16 bytes; torch allocations are).

Delayed scaling (agoq.ops.fp8_scaling.FP8ScalingState) casts with ``meta[L]`` (the scale from the
previous amaxes) and, in the same launch, pushes this tensor's amax: every program max-accumulates its
tile's amax (int32 bits, as agoq.kernels.fp8) into ``workspace[0]`` and counts itself in
``workspace[1]``; the program that arrives last swaps both words back to 0 and writes ``new_meta`` =
``[1 / scale', scale', 0, 0, amax, history[:-1]]`` into a fresh tensor. ``meta`` itself is never written,
so a backward pass holding a view of an older meta keeps its scale. Contract: ``workspace`` is int32
[2], zero on entry (it is zero again on exit), and used by one launch at a time (one stream).

Current scaling: ``fp8_amax_2d``'s kernel accumulates max |x| into word 4 of a zeroed int32 [5]
tensor; the cast kernel computes the scale from it in every program (same arithmetic, so the same
value) and program (0, 0) writes 1 / scale and scale into words 0 and 1: that tensor viewed as fp32 is
the meta.

Each program casts TILES_M tiles of [BM, BN] down a column strip (fewer programs, so fewer atomics on
the two workspace words). The clamp and the transposed store are agoq.kernels.fp8's (_sat_cast).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from agoq.formats import FP8_MAX
from agoq.kernels.fastlaunch import FastKernel
from agoq.kernels.fp8 import (
    _TL_FP8,
    _TORCH_FP8,
    AMAX_BLOCK,
    AMAX_MAX_PROGRAMS,
    _abs_bits,
    _amax_flat_kernel,
    _check_2d,
    _fmax_div,
    _sat_cast,
    _scale_from_amax,
    _variant,
)

__all__ = ["fp8_cast_delayed_2d", "fp8_cast_current_2d", "cast_delayed_unchecked", "cast_current_unchecked",
           "FUSED_CAST_TILE", "META_HEADER"]

META_HEADER = 4  # meta = [scale_inv, scale, 0, 0, history...]: the history starts 16 bytes in

# [BM rows, BN columns] per tile, TILES_M tiles per program, warps. Chosen, not swept (as
# agoq.kernels.fp8.CAST_TILE): 64 x 64 tiles as the unfused cast; 4 tiles per program cut the
# same-address atomics of delayed scaling 4x. benchmarks/bench_fp8.py --profile reports the kernel times.
FUSED_CAST_TILE = (64, 64, 4, 4)


@triton.jit
def _history_push(meta_ptr, new_meta_ptr, amax, L, FMAX_DIV: tl.constexpr, POW2: tl.constexpr,
                  BL: tl.constexpr):
    """new_meta = [1 / scale, scale, 0, 0, amax, history[:L-1]] with scale from max |new history|."""
    i = tl.arange(0, BL)
    prev = tl.load(meta_ptr + 4 + i - 1, mask=(i >= 1) & (i < L), other=0.0)
    new = tl.where(i == 0, amax, prev)
    tl.store(new_meta_ptr + 4 + i, new, mask=i < L)
    top_bits = tl.max(tl.where(i < L, _abs_bits(new), 0), axis=0, keep_dims=True)
    scale = _scale_from_amax(top_bits.to(tl.float32, bitcast=True), FMAX_DIV, POW2)
    four = tl.arange(0, 4)
    header = tl.where(four == 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
    header = tl.where(four == 1, scale, header)
    tl.store(new_meta_ptr + four, header)


@triton.jit
def _cast_tensor_kernel(
    x_ptr,  # [M, N] bf16/fp16/fp32, row-major
    out_ptr,  # [M, N] fp8 (ROWMAJOR)
    out_t_ptr,  # [N, M] fp8 (TRANSPOSED)
    meta_ptr,  # fp32 [4 + L] (DELAYED): the scale at meta[1]
    new_meta_ptr,  # fp32 [4 + L] (DELAYED) written by the last program; fp32 [5] view of ws (current)
    ws_ptr,  # int32: [amax bits, arrivals] (DELAYED, zero on entry) or [., ., 0, 0, amax bits] (current)
    mul_ptr,  # fp32 [M] (MUL == 1) or [N] (MUL == 2): x is cast (and its amax taken) as x * mul
    M, N, L,
    FMAX: tl.constexpr, FMAX_DIV: tl.constexpr, POW2: tl.constexpr, FP8: tl.constexpr,
    DELAYED: tl.constexpr, ROWMAJOR: tl.constexpr, TRANSPOSED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, TILES_M: tl.constexpr, BL: tl.constexpr, TRANSPOSE_F32: tl.constexpr,
    MUL: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DELAYED:
        s = tl.load(meta_ptr + 1)
    else:
        s = _scale_from_amax(tl.load(ws_ptr + 4).to(tl.float32, bitcast=True), FMAX_DIV, POW2)
    c = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    if MUL == 2:
        mul_c = tl.load(mul_ptr + c, mask=c < N, other=1.0)
    amax_bits = tl.zeros([BM, BN], dtype=tl.int32)
    for t in range(TILES_M):
        r = (pid_m.to(tl.int64) * TILES_M + t) * BM + tl.arange(0, BM)
        mask = (r[:, None] < M) & (c[None, :] < N)
        x = tl.load(x_ptr + r[:, None] * N + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if MUL == 1:
            x = x * tl.load(mul_ptr + r, mask=r < M, other=1.0)[:, None]
        elif MUL == 2:
            x = x * mul_c[None, :]
        if DELAYED:
            amax_bits = tl.maximum(amax_bits, _abs_bits(x))
        q = _sat_cast(x * s, FMAX, FP8)
        if ROWMAJOR:
            tl.store(out_ptr + r[:, None] * N + c[None, :], q, mask=mask)
        if TRANSPOSED:
            if TRANSPOSE_F32:  # fp32 input: strided re-read, no in-register transpose (Triton 3.6 bug,
                # see agoq.kernels.fp8._cast_kernel)
                mask_t = (c[:, None] < N) & (r[None, :] < M)
                x_t = tl.load(x_ptr + r[None, :] * N + c[:, None], mask=mask_t, other=0.0).to(tl.float32)
                if MUL == 1:
                    x_t = x_t * tl.load(mul_ptr + r, mask=r < M, other=1.0)[None, :]
                elif MUL == 2:
                    x_t = x_t * mul_c[:, None]
                qt = _sat_cast(x_t * s, FMAX, FP8)
            else:
                qt = tl.trans(q)
            tl.store(out_t_ptr + c[:, None] * M + r[None, :], qt, mask=tl.trans(mask))
    if DELAYED:
        tl.atomic_max(ws_ptr, tl.max(tl.max(amax_bits, axis=1), axis=0))
        arrived = tl.atomic_add(ws_ptr + 1, 1)  # acq_rel: this program's max is visible before its count
        if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
            total = tl.atomic_xchg(ws_ptr, 0)  # every program's max is in: read it and reset
            tl.atomic_xchg(ws_ptr + 1, 0)
            _history_push(meta_ptr, new_meta_ptr, total.to(tl.float32, bitcast=True), L, FMAX_DIV, POW2, BL)
    else:
        if (pid_m == 0) & (pid_n == 0):
            one = tl.arange(0, 1)
            s1 = tl.full([1], 0.0, tl.float32) + s
            tl.store(new_meta_ptr + one, tl.math.div_rn(tl.full([1], 1.0, tl.float32), s1))
            tl.store(new_meta_ptr + 1 + one, s1)


# Launched through agoq.kernels.fastlaunch: after the first call of a specialization the compiled
# kernel is called directly (Triton's per-call dispatch is most of a launch's host time).
_CAST_LAUNCH = FastKernel(_cast_tensor_kernel, num_warps=FUSED_CAST_TILE[3], enable_fp_fusion=False)
_AMAX_LAUNCH = FastKernel(_amax_flat_kernel, num_warps=4)


@functools.lru_cache(maxsize=64)  # per (variant, margin, pow2, history length): the constexprs, once
def _cast_plan(variant: str, margin: int, pow2: bool, length: int) -> tuple:
    _variant(variant)
    return (FP8_MAX[variant], _fmax_div(variant, margin), bool(pow2), _TL_FP8[variant], _TORCH_FP8[variant],
            triton.next_power_of_2(max(length, 1)))


def fp8_outputs(m: int, n: int, fp8: torch.dtype, device, *, rowmajor: bool, transposed: bool,
                t_colmajor: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The cast kernels' FP8 outputs of an [m, n] input: ``out`` [m, n] row-major (``rowmajor``) and ``out_t``
    (``transposed``): [n, m] row-major, or with ``t_colmajor`` the same memory as an [m, n] column-major tensor."""
    out = torch.empty((m, n), dtype=fp8, device=device) if rowmajor else None
    out_t = None
    if transposed:
        out_t = (torch.empty_strided((m, n), (1, m), dtype=fp8, device=device) if t_colmajor
                 else torch.empty((n, m), dtype=fp8, device=device))
    return out, out_t


def _launch_cast(x, m, n, plan, rowmajor, transposed, t_colmajor, meta, new_meta, ws, delayed, length, mul=None):
    """One _cast_tensor_kernel launch over x viewed as [m, n] (contiguous, any leading dims). out_t is
    [n, m] row-major, or with ``t_colmajor`` the same memory as an [m, n] column-major tensor (the
    layout torch._scaled_mm's operand b wants, without a .t() per call). ``mul``: fp32 [m, 1] or [1, n]
    (contiguous): cast x * mul (_mul_mode)."""
    fmax, fmax_div, pow2, tl_fp8, fp8, bl = plan
    device = x.device
    out, out_t = fp8_outputs(m, n, fp8, device, rowmajor=rowmajor, transposed=transposed, t_colmajor=t_colmajor)
    bm, bn, tiles, _ = FUSED_CAST_TILE
    grid = ((m + bm * tiles - 1) // (bm * tiles), (n + bn - 1) // bn)
    _CAST_LAUNCH(grid, x, out if rowmajor else x, out_t if transposed else x, meta, new_meta, ws,
                 meta if mul is None else mul, m, n, length, fmax, fmax_div, pow2, tl_fp8, delayed, rowmajor,
                 transposed, bm, bn, tiles, bl, x.dtype == torch.float32, _mul_mode(mul, m, n))
    return out, out_t


def _mul_mode(mul: torch.Tensor | None, m: int, n: int) -> int:
    """0: no multiplier; 1: per row (mul [m, 1]); 2: per column (mul [1, n]); checked (the hot path's
    callers pass what agoq.ops.smooth_swiglu_fp8 made; a wrong shape would read out of bounds)."""
    if mul is None:
        return 0
    if mul.dtype != torch.float32 or not mul.is_contiguous() or mul.shape not in ((m, 1), (1, n)):
        raise ValueError(f"mul must be contiguous fp32 ({m}, 1) or (1, {n}), got {mul.dtype} {tuple(mul.shape)}")
    return 1 if mul.shape == (m, 1) and (m != 1 or n == 1) else 2


def cast_delayed_unchecked(x, variant, meta, workspace, margin, pow2, rowmajor, transposed, t_colmajor=False,
                           new_meta=None, mul=None):
    """fp8_cast_delayed_2d without the argument checks, for agoq.ops.fp8_scaling.FP8ScalingState (which
    made ``meta``, ``workspace`` and ``new_meta``; agoq.ops.fp8_linear checked x): x contiguous [..., n]
    bf16/fp16/fp32, read as [numel / n, n]; ``t_colmajor`` as in _launch_cast; ``new_meta``: where the
    next meta goes (an fp32 [4 + L] vector no one reads yet; default: a new allocation); ``mul``: fp32
    [m, 1] or [1, n]: cast x * mul (Smooth-SwiGLU: fc2's gradient times the per-token s, or fc2's weight
    times the per-channel s; a power of two, so the product is exact)."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    if m == 0 or n == 0:
        out, out_t, new = fp8_cast_delayed_2d(x.reshape(m, n), variant, meta, workspace, margin, pow2,
                                              rowmajor=rowmajor, transposed=transposed, mul=mul)
        return out, (out_t.t() if t_colmajor and out_t is not None else out_t), new
    length = meta.shape[0] - META_HEADER
    if new_meta is None:
        new_meta = torch.empty_like(meta)
    out, out_t = _launch_cast(x, m, n, _cast_plan(variant, margin, pow2, length), rowmajor, transposed, t_colmajor,
                              meta, new_meta, workspace, True, length, mul)
    return out, out_t, new_meta


def cast_current_unchecked(x, variant, margin, pow2, rowmajor, transposed, t_colmajor=False):
    """fp8_cast_current_2d without the argument checks (x as in cast_delayed_unchecked)."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    if m == 0 or n == 0:
        out, out_t, meta = fp8_cast_current_2d(x.reshape(m, n), variant, margin, pow2, rowmajor=rowmajor,
                                               transposed=transposed)
        return out, (out_t.t() if t_colmajor and out_t is not None else out_t), meta
    ws = torch.zeros(META_HEADER + 1, dtype=torch.int32, device=x.device)
    meta = ws.view(torch.float32)
    numel = m * n
    _AMAX_LAUNCH((min((numel + AMAX_BLOCK - 1) // AMAX_BLOCK, AMAX_MAX_PROGRAMS),),
                 x, ws[META_HEADER:], numel, AMAX_BLOCK)
    out, out_t = _launch_cast(x, m, n, _cast_plan(variant, margin, pow2, 1), rowmajor, transposed, t_colmajor,
                              meta, meta, ws, False, 1, None)
    return out, out_t, meta


def fp8_cast_delayed_2d(x2d: torch.Tensor, variant: str, meta: torch.Tensor, workspace: torch.Tensor, margin: int = 0,
                        pow2: bool = False, *, rowmajor: bool = True, transposed: bool = False,
                        mul: torch.Tensor | None = None):
    """Triton twin of agoq.ref.fp8.ref_fp8_cast_delayed_2d (module docstring): cast with meta's scale,
    push this tensor's amax; returns (out, out_t, new_meta). ``mul`` (fp32 [M, 1] or [1, N]): cast and
    record x * mul instead of x."""
    _variant(variant)
    x = _check_2d(x2d, "fp8_cast_delayed_2d")
    if meta.dtype != torch.float32 or meta.dim() != 1 or meta.numel() <= META_HEADER or not meta.is_contiguous():
        raise ValueError(f"meta must be a contiguous fp32 [4 + L] vector (L >= 1), got {meta.dtype} "
                         f"{tuple(meta.shape)}")
    if workspace.dtype != torch.int32 or workspace.numel() < 2 or workspace.device != x.device:
        raise ValueError("workspace must be int32 [2] on the tensor's device, zero on entry "
                         "(FP8ScalingState keeps one per slot)")
    _fmax_div(variant, margin)
    if x.numel() == 0:  # no program would run the history push: push amax 0 with the reference
        from agoq.ref.fp8 import ref_fp8_cast_delayed_2d

        return ref_fp8_cast_delayed_2d(x, variant, meta, workspace, margin, pow2, rowmajor=rowmajor,
                                       transposed=transposed, mul=mul)
    _mul_mode(mul, *x.shape)
    return cast_delayed_unchecked(x, variant, meta, workspace, margin, pow2, rowmajor, transposed, mul=mul)


def fp8_cast_current_2d(x2d: torch.Tensor, variant: str, margin: int = 0, pow2: bool = False, *,
                        rowmajor: bool = True, transposed: bool = False):
    """Triton twin of agoq.ref.fp8.ref_fp8_cast_current_2d: amax, scale and cast in two launches;
    returns (out, out_t, meta = [scale_inv, scale, 0, 0, amax])."""
    _variant(variant)
    x = _check_2d(x2d, "fp8_cast_current_2d")
    _fmax_div(variant, margin)
    if x.numel() == 0:
        from agoq.ref.fp8 import ref_fp8_cast_current_2d

        return ref_fp8_cast_current_2d(x, variant, margin, pow2, rowmajor=rowmajor, transposed=transposed)
    return cast_current_unchecked(x, variant, margin, pow2, rowmajor, transposed)
