"""Reference per-chunk operations of the 8-bit gradient reduction (the executable spec of
:mod:`agoq.kernels.comm`; plain PyTorch, any device, any signed round-to-nearest format).

The reduction (agoq.comm.reduce) moves W "rows" of blocks between ranks: row p of a chunk is what
rank p receives (all-to-all) or what rank p contributed (all-gather). A chunk's quantized rows are
held as two 2-D views, ``codes [W, nb * fmt.code_bytes(block)]`` (uint8) and ``scales [W, nb]``
(fp32 / fp16 / uint8 for pow2), each row contiguous, any row stride (so both may be column slices
of one packed ``[W, codes | scales]`` byte buffer, or slices of a gradient store).

Row geometry of a float tensor (quantize_rows / dequantize_rows): element j of row p is
``flat[p * row_stride + j]`` for ``j < row_numel`` and ``p * row_stride + j < flat.numel()``, and 0
otherwise (padding). A chunk holds the columns ``[col0, col0 + nb * block)`` of every row; ``col0`` is a
multiple of the block, so blocks never straddle rows or chunks and chunking never changes a code.

accumulate_: the 8-bit gradient store's dequantize-add-requantize of one parameter (micro-batch
accumulation, agoq.comm.grad_buffer).

reduce_rows: ``acc = row_0 + row_1 + ... + row_{W-1}`` (dequantized, fp32, in rank order), then
``acc / W`` if ``average``, then ``acc * post_scale`` if ``post_scale != 1``; the result is either
written (cast) to ``out[:out_numel]`` or requantized into ``codes_out`` / ``scales_out``.
"""

from __future__ import annotations

import torch

from agoq.formats import QuantFormat
from agoq.ref.quant import QuantizedTensor, ref_dequantize, ref_quantize

__all__ = ["ref_quantize_rows", "ref_reduce_rows", "ref_dequantize_rows", "ref_reduce_peer_rows",
           "ref_dequantize_peer_rows", "ref_accumulate_", "row_index"]


def row_index(world: int, nb_cols: int, *, row_stride: int, row_numel: int, col0: int,
              numel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index [W, nb_cols] int64, valid mask [W, nb_cols]) of a chunk's columns in every row."""
    cols = col0 + torch.arange(nb_cols, device=device, dtype=torch.int64)
    idx = torch.arange(world, device=device, dtype=torch.int64)[:, None] * row_stride + cols[None, :]
    valid = (cols[None, :] < row_numel) & (idx < numel)
    return torch.where(valid, idx, 0), valid


def _check_views(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> tuple[int, int]:
    if codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != scales.shape[0]:
        raise ValueError(f"codes [W, bytes] and scales [W, nb] views expected, got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    world, nb = scales.shape
    if codes.shape[1] != nb * fmt.code_bytes(fmt.block):
        raise ValueError(f"codes rows hold {codes.shape[1]} bytes, {nb} blocks of {fmt.name} need "
                         f"{nb * fmt.code_bytes(fmt.block)}")
    return world, nb


def _row_q(codes: torch.Tensor, scales: torch.Tensor, p: int, fmt: QuantFormat) -> QuantizedTensor:
    nb = scales.shape[1]
    return QuantizedTensor(codes[p].contiguous(), scales[p].contiguous(), fmt, torch.Size((nb * fmt.block,)),
                           torch.float32)


def ref_quantize_rows(src: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, *,
                      row_stride: int, row_numel: int, col0: int, num_warps: int = 4) -> None:
    """Quantize the chunk ``[col0, col0 + nb * block)`` of every row of ``src`` (flat) into codes/scales
    (``num_warps``: the kernel's launch shape, accepted for the same signature and unused)."""
    world, nb = _check_views(codes, scales, fmt)
    flat = src.reshape(-1)
    idx, valid = row_index(world, nb * fmt.block, row_stride=row_stride, row_numel=row_numel, col0=col0,
                           numel=flat.numel(), device=flat.device)
    rows = torch.where(valid, flat[idx].to(torch.float32), 0.0)
    for p in range(world):
        q = ref_quantize(rows[p], fmt)
        codes[p].copy_(q.codes)
        scales[p].copy_(q.scales)


def ref_reduce_rows(codes: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, *, average: bool,
                    post_scale: float, out: torch.Tensor | None = None, out_numel: int = 0,
                    codes_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None) -> None:
    """Sum the W dequantized rows in fp32 (rank order), average/scale, then write ``out`` or requantize."""
    world, nb = _check_views(codes, scales, fmt)
    if (out is None) == (codes_out is None):
        raise ValueError("reduce_rows writes either out (float) or codes_out/scales_out (requantized)")
    acc = ref_dequantize(_row_q(codes, scales, 0, fmt), torch.float32)
    for p in range(1, world):
        acc += ref_dequantize(_row_q(codes, scales, p, fmt), torch.float32)
    if average:
        # an elementwise tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal
        # (not correctly rounded), so on a GPU the reference would stop matching the kernels' div_rn
        acc /= torch.full_like(acc, world)
    if post_scale != 1.0:
        acc *= post_scale
    if out is not None:
        out.reshape(-1)[:out_numel].copy_(acc[:out_numel])
        return
    q = ref_quantize(acc, fmt)
    codes_out.reshape(-1).copy_(q.codes)
    scales_out.reshape(-1).copy_(q.scales)


def ref_dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor, fmt: QuantFormat, *,
                        row_stride: int, row_numel: int, col0: int) -> None:
    """Dequantize the chunk rows into ``dst`` (flat, in place) at the row geometry's valid positions."""
    world, nb = _check_views(codes, scales, fmt)
    flat = dst.view(-1)
    idx, valid = row_index(world, nb * fmt.block, row_stride=row_stride, row_numel=row_numel, col0=col0,
                           numel=flat.numel(), device=flat.device)
    for p in range(world):
        values = ref_dequantize(_row_q(codes, scales, p, fmt), flat.dtype)
        flat[idx[p][valid[p]]] = values[valid[p]]


def ref_reduce_peer_rows(code_rows: list[torch.Tensor], scale_rows: list[torch.Tensor], fmt: QuantFormat, *,
                         average: bool, post_scale: float, out: torch.Tensor | None = None, out_numel: int = 0,
                         codes_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None,
                         out_rows: int = 1, out_row_stride: int = 0, out_total: int | None = None,
                         tables=None, codes_out_rows: list[torch.Tensor] | None = None,
                         scales_out_rows: list[torch.Tensor] | None = None, out_tables=None) -> None:
    """ref_reduce_rows over rows given one by one (each may be its own allocation). ``out_rows`` R > 1: R
    reductions, output row q summing rows [q W, (q + 1) W) into ``out[q out_row_stride:]`` (first
    ``out_numel`` elements, none at or past ``out_total``). ``codes_out_rows`` / ``scales_out_rows`` (push): the
    requantized result copied into every one of these rows (they may be the input rows: all inputs are read
    first). ``tables`` / ``out_tables`` (the kernel's row address tables) are accepted for the same signature and
    unused."""
    if codes_out_rows is not None:
        codes_out = torch.empty_like(codes_out_rows[0])
        scales_out = torch.empty_like(scales_out_rows[0])
        ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=average, post_scale=post_scale, codes_out=codes_out,
                             scales_out=scales_out)  # fmt: skip
        for c, s in zip(codes_out_rows, scales_out_rows, strict=True):
            c.copy_(codes_out.view_as(c))
            s.copy_(scales_out.view_as(s))
        return
    world = len(code_rows) // out_rows
    total = out_total if out_total is not None else max(out_rows * out_row_stride, out_numel)
    for q in range(out_rows):
        codes = torch.stack([c.reshape(-1) for c in code_rows[q * world: (q + 1) * world]])
        scales = torch.stack([s.reshape(-1) for s in scale_rows[q * world: (q + 1) * world]])
        if out is None:
            ref_reduce_rows(codes, scales, fmt, average=average, post_scale=post_scale, codes_out=codes_out,
                            scales_out=scales_out)
            continue
        at = q * out_row_stride
        n = max(0, min(out_numel, total - at))
        ref_reduce_rows(codes, scales, fmt, average=average, post_scale=post_scale, out=out.reshape(-1)[at:],
                        out_numel=n)


def ref_dequantize_peer_rows(code_rows: list[torch.Tensor], scale_rows: list[torch.Tensor], dst: torch.Tensor,
                             fmt: QuantFormat, *, row_stride: int, row_numel: int, col0: int, tables=None) -> None:
    """ref_dequantize_rows with row p read from ``code_rows[p]`` / ``scale_rows[p]``."""
    ref_dequantize_rows(torch.stack([c.reshape(-1) for c in code_rows]),
                        torch.stack([s.reshape(-1) for s in scale_rows]), dst, fmt, row_stride=row_stride,
                        row_numel=row_numel, col0=col0)  # fmt: skip


def ref_accumulate_(codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, fmt: QuantFormat,
                    residual: torch.Tensor | None = None) -> None:
    """8-bit gradient accumulation of one segment, in place: value = dequantize(codes, scales)
    (+ residual), value[:n] += grad (fp32), then codes/scales = quantize(value) with a fresh block absmax
    and, with error feedback, residual = value - dequantize(new codes) (cast to the residual's dtype).
    ``codes`` / ``scales`` / ``residual`` are flat and cover whole blocks; ``grad`` has n <= blocks x block
    elements (any float dtype)."""
    nb = scales.numel()
    q = QuantizedTensor(codes, scales, fmt, torch.Size((nb * fmt.block,)), torch.float32)
    value = ref_dequantize(q, torch.float32)
    if residual is not None:
        value = value + residual.to(torch.float32)
    flat = grad.reshape(-1)
    value[: flat.numel()] += flat.to(torch.float32)
    new = ref_quantize(value, fmt)
    codes.copy_(new.codes)
    scales.copy_(new.scales)
    if residual is not None:
        residual.copy_((value - ref_dequantize(new, torch.float32)).to(residual.dtype))
