"""Fused Triton kernels of the 8-bit gradient reduction (one-byte formats: int8 round-to-nearest, fp8),
with the signatures and results of agoq.ref.comm (read its docstring for the row geometry).

* quantize_rows: float rows (fp32 / bf16 / fp16, strided in the flat input) -> codes + scales written
  straight into the (packed) send buffer. Reads 4 (or 2) bytes, writes ~1.02 bytes per element.
* reduce_rows: the W received rows -> dequantize, sum in fp32 in rank order, average / scale, then
  requantize into the own-row buffer (all-reduce) or cast into the output (reduce-scatter). Reads
  W x 1.02 bytes, writes 1.02 (or 4) bytes per output element; the W rows never exist in fp32.
* dequantize_rows: gathered rows -> the destination tensor's elements, in place.
* reduce_peer_rows / dequantize_peer_rows: the same two kernels reading each row through a table of
  row addresses instead of one strided buffer, so the rows can live in W different allocations: the
  peers' CUDA symmetric-memory buffers mapped over NVLink (agoq.comm.symm), where the kernel's loads
  are the communication. The requantized reduction can also write its result through a second table into
  several output rows (PUSH: every peer's copy of the segment, agoq.comm.symm_store's all-reduce), where the
  stores are communication too. Launched with ALIGNED (16-byte vector loads and stores of the codes) when
  peer_tables found every codes row address of the launch 16-byte aligned, unhinted (byte accesses, same
  results) otherwise.
* accumulate_: the gradient store's per-micro-batch dequantize + add + requantize of one parameter
  (and error-feedback residual) in one pass: reads codes, scales and the gradient, writes codes and
  scales (~4 bytes per element for a bf16 gradient), no fp32 temporary.

Each program handles ROWS blocks of one row (grid axis 1 = row). Arithmetic mirrors agoq.ref step for
step (quantize_tile_bytes of agoq.kernels.quant) and kernels are compiled with enable_fp_fusion=False,
so the codes and sums are bit-identical to the reference (tests/kernels/test_comm_kernels.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from agoq.formats import QuantFormat, uses_bytes_kernel
from agoq.kernels import _launch
from agoq.kernels._quant_math import saturate
from agoq.kernels.fastlaunch import FastKernel
from agoq.kernels.quant import _pow2_value, decode_tile_bytes, load_scale_f32, quantize_tile_bytes

__all__ = ["quantize_rows", "reduce_rows", "dequantize_rows", "reduce_peer_rows", "dequantize_peer_rows",
           "row_address_table", "PeerTables", "peer_tables", "PEER_ROW_ALIGN_BYTES", "accumulate_"]

# Elements per program and warps: the shape measured best for the one-byte quantize kernel
# (_launch.QUANT_CONFIGS["int", 8], H100, docs/benchmarks/quant.md); not re-tuned for these kernels.
ELEMS_PER_PROGRAM = 4096
NUM_WARPS = 4

# Alignment in bytes the PEERS kernels assume of every codes row address when launched with ALIGNED (set only by
# peer_tables after checking each row): 16 B = one ld.global.v4.b32, the widest load, and the divisor Triton's own
# pointer-argument specialisation uses (agoq.kernels.fastlaunch._ALIGN). The PEERS rows come from int64 address
# tables, which the compiler cannot see through: unhinted, it loads the codes one byte at a time (int8_b256, W=2,
# sm_90, Triton 3.6 PTX: 32 ld.global.b8 per thread and row instead of 2 ld.global.v4.b32; 840 -> 792 SASS
# instructions; 2026-11-26, not yet timed on a GPU). The offsets added to the row base (block * BLOCK + lane) are
# compile-time multiples of BLOCK, which the compiler tracks itself: only the bases need the host check.
PEER_ROW_ALIGN_BYTES = 16
_PEER_ROW_ALIGN = tl.constexpr(PEER_ROW_ALIGN_BYTES)


@triton.jit
def _row_offsets(col0, row_stride, row_numel, numel, nb, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """(flat element offsets [ROWS, BLOCK] int64, valid mask, block index [ROWS], block mask) of this
    program's blocks in its row."""
    p = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = col0 + blk[:, None].to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
    offs = p * row_stride + col
    blk_ok = blk < nb
    valid = blk_ok[:, None] & (col < row_numel) & (offs < numel)
    return offs, valid, blk, blk_ok


@triton.jit
def _quantize_rows_kernel(
    src_ptr, codes_ptr, scales_ptr,
    codes_row_stride, scales_row_stride,  # elements between rows of the codes / scales views
    row_stride, row_numel, numel, col0, nb,
    KIND: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
):  # fmt: skip
    offs, valid, blk, blk_ok = _row_offsets(col0, row_stride, row_numel, numel, nb, ROWS, BLOCK)
    x = tl.load(src_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    code, stored = quantize_tile_bytes(x, KIND, SCALE, QMAX, FP8_DTYPE)
    p = tl.program_id(1).to(tl.int64)
    local = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(codes_ptr + p * codes_row_stride + local, code, mask=blk_ok[:, None])
    scales_ptr += p * scales_row_stride
    tl.store(scales_ptr + blk, stored.to(scales_ptr.dtype.element_ty), mask=blk_ok)


@triton.jit
def _row_values(codes_ptr, scales_ptr, local, blk, blk_ok, KIND: tl.constexpr, SCALE: tl.constexpr,
                FP8_DTYPE: tl.constexpr):  # fmt: skip
    code = tl.load(codes_ptr + local, mask=blk_ok[:, None], other=0)
    s = load_scale_f32(scales_ptr + blk, blk_ok, SCALE)
    # finite codes never dequantize to Inf (agoq.ref.quant.saturate, as ref_dequantize to fp32)
    return saturate(decode_tile_bytes(code, KIND, FP8_DTYPE) * s[:, None], tl.float32)


@triton.jit
def _row_ptrs(codes_ptr, scales_ptr, codes_stride64, scales_stride64, code_table, scale_table, p,
              PEERS: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """Row p's codes / scales pointers: ``base + p * stride`` of one buffer, or (PEERS) the addresses held
    in the int64 tables (``codes_ptr`` / ``scales_ptr`` then only give the element types). ALIGNED (PEERS only):
    every codes address in the table is a multiple of PEER_ROW_ALIGN_BYTES, checked on the host (peer_tables).
    The pointers serve loads (input rows) and stores (PUSH output rows) alike."""
    if PEERS:
        c = tl.load(code_table + p).to(tl.pointer_type(codes_ptr.dtype.element_ty))
        if ALIGNED:  # vector accesses of the codes (PEER_ROW_ALIGN_BYTES); the strided layout gets this from Triton's
            c = tl.multiple_of(c, _PEER_ROW_ALIGN)  # argument specialisation (16-byte pointer and stride)
        # scales not hinted: one scale per thread and row, a scalar load either way (the same hint on them left the
        # PTX loads unchanged, Triton 3.6 sm_90)
        s = tl.load(scale_table + p).to(tl.pointer_type(scales_ptr.dtype.element_ty))
    else:
        c = codes_ptr + p * codes_stride64
        s = scales_ptr + p * scales_stride64
    return c, s


@triton.jit
def _reduce_rows_kernel(
    codes_ptr, scales_ptr, codes_row_stride, scales_row_stride, world, nb,
    world_f32, post_scale,  # fp32: W (AVERAGE divides by it) and the factor applied after
    out_ptr, out_numel,  # REQUANT False: float output, first out_numel elements (of each output row) written
    out_row_stride, out_total,  # output row q (grid axis 1, PEERS only) starts at q * out_row_stride; < out_total
    codes_out_ptr, scales_out_ptr,  # REQUANT True: the output row (PUSH: its element types only)
    code_table, scale_table,  # PEERS True: int64 addresses of the W rows
    out_code_table, out_scale_table, n_out,  # PUSH True: int64 addresses of the n_out output rows
    KIND: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr,
    FP8_DTYPE: tl.constexpr, AVERAGE: tl.constexpr, SCALED: tl.constexpr, REQUANT: tl.constexpr,
    PEERS: tl.constexpr,
    PUSH: tl.constexpr,  # REQUANT and PEERS only: the requantized blocks go to every output row of the out tables
    ALIGNED: tl.constexpr,  # see _row_ptrs (False unless PEERS); with PUSH it covers the output codes rows too
):  # fmt: skip
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blk_ok = blk < nb
    local = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    # tl.cast, not .to: Triton passes an int argument equal to 1 as a constant (a one-block row's stride), which
    # has no .to (it failed to compile on the H100 for a one-block chunk of the peer reduce-to-owners)
    codes_stride64 = tl.cast(codes_row_stride, tl.int64)
    scales_stride64 = tl.cast(scales_row_stride, tl.int64)
    q = tl.program_id(1).to(tl.int64)  # output row (PEERS: its W input rows are table entries q*W .. q*W+W-1)
    # row 0 first, then += rows 1..W-1: the reference's order (also keeps a lone -0.0 a -0.0)
    c, s = _row_ptrs(codes_ptr, scales_ptr, codes_stride64, scales_stride64, code_table, scale_table, q * world,
                     PEERS, ALIGNED)  # fmt: skip
    acc = _row_values(c, s, local, blk, blk_ok, KIND, SCALE, FP8_DTYPE)
    for p in range(1, world):
        c, s = _row_ptrs(codes_ptr, scales_ptr, codes_stride64, scales_stride64, code_table, scale_table,
                         q * world + p, PEERS, ALIGNED)  # fmt: skip
        acc = acc + _row_values(c, s, local, blk, blk_ok, KIND, SCALE, FP8_DTYPE)
    if AVERAGE:
        acc = tl.math.div_rn(acc, tl.full(acc.shape, 1.0, tl.float32) * world_f32)
    if SCALED:
        acc = acc * post_scale
    if REQUANT:
        code, stored = quantize_tile_bytes(acc, KIND, SCALE, QMAX, FP8_DTYPE)
        stored = stored.to(scales_out_ptr.dtype.element_ty)
        if PUSH:
            # the same codes and scales into every output row. Safe in place (outputs = inputs) as no program
            # stores a block before it has all of that block's inputs: every code of a block depends on the
            # block's absmax, hence on all W rows' loads of it; programs own disjoint blocks
            for o in range(n_out):
                co, so = _row_ptrs(codes_out_ptr, scales_out_ptr, codes_stride64, scales_stride64, out_code_table,
                                   out_scale_table, o, True, ALIGNED)  # fmt: skip
                tl.store(co + local, code, mask=blk_ok[:, None])
                tl.store(so + blk, stored, mask=blk_ok)
        else:
            tl.store(codes_out_ptr + local, code, mask=blk_ok[:, None])
            tl.store(scales_out_ptr + blk, stored, mask=blk_ok)
    else:
        at = q * out_row_stride + local
        keep = blk_ok[:, None] & (local < out_numel) & (at < out_total)
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _dequantize_rows_kernel(
    codes_ptr, scales_ptr, codes_row_stride, scales_row_stride, dst_ptr,
    row_stride, row_numel, numel, col0, nb,
    code_table, scale_table,  # PEERS True: int64 addresses of the W rows
    KIND: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr, FP8_DTYPE: tl.constexpr,
    PEERS: tl.constexpr, ALIGNED: tl.constexpr,  # ALIGNED: see _row_ptrs (False unless PEERS)
):  # fmt: skip
    offs, valid, blk, blk_ok = _row_offsets(col0, row_stride, row_numel, numel, nb, ROWS, BLOCK)
    p = tl.program_id(1).to(tl.int64)
    local = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    c, s = _row_ptrs(codes_ptr, scales_ptr, tl.cast(codes_row_stride, tl.int64), tl.cast(scales_row_stride, tl.int64),
                     code_table, scale_table, p, PEERS, ALIGNED)  # fmt: skip
    y = saturate(_row_values(c, s, local, blk, blk_ok, KIND, SCALE, FP8_DTYPE), dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + offs, y.to(dst_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _accumulate_kernel(
    codes_ptr, scales_ptr, grad_ptr, residual_ptr, n, nb,
    KIND: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr,
    FP8_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk_ok = blk < nb
    local = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    v = _row_values(codes_ptr, scales_ptr, local, blk, blk_ok, KIND, SCALE, FP8_DTYPE)
    if HAS_RESIDUAL:
        v = v + tl.load(residual_ptr + local, mask=blk_ok[:, None], other=0.0).to(tl.float32)
    in_grad = local < n
    g = tl.load(grad_ptr + local, mask=in_grad, other=0.0).to(tl.float32)
    v = tl.where(in_grad, v + g, v)  # the padding is not touched (the reference adds to [:n] only)
    code, stored = quantize_tile_bytes(v, KIND, SCALE, QMAX, FP8_DTYPE)
    tl.store(codes_ptr + local, code, mask=blk_ok[:, None])
    tl.store(scales_ptr + blk, stored.to(scales_ptr.dtype.element_ty), mask=blk_ok)
    if HAS_RESIDUAL:
        if SCALE == 2:
            s_new = _pow2_value(stored.to(tl.int32))
        else:
            s_new = stored  # fp32 value of the stored scale (NaN for a non-finite block)
        r = v - decode_tile_bytes(code, KIND, FP8_DTYPE) * s_new[:, None]
        tl.store(residual_ptr + local, r.to(residual_ptr.dtype.element_ty), mask=blk_ok[:, None])


def _check(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> tuple[int, int, dict]:
    if not uses_bytes_kernel(fmt):
        raise ValueError(f"agoq.kernels.comm handles one-byte formats (int8 round-to-nearest, fp8), not {fmt.name}; "
                         "use agoq.ref.comm")
    if codes.dim() != 2 or scales.dim() != 2 or codes.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("codes [W, bytes] and scales [W, nb] must be 2-D views with contiguous rows")
    world, nb = scales.shape
    if codes.shape != (world, nb * fmt.block):
        raise ValueError(f"codes view {tuple(codes.shape)} does not hold {nb} blocks of {fmt.name} per row")
    return world, nb, _constexprs(fmt)


@functools.lru_cache(maxsize=32)
def _constexprs(fmt: QuantFormat) -> dict:
    """Compile-time constants of a format (cached: the launch path runs per chunk on the host)."""
    ce = _launch.constexprs(fmt)
    return dict(KIND=ce["KIND"], BLOCK=fmt.block, SCALE=ce["SCALE"], FP8_DTYPE=ce["FP8_DTYPE"],
                ROWS=_launch.rows_for(fmt, ELEMS_PER_PROGRAM))


# Warps per program of the peer transport's launches (agoq.comm.symm): 8 was within 3 % of the best of six
# (elements per program, warps) shapes at every size and the best or second best at 160 MiB (Megatron's
# bucket: 0.307 ms against 0.617 ms with 4 warps, one-shot all-reduce, 2 H100, 2026-11-26); the NCCL transport
# keeps NUM_WARPS (its measurements, docs/benchmarks/grads.md).
PEER_NUM_WARPS = 8
_KERNELS = {w: (FastKernel(_quantize_rows_kernel, num_warps=w, enable_fp_fusion=False),
                FastKernel(_reduce_rows_kernel, num_warps=w, enable_fp_fusion=False),
                FastKernel(_dequantize_rows_kernel, num_warps=w, enable_fp_fusion=False))
            for w in (NUM_WARPS, PEER_NUM_WARPS)}
# the peer transport's reduce and dequantize launchers by name (agoq.testing.xcompile compiles their variants)
_PEER_REDUCE, _PEER_DEQUANTIZE = _KERNELS[PEER_NUM_WARPS][1], _KERNELS[PEER_NUM_WARPS][2]
# FastKernel: direct launches of the compiled kernels (agoq.kernels.fastlaunch; every parameter positional, in
# signature order). A reduction launches 3-5 of these per chunk and the peer transport has no NCCL call to hide
# host time behind: Triton's own dispatch (~40 us a launch) set the floor at small sizes.


def quantize_rows(src: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, *,
                  row_stride: int, row_numel: int, col0: int, num_warps: int = NUM_WARPS) -> None:
    """Triton twin of agoq.ref.comm.ref_quantize_rows (``num_warps``: NUM_WARPS or PEER_NUM_WARPS, launch only)."""
    world, nb, ce = _check(codes, scales, fmt)
    if nb == 0:
        return
    flat = src.reshape(-1)
    _KERNELS[num_warps][0]((triton.cdiv(nb, ce["ROWS"]), world), flat, codes, scales, codes.stride(0), scales.stride(0),
              row_stride, row_numel, flat.numel(), col0, nb, ce["KIND"], ce["BLOCK"], ce["ROWS"], ce["SCALE"],
              float(fmt.qmax), ce["FP8_DTYPE"])  # fmt: skip


def _reduce(grid, codes, scales, codes_stride, scales_stride, world, nb, fmt, ce, average, post_scale, out,
            out_numel, out_row_stride, out_total, codes_out, scales_out, tables, peers, out_tables=None,
            n_out=0) -> None:
    """One launch of _reduce_rows_kernel. ``out_tables`` (PeerTables, PEERS only): PUSH mode, ``codes_out`` /
    ``scales_out`` are then the first output row (element types) and the result goes to the ``n_out`` rows of
    the tables; ALIGNED only when the input and the output codes rows all are."""
    requant, push = out is None, out_tables is not None
    dummy = codes  # unused pointer arguments of the other output kind / of the strided layout
    code_table, scale_table, aligned = tables if peers else (scales, scales, False)
    out_code_table, out_scale_table = (out_tables.codes, out_tables.scales) if push else (scales, scales)
    aligned = aligned and (out_tables.codes_aligned if push else True)
    launch = _KERNELS[PEER_NUM_WARPS if peers else NUM_WARPS][1]
    launch(grid, codes, scales, codes_stride, scales_stride, world, nb, float(world), float(post_scale),
            dummy if requant else out.reshape(-1), out_numel, out_row_stride, out_total,
            codes_out.reshape(-1) if requant else dummy, scales_out.reshape(-1) if requant else scales,
            code_table, scale_table, out_code_table, out_scale_table, n_out, ce["KIND"], ce["BLOCK"], ce["ROWS"],
            ce["SCALE"], float(fmt.qmax), ce["FP8_DTYPE"], average, post_scale != 1.0, requant, peers, push,
            aligned)  # fmt: skip


def reduce_rows(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, *, average: bool, post_scale: float,
                out: torch.Tensor | None = None, out_numel: int = 0, codes_out: torch.Tensor | None = None,
                scales_out: torch.Tensor | None = None) -> None:
    """Triton twin of agoq.ref.comm.ref_reduce_rows."""
    world, nb, ce = _check(codes, scales, fmt)
    if (out is None) == (codes_out is None):
        raise ValueError("reduce_rows writes either out (float) or codes_out/scales_out (requantized)")
    if nb == 0:
        return
    _reduce((triton.cdiv(nb, ce["ROWS"]), 1), codes, scales, codes.stride(0), scales.stride(0), world, nb, fmt, ce,
            average, post_scale, out, out_numel, 0, out_numel, codes_out, scales_out, None, False)  # fmt: skip


def _dequantize(grid, codes, scales, codes_stride, scales_stride, flat, row_stride, row_numel, col0, nb, ce,
                tables, peers) -> None:
    code_table, scale_table, aligned = tables if peers else (scales, scales, False)
    launch = _KERNELS[PEER_NUM_WARPS if peers else NUM_WARPS][2]
    launch(grid, codes, scales, codes_stride, scales_stride, flat, row_stride, row_numel, flat.numel(), col0,
                nb, code_table, scale_table, ce["KIND"], ce["BLOCK"], ce["ROWS"], ce["SCALE"], ce["FP8_DTYPE"],
                peers, aligned)  # fmt: skip


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor, fmt: QuantFormat, *,
                    row_stride: int, row_numel: int, col0: int) -> None:
    """Triton twin of agoq.ref.comm.ref_dequantize_rows."""
    world, nb, ce = _check(codes, scales, fmt)
    if nb == 0:
        return
    _dequantize((triton.cdiv(nb, ce["ROWS"]), world), codes, scales, codes.stride(0), scales.stride(0), dst.view(-1),
                row_stride, row_numel, col0, nb, ce, None, False)  # fmt: skip


def row_address_table(rows: list[torch.Tensor]) -> torch.Tensor:
    """int64 tensor of the rows' addresses, on the rows' device (the PEERS kernels' row table)."""
    return torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64).to(rows[0].device)


class PeerTables(NamedTuple):
    """The PEERS kernels' row address tables of one set of rows, and whether every codes row starts at a multiple
    of PEER_ROW_ALIGN_BYTES (the kernels' ALIGNED flag: vector loads of the codes). Build with peer_tables."""

    codes: torch.Tensor
    scales: torch.Tensor
    codes_aligned: bool


def peer_tables(code_rows: list[torch.Tensor], scale_rows: list[torch.Tensor]) -> PeerTables:
    """Address tables of the rows for reduce_peer_rows / dequantize_peer_rows ``tables=``. Build them once per set
    of rows: they cost two host-to-device copies.

    ``codes_aligned`` is True only when every codes row address is a multiple of PEER_ROW_ALIGN_BYTES (the peer
    transports' rows are: symmetric allocations, rows padded to 16 bytes, store rows at block boundaries). Otherwise
    the kernels are launched without the alignment hint: the same results, byte loads of the codes; a
    specialisation, like Triton's own on a pointer argument's alignment, not a change of behaviour."""
    aligned = all(r.data_ptr() % PEER_ROW_ALIGN_BYTES == 0 for r in code_rows)
    return PeerTables(row_address_table(code_rows), row_address_table(scale_rows), aligned)


def _check_peer_rows(code_rows: list[torch.Tensor], scale_rows: list[torch.Tensor], fmt: QuantFormat,
                     tables) -> tuple[int, dict]:
    """(blocks per row, constexprs); the full per-row check only when the caller brings no prebuilt tables
    (a caller with tables, agoq.comm.symm, built them from rows it checked once)."""
    if not code_rows or len(code_rows) != len(scale_rows):
        raise ValueError(f"need one codes and one scales row per rank, got {len(code_rows)} and {len(scale_rows)}")
    nb = scale_rows[0].numel()
    if tables is None:
        for c, s in zip(code_rows, scale_rows, strict=True):
            if s.numel() != nb or c.numel() != nb * fmt.block or not (c.is_contiguous() and s.is_contiguous()):
                raise ValueError(f"every row must hold {nb} contiguous blocks of {fmt.name} (codes {c.numel()} "
                                 f"bytes, scales {s.numel()})")
            if c.dtype != code_rows[0].dtype or s.dtype != scale_rows[0].dtype:
                raise ValueError("all rows must share the codes dtype and the scales dtype")
    return nb, _constexprs_checked(code_rows[0], scale_rows[0], fmt)


def _constexprs_checked(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> dict:
    if not uses_bytes_kernel(fmt):
        raise ValueError(f"agoq.kernels.comm handles one-byte formats (int8 round-to-nearest, fp8), not {fmt.name}; "
                         "use agoq.ref.comm")
    return _constexprs(fmt)


def _tables(code_rows, scale_rows, tables) -> PeerTables:
    if tables is None:
        return peer_tables(code_rows, scale_rows)
    if not isinstance(tables, PeerTables):  # a bare (codes, scales) pair carries no alignment check
        raise TypeError(f"tables must be peer_tables(code_rows, scale_rows), a PeerTables; got {type(tables).__name__}")
    return tables


def reduce_peer_rows(code_rows: list[torch.Tensor], scale_rows: list[torch.Tensor], fmt: QuantFormat, *,
                     average: bool, post_scale: float, out: torch.Tensor | None = None, out_numel: int = 0,
                     codes_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None,
                     out_rows: int = 1, out_row_stride: int = 0, out_total: int | None = None,
                     tables: PeerTables | None = None, codes_out_rows: list[torch.Tensor] | None = None,
                     scales_out_rows: list[torch.Tensor] | None = None, out_tables: PeerTables | None = None) -> None:
    """reduce_rows over rows given one by one (each may be its own allocation, e.g. a peer's symmetric memory).

    Output: ``out`` (float), ``codes_out`` / ``scales_out`` (requantized, one row), or ``codes_out_rows`` /
    ``scales_out_rows`` (push: the same requantized codes and scales written into every one of these rows, which
    may be the input rows themselves, e.g. every peer's copy of a segment; ``out_tables`` =
    peer_tables(codes_out_rows, scales_out_rows) if prebuilt). Each program loads all of its blocks' inputs before
    it stores them, and programs own disjoint blocks, so outputs may alias inputs block for block.

    ``out_rows`` R > 1 (float output only): R independent reductions in one launch, output row q summing
    ``code_rows[q W : (q + 1) W]`` (W = len(code_rows) / R) into ``out[q out_row_stride :]``, its first
    ``out_numel`` elements, none at or past ``out_total`` (default: R x out_row_stride). ``tables`` =
    peer_tables(code_rows, scale_rows) if prebuilt (then the rows are trusted).
    Triton twin of agoq.ref.comm.ref_reduce_peer_rows."""
    nb, ce = _check_peer_rows(code_rows, scale_rows, fmt, tables)
    push = codes_out_rows is not None or scales_out_rows is not None
    if (out is not None) + (codes_out is not None or scales_out is not None) + push != 1:
        raise ValueError("reduce_peer_rows writes exactly one of out (float), codes_out/scales_out (requantized) "
                         "or codes_out_rows/scales_out_rows (requantized, pushed to every row)")
    if len(code_rows) % out_rows or (out_rows > 1 and out is None):
        raise ValueError(f"out_rows={out_rows}: needs a float out and a multiple of it rows, got {len(code_rows)}")
    if push:
        if codes_out_rows is None or scales_out_rows is None:
            raise ValueError("push output needs both codes_out_rows and scales_out_rows")
        _check_peer_rows(codes_out_rows, scales_out_rows, fmt, out_tables)
        if out_tables is None and (scales_out_rows[0].numel() != nb or codes_out_rows[0].dtype != code_rows[0].dtype
                                   or scales_out_rows[0].dtype != scale_rows[0].dtype):
            raise ValueError(f"every output row must hold {nb} blocks with the input rows' codes and scales dtypes")
        out_tables = _tables(codes_out_rows, scales_out_rows, out_tables)
        codes_out, scales_out = codes_out_rows[0], scales_out_rows[0]
    if nb == 0:
        return
    world = len(code_rows) // out_rows
    total = out_total if out_total is not None else max(out_rows * out_row_stride, out_numel)
    codes, scales = code_rows[0], scale_rows[0]
    _reduce((triton.cdiv(nb, ce["ROWS"]), out_rows), codes, scales, codes.numel(), scales.numel(), world, nb, fmt,
            ce, average, post_scale, out, out_numel, out_row_stride, total, codes_out, scales_out,
            _tables(code_rows, scale_rows, tables), True, out_tables, len(codes_out_rows) if push else 0)  # fmt: skip


def dequantize_peer_rows(code_rows: list[torch.Tensor], scale_rows: list[torch.Tensor], dst: torch.Tensor,
                         fmt: QuantFormat, *, row_stride: int, row_numel: int, col0: int,
                         tables: PeerTables | None = None) -> None:
    """dequantize_rows with row p read from ``code_rows[p]`` / ``scale_rows[p]`` (see reduce_peer_rows).
    Triton twin of agoq.ref.comm.ref_dequantize_peer_rows."""
    nb, ce = _check_peer_rows(code_rows, scale_rows, fmt, tables)
    if nb == 0:
        return
    codes, scales = code_rows[0], scale_rows[0]
    _dequantize((triton.cdiv(nb, ce["ROWS"]), len(code_rows)), codes, scales, codes.numel(), scales.numel(),
                dst.view(-1), row_stride, row_numel, col0, nb, ce, _tables(code_rows, scale_rows, tables),
                True)  # fmt: skip


def accumulate_(codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat,
                residual: torch.Tensor | None = None) -> None:
    """Triton twin of agoq.ref.comm.ref_accumulate_ (one-byte formats)."""
    nb = scales.numel()
    _, _, ce = _check(codes.view(1, -1), scales.view(1, -1), fmt)
    n = grad.numel()
    if nb == 0 or n == 0:
        return
    if n > nb * fmt.block:
        raise ValueError(f"gradient of {n} elements does not fit {nb} blocks of {fmt.name}")
    flat = grad.reshape(-1)
    _accumulate_kernel[(triton.cdiv(nb, ce["ROWS"]),)](
        codes, scales, flat, codes if residual is None else residual, n, nb, QMAX=float(fmt.qmax),
        HAS_RESIDUAL=residual is not None, num_warps=NUM_WARPS, enable_fp_fusion=False, **ce,
    )  # fmt: skip
