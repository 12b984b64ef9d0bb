"""8-bit gradient storage that the peers of its group read and write over NVLink: the peer transport of the
store-mode reductions (:func:`agoq.comm.reduce.allreduce_blocks_`, :func:`~agoq.comm.reduce.reduce_blocks_to_owners`).

:class:`SymmetricBlocks` holds the codes and scales of B blocks (B a multiple of the group size W) in one
CUDA symmetric-memory allocation (``torch.distributed._symmetric_memory``) that every rank maps. The 8-bit
gradient store (agoq.comm.grad_buffer.QuantizedGradBuffer) uses these tensors as its own storage, so a
reduction reads the peers' stored codes where they lie (and the all-reduce writes its results there): no send
buffer, no copy, no NCCL call, and no memory beyond the store itself. Rows: rank r owns blocks [r B/W, (r+1) B/W).

all-reduce (two-shot with a push, bit for bit allreduce_blocks_'s result: every block is the fp32 sum over ranks
in rank order, times post_scale, / W if averaging, requantized with a fresh absmax)::

    barrier                                        every rank's accumulation into its store is done
    reduce_peer_rows(segment r of every peer -> segment r of every peer, requantized; one kernel whose loads
                     and stores are the communication: the input and the output address tables are the same rows)
    barrier                                        every rank's store holds every reduced segment

Why this is safe (rank r, segment r = blocks [r B/W, (r+1) B/W)):

* only rank r reads or writes segment r, on any rank, during the call (rank q's kernel touches segment q only),
  so the W kernels never race with each other;
* within the kernel each block is read from all W peers before it is written: a program owns its blocks, and
  every code and scale it stores depends on the block's absmax, i.e. on all W loads of that block (in place
  through the same table, as the reference reads every input before writing, agoq.ref.comm);
* the first barrier makes sure every rank's backward (the accumulation into its store, stream-ordered before
  the barrier's release) finished writing before any peer reads it;
* the final barrier makes every rank's store complete before anyone reads it (the optimizer) or rewrites it
  (the store is zeroed after the step): each rank's pushed stores are stream-ordered before its release on the
  signal pads, and a rank passes the barrier only after acquiring every peer's.

This replaced a pull (reduce into my own segment, barrier, copy segment p from peer p for every p, barrier):
one barrier and 2 (W - 1) copy launches fewer per call, the same bytes over NVLink (written instead of read).

reduce to owners (distributed optimizer; rank r gets the fp32 sum of blocks ranges[r] of every peer, which
may overlap a neighbour's range by a block, and hands it to ``consume`` chunk by chunk, as
reduce_blocks_to_owners does; with ``float_spans``, the blocks outside them are requantized by the reduce
kernel into r's own store rows instead, the 8-bit store's case)::

    barrier; for each run of my range: float run: per chunk reduce_peer_rows(-> fp32 chunk); consume(first, chunk)
                                        other run: reduce_peer_rows(-> my own rows, requantized), one launch
    barrier

The closing barrier lets the caller rewrite blocks that neighbours read (the shared boundary blocks) and
zero the store afterwards (nothing is pushed there: the sums are needed by their owner only). All barriers are
the symmetric-memory handle's stream-ordered device barriers (no host synchronisation); Megatron issues the
bucket reductions in the same order on every rank.

Memory: the allocation is the store (codes + scales, 1.016 B per element for int8_b256) rounded up to
16 bytes. It comes from the symmetric-memory allocator, not PyTorch's caching allocator, so
``torch.cuda.max_memory_allocated`` does not see it: :func:`symmetric_bytes` reports it, and agoq's memory
report adds it (docs/benchmarks/grads.md).

Requirements (checked; it raises, never falls back): CUDA tensors, one-byte formats (int8 round-to-nearest,
fp8), ranks that can map each other's memory (one NVLink domain, e.g. one host), torch with symmetric
memory. NVLink multicast is not used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from agoq.comm import pipeline as pl
from agoq.comm.reduce import ROW_ALIGN_BYTES, check_grad_format
from agoq.comm.symm import _check_device, _symm_mem, enable_group
from agoq.formats import QuantFormat, uses_bytes_kernel

__all__ = ["SymmetricBlocks", "split_segments", "symmetric_bytes"]

_ALLOCATED_BYTES = [0]  # symmetric bytes held by live SymmetricBlocks of this process


def symmetric_bytes() -> int:
    """Bytes of CUDA symmetric memory held by this process's 8-bit gradient stores (not in torch's
    allocator statistics)."""
    return _ALLOCATED_BYTES[0]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES


class SymmetricBlocks:
    """Codes and scales of ``num_blocks`` blocks of ``fmt`` that every rank of ``group`` maps (module
    docstring). Collective: every rank of the group constructs it with the same arguments, in the same order."""

    def __init__(self, group, fmt: QuantFormat | str, num_blocks: int, device: torch.device):
        self.fmt = check_grad_format(fmt)
        if not uses_bytes_kernel(self.fmt):
            raise ValueError(f"agoq peer transport: format {self.fmt.name} has no fused kernel (one-byte formats "
                             "only: int8 round-to-nearest, fp8); use --agoq-grad-transport nccl")
        _check_device(device)
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if num_blocks % self.world:
            raise ValueError(f"SymmetricBlocks: {num_blocks} blocks are not a multiple of the group size "
                             f"{self.world}")
        self.num_blocks, self.cb = num_blocks, self.fmt.code_bytes(self.fmt.block)
        self.nbytes = _aligned(num_blocks * self.cb) + _aligned(num_blocks * pl.scale_dtype(self.fmt).itemsize)
        symm_mem = _symm_mem()
        name = self.group.group_name
        enable_group(symm_mem, name)
        self.buffer = symm_mem.empty(max(self.nbytes, ROW_ALIGN_BYTES), dtype=torch.uint8, device=device)
        try:
            self.handle = symm_mem.rendezvous(self.buffer, name)
        except RuntimeError as err:
            raise RuntimeError(f"agoq peer transport: the ranks of group {name!r} cannot map each other's memory "
                               f"({err}); use --agoq-grad-transport nccl") from err
        self._map([self.buffer if p == self.rank else self.handle.get_buffer(p, (self.buffer.numel(),), torch.uint8)
                   for p in range(self.world)])  # fmt: skip
        self.codes_u8.zero_()
        self.scales.zero_()
        _ALLOCATED_BYTES[0] += self.buffer.numel()

    def _map(self, peers: list[torch.Tensor]) -> None:
        """The codes and scales views of every rank's buffer (``peers``, rank order, ``nbytes`` uint8 each): codes
        first, scales from the next 16-byte boundary. (tests/kernels/test_comm_kernels.py emulates the W ranks on
        the CPU through it, with local buffers and a recording barrier.)"""
        sdt = pl.scale_dtype(self.fmt)
        codes_bytes = _aligned(self.num_blocks * self.cb)
        self.peer_codes = [b[: self.num_blocks * self.cb] for b in peers]
        self.peer_scales = [b[codes_bytes: codes_bytes + self.num_blocks * sdt.itemsize].view(sdt) for b in peers]
        self.codes_u8, self.scales = self.peer_codes[self.rank], self.peer_scales[self.rank]
        self._tables: dict[tuple[int, int], tuple] = {}  # (first, last) block -> rows + address tables

    def __del__(self):
        _ALLOCATED_BYTES[0] -= getattr(self, "buffer", torch.empty(0)).numel()

    def _rows(self, first: int, last: int) -> tuple:
        """Blocks [first, last) of every peer, in rank order, with their address tables (built once)."""
        got = self._tables.get((first, last))
        if got is None:
            from agoq.kernels.comm import peer_tables

            codes = [c[first * self.cb: last * self.cb] for c in self.peer_codes]
            scales = [s[first:last] for s in self.peer_scales]
            got = (codes, scales, peer_tables(codes, scales))
            self._tables[(first, last)] = got
        return got

    def allreduce_(self, *, average: bool, post_scale: float) -> None:
        """All-reduce of the stored blocks in place: barrier, one reduce kernel pushing this rank's reduced segment
        into every peer's store, barrier (module docstring: why that is safe); stream-ordered, no host sync."""
        from agoq.kernels.comm import reduce_peer_rows  # Triton: imported lazily

        if self.num_blocks == 0 or (self.world == 1 and post_scale == 1.0):
            return
        per = self.num_blocks // self.world
        lo, hi = self.rank * per, (self.rank + 1) * per
        codes, scales, tables = self._rows(lo, hi)  # segment r of every peer: the inputs and the outputs
        self.handle.barrier(channel=0)
        reduce_peer_rows(codes, scales, self.fmt, average=average, post_scale=post_scale, tables=tables,
                         codes_out_rows=codes, scales_out_rows=scales, out_tables=tables)
        self.handle.barrier(channel=0)

    def reduce_to_owners(self, ranges: list[tuple[int, int]], consume: Callable[[int, torch.Tensor], None], *,
                         average: bool, post_scale: float, chunk_blocks: int,
                         float_spans: list[tuple[int, int]] | None = None) -> None:
        """Rank r: the fp32 sum of blocks ``ranges[r]`` of every peer, handed to ``consume(first_block,
        values_f32)`` chunk by chunk (``values_f32`` is valid only during the call; stream-ordered).

        ``float_spans`` (sorted, disjoint block intervals): when given, only those blocks of the range go
        through fp32 and ``consume``; every other block of it is summed and requantized by the reduce kernel
        straight into this rank's own store rows (one pass, no fp32 chunk, no separate quantize). In place is
        safe for a block no other rank's range holds: no peer reads it and no peer writes it; the caller
        passes the blocks shared with a neighbour's range (and any it needs in fp32) as float spans."""
        from agoq.kernels.comm import reduce_peer_rows

        if len(ranges) != self.world or any(not (0 <= lo <= hi <= self.num_blocks) for lo, hi in ranges):
            raise ValueError(f"reduce_to_owners: need {self.world} block ranges within [0, {self.num_blocks}], "
                             f"got {ranges}")
        lo, hi = ranges[self.rank]
        segments = [(lo, hi, True)] if float_spans is None else split_segments(lo, hi, float_spans)
        float_len = max((z - a for a, z, is_float in segments if is_float), default=0)
        chunk = max(1, min(chunk_blocks, hi - lo))
        block = self.fmt.block
        # one chunk of fp32 sums per call, returned to the caching allocator at the end (kept per store, it
        # cost ~1 GiB over the 28 buckets of a ~1B model at DP=2: benchmarks/results/dp2_link.json, 13:08 run)
        fp32 = torch.empty(min(chunk, float_len) * block, dtype=torch.float32, device=self.codes_u8.device)
        self.handle.barrier(channel=0)
        for a, z, is_float in segments:
            # an fp32 run goes chunk by chunk (one fp32 chunk held); an in-place run in one launch: chunking it
            # only multiplied the host work per launch (reduce-to-owners measured slower than the all-reduce it
            # halves, 0.283 vs 0.208 ms at 160 MiB on 2 x H100: three launches there, one here)
            step = chunk if is_float else max(1, z - a)
            for first in range(a, z, step):
                last = min(z, first + step)
                codes, scales, tables = self._rows(first, last)
                if not is_float:
                    reduce_peer_rows(codes, scales, self.fmt, average=average, post_scale=post_scale,
                                     codes_out=codes[self.rank], scales_out=scales[self.rank], tables=tables)
                    continue
                out = fp32[: (last - first) * block]
                reduce_peer_rows(codes, scales, self.fmt, average=average, post_scale=post_scale, out=out,
                                 out_numel=out.numel(), tables=tables)
                consume(first, out)
        self.handle.barrier(channel=0)


def split_segments(lo: int, hi: int, float_spans: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """[lo, hi) cut into consecutive (first, last, is_float) runs: ``is_float`` where a span of ``float_spans``
    (sorted, disjoint) covers the block. Empty runs are left out."""
    out, at, prev = [], lo, None
    for a, z in float_spans:
        if a > z or (prev is not None and a < prev):
            raise ValueError(f"float spans must be sorted, disjoint intervals; got {float_spans}")
        prev = z
        a, z = max(a, lo, at), min(z, hi)
        if a >= z:
            continue
        if a > at:
            out.append((at, a, False))
        out.append((a, z, True))
        at = z
    if at < hi:
        out.append((at, hi, False))
    return out
