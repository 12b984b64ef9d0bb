"""Precision-preserving 8-bit gradient reduction on plain ``torch.distributed`` process groups.

Algorithm (AGoQ, shared/spec/algorithms.md §3.3; the data movement of ZeRO++ qgZ)::

    x (float, N elements, every rank)
      -> pad to W rows of S elements, S a multiple of the format's block (W = group size)
      -> quantize row by row (codes + one scale per block; blocks never straddle rows)
      -> all_to_all_single of [codes | scales] bytes: rank r receives row r of every peer
      -> dequantize the W received rows, sum them in fp32 in rank order (0, 1, ..., W-1)
      -> reduce_scatter_8bit: write the fp32 sum (the owned shard) to the output; done
      -> allreduce_8bit:      requantize the sum, all_gather_into_tensor [codes | scales],
                              dequantize all W rows into the input tensor (in place)

Codes are never summed on the wire: the backend moves bytes only (gloo emulates tensor
reduce-scatter anyway, pytorch/pytorch#118911). Every rank ends with bit-identical values in the
all-reduce case, because every rank dequantizes the same all-gathered codes with the same code.

Device dispatch (one function, :func:`quant_ops_for`): CUDA tensors use the Triton kernels of
:mod:`agoq.kernels.quant`, every other device uses :mod:`agoq.ref.quant`. The two produce identical
codes and scales (tests/kernels), so the choice never changes results; it is made by the tensor's
device, not by what is installed, and there is no silent fallback (a CUDA tensor without Triton
raises the ImportError).

Non-finite gradients: a block holding NaN or Inf gets a NaN scale (agoq.ref.quant's policy), so the
reduced block is NaN on every rank and Megatron's NaN check / the grad-norm check fire.

Wire bytes per rank and element (int8_b256, fp32 scales): (W-1)/W * (1 + 4/256) for the
all-to-all, the same again for the all-gather: about 2.03 bytes vs 8 (fp32 ring all-reduce) and
4 (bf16). Savings: 3.9x vs fp32, 1.97x vs bf16 on the wire. Caveats: two quantizations (before the
all-to-all and, all-reduce only, before the all-gather) add error bounded in docs/grads.md; the
padding to W x block elements costs at most W x block - 1 extra elements per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agoq.formats import QuantFormat, parse_format
from agoq.ref.quant import INPUT_DTYPES, QuantizedTensor

__all__ = [
    "DEFAULT_GRAD_FORMAT",
    "allreduce_8bit",
    "reduce_scatter_8bit",
    "reduce_scatter_int8",
    "make_reduce_scatter",
    "quant_ops_for",
    "check_grad_format",
    "padded_row_numel",
    "wire_bytes",
]

# AGoQ's gradient storage: 8-bit codes, one fp32 absmax scale per 256 elements (arXiv 2605.00539,
# algorithms.md §3.3). agoq uses the signed integer code instead of the paper's dynamic-tree map.
DEFAULT_GRAD_FORMAT = "int8_b256"
_SUPPORTED_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def quant_ops_for(device: torch.device) -> tuple[Callable, Callable]:
    """(quantize, dequantize) for tensors on ``device``: Triton kernels on CUDA, the reference elsewhere."""
    if torch.device(device).type == "cuda":
        from agoq.kernels.quant import dequantize, quantize  # imported lazily: needs Triton

        return quantize, dequantize
    from agoq.ref.quant import ref_dequantize, ref_quantize

    return ref_quantize, ref_dequantize


def check_grad_format(fmt: QuantFormat | str) -> QuantFormat:
    """Parse ``fmt`` and reject formats that cannot carry gradients through this reduction."""
    fmt = parse_format(fmt)
    if not fmt.quantized:
        raise ValueError(
            f"gradient format {fmt.name!r} is unquantized: use torch.distributed collectives (or "
            "Megatron's own DDP) for bf16/fp32 gradients, or pick a quantized format such as int8_b256"
        )
    if not fmt.signed:
        raise ValueError(f"gradient format {fmt.name!r} is unsigned; gradients need a signed format (int8_b256)")
    if fmt.rounding == "stochastic":
        raise NotImplementedError(
            f"gradient format {fmt.name!r} uses stochastic rounding, which needs a per-step seed the "
            "reduction does not plumb yet; use the round-to-nearest format (drop the _sr suffix)"
        )
    return fmt


def padded_row_numel(numel_per_row: int, block: int) -> int:
    """Elements per row after padding to whole blocks."""
    return -(-numel_per_row // block) * block


def wire_bytes(numel: int, world_size: int, fmt: QuantFormat | str, *, all_gather: bool = True) -> int:
    """Bytes one rank sends (= receives) for ``numel`` gradient elements, padding included."""
    fmt = check_grad_format(fmt)
    row = padded_row_numel(-(-numel // world_size), fmt.block)
    row_bytes = fmt.storage_bytes(row)
    phases = 2 if all_gather else 1
    return phases * (world_size - 1) * row_bytes


def _pack(q: QuantizedTensor, rows: int) -> torch.Tensor:
    """[rows, row_bytes] uint8: each row's codes followed by its scales' bytes."""
    codes_u8 = q.codes.view(rows, -1)
    scales_u8 = q.scales.contiguous().view(torch.uint8).view(rows, -1)
    return torch.cat([codes_u8, scales_u8], dim=1)


def _unpack(packed_u8: torch.Tensor, fmt: QuantFormat, row_numel: int) -> QuantizedTensor:
    """Inverse of :func:`_pack` for rows of ``row_numel`` elements (a multiple of fmt.block)."""
    rows = packed_u8.shape[0]
    code_bytes = fmt.code_bytes(row_numel)
    codes_u8 = packed_u8[:, :code_bytes].contiguous().view(-1)
    scale_dtype = _scale_dtype(fmt)
    scales = packed_u8[:, code_bytes:].contiguous().view(scale_dtype).view(-1)
    return QuantizedTensor(codes_u8, scales, fmt, torch.Size((rows, row_numel)), torch.float32)


def _scale_dtype(fmt: QuantFormat) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16, "pow2": torch.uint8}[fmt.scale]


def _rows(x_flat: torch.Tensor, world_size: int, row_numel: int, padded_numel: int) -> torch.Tensor:
    """[W, S_pad] view (or zero-padded copy) of W consecutive rows of ``row_numel`` elements."""
    if row_numel == padded_numel and x_flat.numel() == world_size * row_numel:
        return x_flat.view(world_size, padded_numel)
    rows = torch.zeros(world_size, padded_numel, dtype=x_flat.dtype, device=x_flat.device)
    src = torch.zeros(world_size * row_numel, dtype=x_flat.dtype, device=x_flat.device)
    src[: x_flat.numel()] = x_flat
    rows[:, :row_numel] = src.view(world_size, row_numel)
    return rows


def sum_rows_f32(rows_f32: torch.Tensor) -> torch.Tensor:
    """Sum of the rows of a [W, S] fp32 tensor in rank order (same rounding on every device)."""
    acc = rows_f32[0].clone()
    for r in range(1, rows_f32.shape[0]):
        acc += rows_f32[r]
    return acc


@dataclass
class _Pending:
    """What remains after the all-to-all: dequantize, sum, then either finish or all-gather."""

    work: dist.Work | None
    recv_u8: torch.Tensor
    fmt: QuantFormat
    group: dist.ProcessGroup | None
    world_size: int
    padded_numel: int
    row_numel: int
    average: bool
    finish: Callable[[torch.Tensor], None]  # consumes the fp32 reduced shard [padded_numel]
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        _, dequantize = quant_ops_for(self.recv_u8.device)
        peers_f32 = dequantize(_unpack(self.recv_u8, self.fmt, self.padded_numel), torch.float32)
        shard_f32 = sum_rows_f32(peers_f32)
        if self.average:
            shard_f32 /= self.world_size
        self.finish(shard_f32)
        self.done = True

    def is_completed(self) -> bool:
        return self.done


def _start(x_flat: torch.Tensor, world_size: int, row_numel: int, fmt: QuantFormat, group,
           op, async_op: bool, finish: Callable[[torch.Tensor], None]) -> _Pending:
    if op not in _SUPPORTED_OPS:
        raise ValueError(f"8-bit reduction supports ReduceOp.SUM and ReduceOp.AVG, got {op}")
    if x_flat.dtype not in INPUT_DTYPES:
        raise ValueError(f"8-bit reduction expects bf16/fp16/fp32 gradients, got {x_flat.dtype}")
    padded = padded_row_numel(row_numel, fmt.block)
    quantize, _ = quant_ops_for(x_flat.device)
    send_u8 = _pack(quantize(_rows(x_flat, world_size, row_numel, padded), fmt), world_size)
    recv_u8 = torch.empty_like(send_u8)
    work = dist.all_to_all_single(recv_u8, send_u8, group=group, async_op=async_op)
    return _Pending(work if async_op else None, recv_u8, fmt, group, world_size, padded, row_numel,
                    op == dist.ReduceOp.AVG, finish)


def reduce_scatter_8bit(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                        async_op: bool = False, *, fmt: QuantFormat | str = DEFAULT_GRAD_FORMAT):
    """``torch.distributed.reduce_scatter_tensor`` with 8-bit codes on the wire and an fp32 sum.

    ``input`` holds W equal shards (numel = W * output.numel()); rank r's ``output`` receives the sum
    over ranks of shard r. The owned shard is the fp32 sum of the dequantized peers (no second
    quantization). Returns a handle with ``wait()`` when ``async_op``, else None.
    """
    fmt = check_grad_format(fmt)
    world_size = dist.get_world_size(group)
    if input.numel() != world_size * output.numel():
        raise ValueError(
            f"reduce_scatter_8bit: input has {input.numel()} elements, expected world_size ({world_size}) x "
            f"output ({output.numel()}); pad the input to a multiple of the group size"
        )
    if not output.is_contiguous():
        raise ValueError("reduce_scatter_8bit: output must be contiguous")
    row_numel = output.numel()
    if row_numel == 0:
        return _Done() if async_op else None

    def finish(shard_f32: torch.Tensor) -> None:
        output.view(-1).copy_(shard_f32[:row_numel])

    pending = _start(input.detach().reshape(-1), world_size, row_numel, fmt, group, op, async_op, finish)
    if async_op:
        return pending
    pending.wait()
    return None


class _Done:
    """Handle of a reduction with nothing to move (zero elements)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@dataclass
class _AllReduceHandle:
    pending: _Pending
    tensor: torch.Tensor

    def wait(self) -> None:
        self.pending.wait()

    def is_completed(self) -> bool:
        return self.pending.done


def allreduce_8bit(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False, *,
                   fmt: QuantFormat | str = DEFAULT_GRAD_FORMAT):
    """In-place all-reduce (like ``torch.distributed.all_reduce``) through 8-bit codes.

    All-to-all of codes+scales, fp32 sum of the owned shard, requantization, all-gather of
    codes+scales, dequantization into ``tensor`` (any shape; must be contiguous). Every rank gets
    bit-identical values. Returns a handle with ``wait()`` when ``async_op`` (the all-gather then runs
    inside ``wait()``), else None.
    """
    fmt = check_grad_format(fmt)
    if not tensor.is_contiguous():
        raise ValueError("allreduce_8bit: tensor must be contiguous (it is reduced in place)")
    world_size = dist.get_world_size(group)
    flat = tensor.detach().view(-1)
    row_numel = -(-flat.numel() // world_size)
    if row_numel == 0:
        return _Done() if async_op else None
    finish = functools.partial(_gather_into, flat=flat, fmt=fmt, group=group, world_size=world_size)
    pending = _start(flat, world_size, row_numel, fmt, group, op, async_op, finish)
    if async_op:
        return _AllReduceHandle(pending, tensor)
    pending.wait()
    return None


def _gather_into(shard_f32: torch.Tensor, *, flat: torch.Tensor, fmt: QuantFormat, group, world_size: int) -> None:
    """Requantize the reduced shard, all-gather codes+scales, dequantize every rank's shard into flat."""
    quantize, dequantize = quant_ops_for(shard_f32.device)
    mine_u8 = _pack(quantize(shard_f32, fmt), 1).view(-1)
    gathered_u8 = torch.empty(world_size * mine_u8.numel(), dtype=torch.uint8, device=mine_u8.device)
    _all_gather_single(gathered_u8, mine_u8, group=group)  # gloo wants a flat output
    gathered_u8 = gathered_u8.view(world_size, -1)
    full = dequantize(_unpack(gathered_u8, fmt, shard_f32.numel()), flat.dtype).view(-1)
    if full.numel() == flat.numel():
        flat.copy_(full)
        return
    row_numel = -(-flat.numel() // world_size)
    full = full.view(world_size, -1)[:, :row_numel].reshape(-1)
    flat.copy_(full[: flat.numel()])


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """all_gather_into_tensor under its newer name where torch has it (2.14 deprecates the old one)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def make_reduce_scatter(fmt: QuantFormat | str) -> Callable:
    """A function with exactly ``reduce_scatter_tensor``'s signature that reduces in ``fmt``
    (for ``megatron.core.distributed.param_and_grad_buffer.dist_reduce_scatter_func``)."""
    fmt = check_grad_format(fmt)

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return reduce_scatter_8bit(output, input, op, group, async_op, fmt=fmt)

    reduce_scatter.__name__ = f"reduce_scatter_{fmt.name}"
    return reduce_scatter


reduce_scatter_int8 = make_reduce_scatter(DEFAULT_GRAD_FORMAT)
"""The architecture's name (spec §8.4 item 3): reduce_scatter_tensor's signature, int8_b256 codes."""
