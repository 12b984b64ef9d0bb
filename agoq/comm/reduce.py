"""Precision-preserving 8-bit gradient reduction on plain ``torch.distributed`` process groups.

Algorithm (AGoQ, arXiv 2605.00539; the data movement of ZeRO++ qgZ)::

    x (float, N elements, every rank)
      -> W rows of S elements (row r = x[r*S : (r+1)*S]); all-reduce: S = ceil(N/W) rounded up to
         whole blocks; reduce-scatter: S = the output size, each row zero-padded to whole blocks
      -> quantize (codes + one scale per block; blocks never straddle rows)
      -> all_to_all of [codes | scales]: rank r receives row r of every peer
      -> dequantize the W received rows, sum them in fp32 in rank order (0, 1, ..., W-1)
      -> reduce_scatter_8bit: write the fp32 sum (the owned shard) to the output; done
      -> allreduce_8bit:      requantize the sum, all_gather [codes | scales],
                              dequantize all W rows into the input tensor (in place)

Every step runs chunk by chunk (agoq.comm.pipeline): quantization of the next chunk overlaps the
communication of the current one and no full-size temporary exists (temporaries: two slots of
``chunk_bytes`` codes per buffer; ``chunk_bytes=None`` picks ~4 chunks within 16-64 MiB). On CUDA,
one-byte formats use fused Triton kernels (agoq.kernels.comm): quantize straight from the float
input into the packed send buffer, one kernel for dequantize + sum + requantize of the received
rows, dequantize straight into the destination. Results are bit-identical to
agoq.ref.collectives on every device and chunk size.

8-bit storage (agoq.comm.grad_buffer) is reduced without any float copy: :func:`allreduce_blocks_`
sends the stored codes as they are and all-gathers the reduced codes back into the same storage
(:func:`allreduce_stored_` picks it or, at two ranks, :func:`allreduce_blocks_gather_`: the same result in one
collective per chunk); :func:`reduce_blocks_to_owners` delivers the fp32 sum of a block range to each rank (the
distributed-optimizer layout).

Codes are never summed on the wire: the backend moves bytes only. Every rank ends with
bit-identical values in the all-reduce case (all dequantize the same all-gathered codes).
Non-finite gradients: a block holding NaN or Inf gets a NaN scale, so the reduced block is NaN on
every rank that receives it and Megatron's NaN check / the grad-norm check fire.

Wire bytes per rank and element (int8_b256, fp32 scales): (W-1)/W * (1 + 4/256) for the
all-to-all, the same again for the all-gather: about 2.03 bytes vs 8 (fp32 ring all-reduce) and
4 (bf16). Caveats: two quantizations (before the all-to-all and, all-reduce only, before the
all-gather) add error bounded in docs/numerics.md; the padding to W x block elements costs at most
W x block - 1 extra elements per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from agoq.comm import pipeline as pl
from agoq.formats import QuantFormat, parse_format
from agoq.ref.quant import INPUT_DTYPES

__all__ = [
    "DEFAULT_GRAD_FORMAT",
    "allreduce_8bit",
    "reduce_scatter_8bit",
    "reduce_scatter_int8",
    "make_reduce_scatter",
    "allreduce_blocks_",
    "allreduce_blocks_gather_",
    "allreduce_stored_",
    "stored_allreduce_route",
    "reduce_blocks_to_owners",
    "quant_ops_for",
    "check_grad_format",
    "padded_row_numel",
    "allreduce_row_numel",
    "wire_bytes",
]

# AGoQ's gradient storage: 8-bit codes, one fp32 absmax scale per 256 elements (arXiv 2605.00539).
# agoq uses the signed integer code instead of the paper's dynamic-tree map.
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


def allreduce_row_numel(numel: int, world_size: int, fmt: QuantFormat) -> int:
    """Row length S of the all-reduce: ceil(N / W) rounded up to whole blocks, so rows start on the
    tensor's own block grid (and 16-byte aligned); the last row(s) are zero-padded past N."""
    return padded_row_numel(-(-numel // world_size), fmt.block)


def _check_op(op, dtype: torch.dtype) -> bool:
    if op not in _SUPPORTED_OPS:
        raise ValueError(f"8-bit reduction supports ReduceOp.SUM and ReduceOp.AVG, got {op}")
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"8-bit reduction expects bf16/fp16/fp32 gradients, got {dtype}")
    return op == dist.ReduceOp.AVG


# Packed rows are padded to this many bytes so that every row (and its codes) starts 16-byte aligned:
# Triton then proves alignment of the row pointers and vectorises the byte loads (16 B per access
# instead of 1; checked in the PTX of the Triton 3.6 sm_90 build).
ROW_ALIGN_BYTES = 16


def _row_bytes(nb: int, fmt: QuantFormat) -> int:
    raw = nb * (fmt.code_bytes(fmt.block) + fmt.scale_bytes)
    return -(-raw // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES


def _packed(buf_u8: torch.Tensor, rows: int, nb: int, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [rows, nb*cb], scales [rows, nb]) views of a packed [rows, codes | scales | pad] byte buffer."""
    cb = nb * fmt.code_bytes(fmt.block)
    packed = buf_u8.view(rows, _row_bytes(nb, fmt))
    return packed[:, :cb], packed[:, cb: cb + nb * fmt.scale_bytes].view(pl.scale_dtype(fmt))


class _FloatRows:
    """Chunk geometry and stages of a float reduction over W rows of ``row_numel`` elements."""

    def __init__(self, flat: torch.Tensor, fmt: QuantFormat, group, world: int, row_numel: int,
                 average: bool, post_scale: float, chunk_bytes: int | None):
        self.flat, self.fmt, self.group, self.world = flat, fmt, group, world
        self.row_numel, self.average, self.post_scale = row_numel, average, post_scale
        self.nb_row = fmt.num_blocks(row_numel)
        self.cb_chunk = min(self.nb_row, pl.blocks_per_chunk(fmt, world, chunk_bytes, world * self.nb_row))
        self.num_chunks = -(-self.nb_row // self.cb_chunk)
        self.slots = pl.Slots(flat.device)
        self.ops = pl.comm_ops_for(flat.device, fmt)

    def nb(self, k: int) -> int:
        return min(self.cb_chunk, self.nb_row - k * self.cb_chunk)

    def col0(self, k: int) -> int:
        return k * self.cb_chunk * self.fmt.block

    def send(self, k: int) -> list:
        nb, w = self.nb(k), self.world
        send = self.slots.get("send", k, w * _row_bytes(nb, self.fmt), torch.uint8)
        codes, scales = _packed(send, w, nb, self.fmt)
        self.ops[0](self.flat, codes, scales, self.fmt, row_stride=self.row_numel, row_numel=self.row_numel,
                    col0=self.col0(k))
        recv = self.slots.get("recv", k, send.numel(), torch.uint8)
        return [pl.all_to_all(recv, send, self.group)]

    def received(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.nb(k)
        return _packed(self.slots.get("recv", k, self.world * _row_bytes(nb, self.fmt), torch.uint8),
                       self.world, nb, self.fmt)

    def reduce_into(self, k: int, out: torch.Tensor) -> list:
        """Reduce-scatter stage: the fp32 sum of chunk k of the owned row, cast into ``out``."""
        codes, scales = self.received(k)
        valid = min(self.row_numel - self.col0(k), self.nb(k) * self.fmt.block)
        self.ops[1](codes, scales, self.fmt, average=self.average, post_scale=self.post_scale,
                    out=out[self.col0(k): self.col0(k) + valid], out_numel=valid)
        return []

    def reduce_requant(self, k: int) -> list:
        """All-reduce stage: requantize chunk k of the owned row and all-gather it."""
        nb = self.nb(k)
        codes, scales = self.received(k)
        mine = self.slots.get("mine", k, _row_bytes(nb, self.fmt), torch.uint8)
        m_codes, m_scales = _packed(mine, 1, nb, self.fmt)
        self.ops[1](codes, scales, self.fmt, average=self.average, post_scale=self.post_scale,
                    codes_out=m_codes, scales_out=m_scales)
        gathered = self.slots.get("gathered", k, self.world * mine.numel(), torch.uint8)
        return [pl.all_gather(gathered, mine, self.group)]

    def finish(self, k: int) -> None:
        nb = self.nb(k)
        gathered = self.slots.get("gathered", k, self.world * _row_bytes(nb, self.fmt), torch.uint8)
        codes, scales = _packed(gathered, self.world, nb, self.fmt)
        self.ops[2](codes, scales, self.flat, self.fmt, row_stride=self.row_numel, row_numel=self.row_numel,
                    col0=self.col0(k))


def reduce_scatter_8bit(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                        async_op: bool = False, *, fmt: QuantFormat | str = DEFAULT_GRAD_FORMAT,
                        post_scale: float = 1.0, chunk_bytes: int | None = None):
    """``torch.distributed.reduce_scatter_tensor`` with 8-bit codes on the wire and an fp32 sum.

    ``input`` holds W equal shards (numel = W * output.numel()); rank r's ``output`` receives the sum
    over ranks of shard r (times ``post_scale``; divided by W for AVG). The owned shard is the fp32
    sum of the dequantized peers (no second quantization). Returns a handle with ``wait()`` when
    ``async_op``, else None. Both tensors must stay alive until the handle is waited on.
    """
    fmt = check_grad_format(fmt)
    average = _check_op(op, input.dtype)
    world = dist.get_world_size(group)
    if input.numel() != world * output.numel():
        raise ValueError(
            f"reduce_scatter_8bit: input has {input.numel()} elements, expected world_size ({world}) x "
            f"output ({output.numel()}); pad the input to a multiple of the group size"
        )
    if not output.is_contiguous():
        raise ValueError("reduce_scatter_8bit: output must be contiguous")
    if output.numel() == 0:
        return pl.Done() if async_op else None
    rows = _FloatRows(input.detach().reshape(-1), fmt, group, world, output.numel(), average, post_scale,
                      chunk_bytes)
    out = output.detach().view(-1)
    return pl.run_pipeline(input.device, rows.num_chunks, rows.send, lambda k: rows.reduce_into(k, out), None,
                           async_op=async_op)


def allreduce_8bit(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False, *,
                   fmt: QuantFormat | str = DEFAULT_GRAD_FORMAT, post_scale: float = 1.0,
                   chunk_bytes: int | None = None):
    """In-place all-reduce (like ``torch.distributed.all_reduce``) through 8-bit codes.

    Rows of S = ceil(N / W) elements rounded up to whole blocks; all-to-all of codes+scales, fp32 sum
    of the owned row (times ``post_scale``; / W for AVG), requantization, all-gather of codes+scales,
    dequantization into ``tensor`` (any shape; must be contiguous). Every rank gets bit-identical
    values. Returns a handle with ``wait()`` when ``async_op``, else None; ``tensor`` must stay alive
    until it is waited on.
    """
    fmt = check_grad_format(fmt)
    average = _check_op(op, tensor.dtype)
    if not tensor.is_contiguous():
        raise ValueError("allreduce_8bit: tensor must be contiguous (it is reduced in place)")
    world = dist.get_world_size(group)
    flat = tensor.detach().view(-1)
    row_numel = allreduce_row_numel(flat.numel(), world, fmt)
    if row_numel == 0:
        return pl.Done() if async_op else None
    rows = _FloatRows(flat, fmt, group, world, row_numel, average, post_scale, chunk_bytes)
    return pl.run_pipeline(tensor.device, rows.num_chunks, rows.send, rows.reduce_requant, rows.finish,
                           async_op=async_op)


# -- 8-bit storage ---------------------------------------------------------------------------------

def _check_storage(codes_u8: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> int:
    num_blocks = scales.numel()
    if codes_u8.dtype != torch.uint8 or codes_u8.numel() != num_blocks * fmt.code_bytes(fmt.block):
        raise ValueError(f"codes ({codes_u8.numel()} bytes, {codes_u8.dtype}) do not match {num_blocks} "
                         f"blocks of {fmt.name}")
    if scales.dtype != pl.scale_dtype(fmt) or not (codes_u8.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"scales must be contiguous {pl.scale_dtype(fmt)} for {fmt.name}, got {scales.dtype}")
    return num_blocks


def allreduce_blocks_(codes_u8: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat | str, group=None, *,
                      average: bool = False, post_scale: float = 1.0, async_op: bool = False,
                      chunk_bytes: int | None = None):
    """All-reduce 8-bit storage in place: ``codes_u8`` / ``scales`` of B blocks (B a multiple of W).

    Chunk k holds blocks [k W C, (k+1) W C) (C blocks per rank); rank r owns the r-th C blocks of each
    chunk. The stored codes are sent as they are (no quantization pass), each rank sums its blocks
    of all peers in fp32 (rank order; / W if ``average``; times ``post_scale``), requantizes, and the
    reduced blocks are all-gathered back into the same storage. The block grid is the storage's own,
    so blocks never mix parameters. With one rank and nothing to scale, nothing happens.
    """
    fmt = check_grad_format(fmt)
    num_blocks = _check_storage(codes_u8, scales, fmt)
    world = dist.get_world_size(group)
    if num_blocks % world:
        raise ValueError(f"allreduce_blocks_: {num_blocks} blocks are not a multiple of the group size "
                         f"{world}; allocate the storage with block_multiple={world}")
    if num_blocks == 0 or (world == 1 and post_scale == 1.0):
        return pl.Done() if async_op else None
    cb = fmt.code_bytes(fmt.block)
    per_rank = min(num_blocks // world, pl.blocks_per_chunk(fmt, world, chunk_bytes, num_blocks))
    num_chunks = -(-num_blocks // (world * per_rank))
    slots, ops = pl.Slots(codes_u8.device), pl.comm_ops_for(codes_u8.device, fmt)
    sdt = pl.scale_dtype(fmt)

    def nb(k: int) -> int:
        return min(per_rank, (num_blocks - k * world * per_rank) // world)

    def stored(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        b0, n = k * world * per_rank, world * nb(k)
        return codes_u8[b0 * cb: (b0 + n) * cb], scales[b0: b0 + n]

    def received(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = world * nb(k)
        return slots.get("rc", k, n * cb, torch.uint8), slots.get("rs", k, n, sdt)

    def send(k: int) -> list:
        (c, s), (rc, rs) = stored(k), received(k)
        return [pl.all_to_all(rc, c, group), pl.all_to_all(rs, s, group)]

    def reduce(k: int) -> list:
        n = nb(k)
        rc, rs = received(k)
        mc, ms = slots.get("mc", k, n * cb, torch.uint8), slots.get("ms", k, n, sdt)
        ops[1](rc.view(world, n * cb), rs.view(world, n), fmt, average=average, post_scale=post_scale,
               codes_out=mc, scales_out=ms)
        c, s = stored(k)
        return [pl.all_gather(c, mc, group), pl.all_gather(s, ms, group)]

    return pl.run_pipeline(codes_u8.device, num_chunks, send, reduce, None, async_op=async_op)


def allreduce_blocks_gather_(codes_u8: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat | str, group=None, *,
                             average: bool = False, post_scale: float = 1.0, async_op: bool = False,
                             chunk_bytes: int | None = None):
    """:func:`allreduce_blocks_` through one all-gather per chunk: every rank receives every peer's stored blocks
    and reduces all of them itself, with the same kernel, inputs and rank order as the owner does there, so the
    storage ends bit-identical to :func:`allreduce_blocks_`'s. Any number of blocks (no multiple of W needed).

    Wire bytes per rank: (W - 1) x the storage, against 2 (W - 1) / W x in allreduce_blocks_'s all-to-all +
    all-gather; equal at W = 2, where this needs one ring collective per chunk instead of an all-to-all and an
    all-gather. Measured motive: on the socket link NCCL's int8 all-to-all + all-gather reached only 1.45x its bf16
    all-reduce at 160 MiB where the bytes say ~2x (docs/benchmarks/grads.md); benchmarks/bench_allreduce.py times
    both (``agoq_store_allreduce_gather``, ``raw_int8_allgather``). Temporaries: two slots of W x ~``chunk_bytes``.
    """
    fmt = check_grad_format(fmt)
    num_blocks = _check_storage(codes_u8, scales, fmt)
    world = dist.get_world_size(group)
    if num_blocks == 0 or (world == 1 and post_scale == 1.0):
        return pl.Done() if async_op else None
    cb, sdt = fmt.code_bytes(fmt.block), pl.scale_dtype(fmt)
    per_chunk = min(num_blocks, pl.blocks_per_chunk(fmt, world, chunk_bytes, num_blocks))
    num_chunks = -(-num_blocks // per_chunk)
    slots, ops = pl.Slots(codes_u8.device), pl.comm_ops_for(codes_u8.device, fmt)

    def stored(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        b0 = k * per_chunk
        b1 = min(num_blocks, b0 + per_chunk)
        return codes_u8[b0 * cb: b1 * cb], scales[b0: b1]

    def gathered(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = stored(k)[1].numel()
        return slots.get("gc", k, world * n * cb, torch.uint8), slots.get("gs", k, world * n, sdt)

    def send(k: int) -> list:
        (c, s), (gc, gs) = stored(k), gathered(k)
        return [pl.all_gather(gc, c, group), pl.all_gather(gs, s, group)]

    def reduce(k: int) -> list:
        (c, s), (gc, gs) = stored(k), gathered(k)
        ops[1](gc.view(world, -1), gs.view(world, -1), fmt, average=average, post_scale=post_scale,
               codes_out=c, scales_out=s)
        return []

    return pl.run_pipeline(codes_u8.device, num_chunks, send, reduce, None, async_op=async_op)


# Largest group that reduces the 8-bit store through one all-gather per chunk (allreduce_blocks_gather_). At W = 2
# it sends exactly the bytes of all-to-all + all-gather, in one collective; above, (W - 1) x the storage against
# 2 (W - 1) / W x. Measured, NCCL over sockets between 2 H100s (benchmarks/results/grads_socket.json, 2026-11-27):
# 8.25 / 19.1 / 26.3 ms against 9.58 / 22.6 / 33.0 ms at 64 / 160 / 256 MiB of fp32 gradient; at 4 H100s on NVLink
# through NCCL (grads_4gpu.json) 4.25 against 2.26 ms at 160 MiB.
GATHER_ROUTE_MAX_WORLD = 2


def stored_allreduce_route(world: int) -> Callable:
    """The all-reduce of 8-bit storage for a group of ``world`` ranks: :func:`allreduce_blocks_gather_` up to
    :data:`GATHER_ROUTE_MAX_WORLD` ranks, :func:`allreduce_blocks_` above. Both leave bit-identical storage."""
    return allreduce_blocks_gather_ if world <= GATHER_ROUTE_MAX_WORLD else allreduce_blocks_


def allreduce_stored_(codes_u8: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat | str, group=None, **kwargs):
    """All-reduce 8-bit storage in place by :func:`stored_allreduce_route`'s route for the group's size (the
    keyword arguments are those of :func:`allreduce_blocks_`)."""
    return stored_allreduce_route(dist.get_world_size(group))(codes_u8, scales, fmt, group, **kwargs)


def reduce_blocks_to_owners(codes_u8: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat | str,
                            ranges: list[tuple[int, int]], consume: Callable[[int, torch.Tensor], None],
                            group=None, *, average: bool = False, post_scale: float = 1.0,
                            async_op: bool = False, chunk_bytes: int | None = None):
    """Reduce-scatter of 8-bit storage by block ranges: rank r receives blocks ``ranges[r]`` (lo, hi) of
    every peer (ranges may overlap) and gets their fp32 sum (rank order; / W if ``average``; times
    ``post_scale``) through ``consume(first_block, values_f32)`` (``values_f32`` holds whole blocks and is
    only valid during the call), chunk by chunk. The storage is not modified.
    """
    fmt = check_grad_format(fmt)
    num_blocks = _check_storage(codes_u8, scales, fmt)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(ranges) != world or any(not (0 <= lo <= hi <= num_blocks) for lo, hi in ranges):
        raise ValueError(f"reduce_blocks_to_owners: need {world} block ranges within [0, {num_blocks}], "
                         f"got {ranges}")
    cb, sdt = fmt.code_bytes(fmt.block), pl.scale_dtype(fmt)
    widest = max(hi - lo for lo, hi in ranges)
    per_rank = max(1, min(widest, pl.blocks_per_chunk(fmt, world, chunk_bytes, world * widest)))
    num_chunks = max(-(-(hi - lo) // per_rank) for lo, hi in ranges)
    slots, ops = pl.Slots(codes_u8.device), pl.comm_ops_for(codes_u8.device, fmt)

    def piece(r: int, k: int) -> tuple[int, int]:
        lo, hi = ranges[r]
        start = min(hi, lo + k * per_rank)
        return start, min(hi, start + per_rank)

    def counts(k: int) -> list[int]:
        return [b - a for a, b in (piece(r, k) for r in range(world))]

    def send(k: int) -> list:
        n = counts(k)
        total, mine = sum(n), n[rank]
        sc, ss = slots.get("sc", k, total * cb, torch.uint8), slots.get("ss", k, total, sdt)
        at = 0
        for r in range(world):
            a, b = piece(r, k)
            sc[at * cb: (at + b - a) * cb].copy_(codes_u8[a * cb: b * cb])
            ss[at: at + b - a].copy_(scales[a:b])
            at += b - a
        rc, rs = slots.get("rc", k, world * mine * cb, torch.uint8), slots.get("rs", k, world * mine, sdt)
        return [pl.all_to_all(rc, sc, group, [mine * cb] * world, [x * cb for x in n]),
                pl.all_to_all(rs, ss, group, [mine] * world, n)]

    def reduce(k: int) -> list:
        mine = counts(k)[rank]
        if mine == 0:
            return []
        rc, rs = slots.get("rc", k, world * mine * cb, torch.uint8), slots.get("rs", k, world * mine, sdt)
        out = slots.get("out", k, mine * fmt.block, torch.float32)
        ops[1](rc.view(world, mine * cb), rs.view(world, mine), fmt, average=average, post_scale=post_scale,
               out=out, out_numel=out.numel())
        consume(piece(rank, k)[0], out)
        return []

    return pl.run_pipeline(codes_u8.device, num_chunks, send, reduce, None, async_op=async_op)


def make_reduce_scatter(fmt: QuantFormat | str) -> Callable:
    """A function with exactly ``reduce_scatter_tensor``'s signature that reduces in ``fmt``
    (for ``megatron.core.distributed.param_and_grad_buffer.dist_reduce_scatter_func``)."""
    fmt = check_grad_format(fmt)

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return reduce_scatter_8bit(output, input, op, group, async_op, fmt=fmt)

    reduce_scatter.__name__ = f"reduce_scatter_{fmt.name}"
    return reduce_scatter


reduce_scatter_int8 = make_reduce_scatter(DEFAULT_GRAD_FORMAT)
"""The int8_b256 reduce-scatter under the name the architecture gives it (reduce_scatter_tensor's signature)."""
