"""Reference 8-bit gradient reduction over simulated ranks in one process (the executable spec of
:mod:`agoq.comm.reduce`; plain PyTorch, no process group).

``inputs[r]`` is what rank r contributes. The math, per rank r of W:

1. Flatten, zero-pad to W rows of ``S`` elements (S = ceil(N / W) rounded up to whole blocks for the
   all-reduce, the output shard size for the reduce-scatter), each row zero-padded to whole blocks (S_pad).
2. Every rank quantizes its rows (blocks never straddle rows, so a row's codes are self-contained).
3. Rank r's shard = sum over peers p = 0..W-1, in that order, of dequantize(row r of peer p), in fp32.
4. Reduce-scatter: the output of rank r is its fp32 shard (first S elements), cast to the dtype.
   All-reduce: each shard is requantized; every rank's result is the dequantized concatenation.

The distributed implementation must match this bit for bit on the same device (tests/dist).
"""

from __future__ import annotations

import torch

from agoq.formats import QuantFormat, parse_format
from agoq.ref.quant import ref_dequantize, ref_quantize

__all__ = ["ref_reduce_scatter_8bit", "ref_allreduce_8bit", "error_bound_8bit"]


def allreduce_row_numel(numel: int, world_size: int, block: int) -> int:
    """All-reduce row length: ceil(N / W) rounded up to whole blocks."""
    per_rank = -(-numel // world_size)
    return -(-per_rank // block) * block


def _padded_rows(x: torch.Tensor, world_size: int, row_numel: int, block: int) -> torch.Tensor:
    padded = -(-row_numel // block) * block
    flat = torch.zeros(world_size * row_numel, dtype=x.dtype, device=x.device)
    flat[: x.numel()] = x.reshape(-1)
    rows = torch.zeros(world_size, padded, dtype=x.dtype, device=x.device)
    rows[:, :row_numel] = flat.view(world_size, row_numel)
    return rows


def _reduced_shards_f32(inputs: list[torch.Tensor], row_numel: int, fmt: QuantFormat, average: bool) -> list:
    """fp32 reduced shard (padded) of every simulated rank."""
    world_size = len(inputs)
    dequantized = []  # dequantized[p][r]: rank p's row r after the quantization round trip
    for x in inputs:
        rows = _padded_rows(x, world_size, row_numel, fmt.block)
        dequantized.append([ref_dequantize(ref_quantize(row, fmt), torch.float32) for row in rows])
    shards = []
    for r in range(world_size):
        acc = dequantized[0][r].clone()
        for p in range(1, world_size):
            acc += dequantized[p][r]
        if average:
            acc /= world_size
        shards.append(acc)
    return shards


def _check(inputs: list[torch.Tensor]) -> None:
    if not inputs:
        raise ValueError("need at least one simulated rank")
    if len({(x.shape, x.dtype) for x in inputs}) != 1:
        raise ValueError("every simulated rank must contribute a tensor of the same shape and dtype")


def ref_reduce_scatter_8bit(inputs: list[torch.Tensor], fmt: QuantFormat | str, *,
                            average: bool = False) -> list[torch.Tensor]:
    """Output shard of every rank; inputs[r].numel() must be W * shard numel."""
    _check(inputs)
    fmt = parse_format(fmt)
    world_size = len(inputs)
    if inputs[0].numel() % world_size:
        raise ValueError(f"reduce-scatter input of {inputs[0].numel()} elements is not divisible by W={world_size}")
    row_numel = inputs[0].numel() // world_size
    shards = _reduced_shards_f32(inputs, row_numel, fmt, average)
    return [s[:row_numel].to(inputs[0].dtype) for s in shards]


def ref_allreduce_8bit(inputs: list[torch.Tensor], fmt: QuantFormat | str, *,
                       average: bool = False) -> list[torch.Tensor]:
    """Result of every rank (identical tensors), shaped like the inputs."""
    _check(inputs)
    fmt = parse_format(fmt)
    world_size, x0 = len(inputs), inputs[0]
    row_numel = allreduce_row_numel(x0.numel(), world_size, fmt.block)
    if row_numel == 0:
        return [x.clone() for x in inputs]
    shards = _reduced_shards_f32(inputs, row_numel, fmt, average)
    rows = [ref_dequantize(ref_quantize(s, fmt), x0.dtype)[:row_numel] for s in shards]
    full = torch.cat(rows)[: x0.numel()].reshape(x0.shape)
    return [full.clone() for _ in inputs]


# fp32 rounding slack of the bound: quantize computes x * (1/s) (two roundings), dequantize
# code * s (one), the W-term sum adds up to (W - 1) more; 8 eps covers W <= 4 with room to spare.
FP32_SLACK_EPS = 8 * torch.finfo(torch.float32).eps
# Smallest subnormal fp32: scales of blocks with absmax < qmax * 2**-126 are subnormal and lose
# relative precision; each dequantized element may then be off by up to qmax ulps of it.
FP32_TINY = 2.0**-149


def error_bound_8bit(inputs: list[torch.Tensor], fmt: QuantFormat | str, *, all_gather: bool,
                     average: bool = False) -> torch.Tensor:
    """Elementwise bound on |8-bit reduction - exact sum| for integer formats (round to nearest).

    Per block b of the padded row layout, with a_{p,b} = absmax of rank p's block and
    y = the exact sum, the first quantization errs by at most s_{p,b}/2 = a_{p,b} / (2 qmax) per
    rank, so e1 = sum_p a_{p,b} / (2 qmax). The requantization (all-reduce only) uses the absmax of
    the computed sum, at most max|y_b| + e1, so e2 = (max|y_b| + e1) / (2 qmax). Bound = e1 + e2
    (reduce-scatter: e1), times (1 + FP32_SLACK_EPS), plus W * qmax * FP32_TINY for subnormal
    scales; divided by W for an average. Returned shaped like the inputs (fp64). Non-finite blocks
    give a NaN bound.
    """
    fmt = parse_format(fmt)
    if fmt.kind != "int" or fmt.rounding != "nearest":
        raise ValueError(f"error_bound_8bit models integer round-to-nearest formats only, got {fmt.name!r}")
    world_size, x0 = len(inputs), inputs[0]
    if all_gather:
        row_numel = allreduce_row_numel(x0.numel(), world_size, fmt.block)
    else:
        row_numel = x0.numel() // world_size
    blocks = [_padded_rows(x.double(), world_size, row_numel, fmt.block).view(-1, fmt.block) for x in inputs]
    absmax_sum = sum(b.abs().amax(dim=1) for b in blocks)
    e1 = absmax_sum / (2 * fmt.qmax)
    bound = e1
    if all_gather:
        exact_absmax = sum(blocks).abs().amax(dim=1)
        bound = e1 + (exact_absmax + e1) / (2 * fmt.qmax)
    bound = bound * (1 + FP32_SLACK_EPS) + world_size * fmt.qmax * FP32_TINY
    if average:
        bound = bound / world_size
    per_elem = bound.unsqueeze(1).expand(-1, fmt.block).reshape(world_size, -1)[:, :row_numel]
    return per_elem.reshape(-1)[: x0.numel()].reshape(x0.shape)
