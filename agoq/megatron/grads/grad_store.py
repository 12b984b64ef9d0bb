"""8-bit main_grad of one Megatron DDP bucket (``--agoq-grads`` store mode): accumulation, reduction
and the ways the reduced gradient reaches an optimizer, without a full float gradient buffer.

Layout: one QuantizedGradBuffer per bucket, one segment (own block grid) per parameter, segments in
the order of the parameters' offsets in Megatron's bucket (``bucket.param_to_index``), block count
padded to a multiple of the data-parallel size W.

Reduction (agoq.comm.reduce), started per bucket when Megatron would start its collective:
  * all-reduce (no distributed optimizer): :func:`allreduce_stored_` sends the stored codes,
    sums in fp32 and all-gathers the requantized sum back into the same storage (at two ranks in one
    all-gather per chunk, every rank summing every block; agoq.comm.reduce.stored_allreduce_route). The reduced
    gradient stays 8-bit; temporaries are two chunk slots.
  * distributed optimizer: rank r needs the elements of Megatron's shard r (``shard_buffer``
    of the bucket's flat layout). :func:`reduce_blocks_to_owners` delivers the fp32 sum of the blocks
    that intersect shard r (whole blocks, chunk by chunk) and rank r requantizes them *in place* into
    its own store: the reduced shard is 8-bit too, and no float window exists (the store's other blocks
    keep this rank's unreduced values, which nobody reads). A block across a shard boundary belongs to
    both neighbours' ranges; it is requantized after the whole reduction (``finish_reduce_scatter``),
    since a later chunk still sends this rank's contribution to it. Megatron's DistributedOptimizer
    reads ``main_grad`` for its shard; here it cannot (``main_grad`` has no storage), so
    agoq/megatron/grads/grad_reader.py attaches a reader (``shard_grad``: one parameter's shard dequantized
    at a time) to agoq's optimizer (streamed, 0 extra bytes) or to Megatron's (its fp32 shard ``.grad``
    tensors, 4/W bytes per parameter from the step to zero_grad). Without an attached reader the
    reduction raises.

Transport: the NCCL collectives above (any backend), or NVLink peer memory (``peer_group``, CUDA, one host):
the store's codes and scales then live in CUDA symmetric memory (agoq/comm/symm_store.py) and the same
reductions read the peers' stores directly, bit for bit the same results.

Readers after the all-reduce: ``materialize()`` dequantizes into Megatron's float grad buffer (for
optimizers that need every ``.grad`` at once, e.g. torch Adam: 4 bytes/param again, but only from the
end of the reduction to the next zero_grad_buffer), or ``grad(param)`` dequantizes one parameter on
demand (agoq's optimizers, agoq/megatron/grads/grad_reader.py). Parameters that Megatron's
finalize_model_grads all-reduces through ``main_grad`` after the DP reduction (sequence-parallel or
TP-averaged norms, q/k layernorms, shared embeddings) always get a real fp32 ``main_grad``.

``release()`` (from zero_grad_buffer) restores the original ``main_grad`` views and drops every
float tensor, so nothing float exists during forward/backward.
"""

from __future__ import annotations

import torch

from agoq.comm.grad_buffer import QuantizedGradBuffer
from agoq.comm.pipeline import blocks_per_chunk, run_maybe_async
from agoq.comm.reduce import allreduce_stored_, reduce_blocks_to_owners
from agoq.comm.symm_store import SymmetricBlocks

__all__ = ["BucketStore", "finalize_touched"]


def finalize_touched(param: torch.nn.Parameter, name: str = "") -> bool:
    """True for parameters whose main_grad megatron.core's finalize_model_grads reduces again after the
    data-parallel reduction (sequence-parallel / TP-averaged, q/k layernorm, shared embedding)."""
    return bool(getattr(param, "sequence_parallel", False) or getattr(param, "average_gradients_across_tp_domain",
                                                                       False)
                or getattr(param, "shared_embedding", False) or getattr(param, "shared", False)
                or "q_layernorm" in name or "k_layernorm" in name)


class BucketStore:
    """8-bit main_grad of one bucket (see module docstring)."""

    def __init__(self, bucket, fmt, device, *, error_feedback: bool, world: int, rank: int,
                 touched: set, chunk_bytes: int | None = None, peer_group=None):
        self.bucket = bucket
        self.params = sorted(bucket.params_list, key=lambda p: bucket.param_to_index[p][0])
        self.spans = [bucket.param_to_index[p] for p in self.params]  # bucket-flat (start, end)
        self.segment = {p: i for i, p in enumerate(self.params)}
        self.peer = None  # peer transport: SymmetricBlocks holding the store (None: NCCL transport)
        storage = None
        if peer_group is not None:
            def storage(num_blocks: int):
                self.peer = SymmetricBlocks(peer_group, fmt, num_blocks, device)
                return self.peer.codes_u8, self.peer.scales
        self.qbuf = QuantizedGradBuffer([p.numel() for p in self.params], fmt, device,
                                        error_feedback=error_feedback, block_multiple=world, storage=storage)
        self.world, self.rank, self.chunk_bytes = world, rank, chunk_bytes
        self.touched = [p for p in self.params if p in touched]
        self.original_main_grad = {p: p.main_grad for p in self.params}
        self.float_main_grad: dict = {}  # param -> fp32 tensor installed as main_grad until release()
        self.own_float: list = []  # fp32 tensors installed as main_grad (finalize_touched parameters)
        self.reader_attached = False  # distributed optimizer: agoq.megatron.grads.grad_reader reads the shard
        self.shared_blocks: set = set()  # blocks of this rank's range that a neighbour's range also holds
        self.deferred: dict = {}  # shared block -> its fp32 reduced values until finish_reduce_scatter
        self.reducing = False
        self.materialized = False  # the reduced gradient was copied into Megatron's float buffer

    # -- accumulation (backward post-hook) -----------------------------------------------------
    def accumulate(self, param, grad: torch.Tensor) -> None:
        self.qbuf.accumulate(self.segment[param], grad)

    # -- reduction --------------------------------------------------------------------------------
    def start_allreduce(self, group, *, average: bool, post_scale: float, async_op: bool):
        self.qbuf.fold_residual_()
        if self.peer is not None:
            return run_maybe_async(self.qbuf.device, lambda: self.peer.allreduce_(average=average,
                                                                                 post_scale=post_scale),
                                   async_op=async_op)
        return allreduce_stored_(self.qbuf.codes_u8, self.qbuf.scales, self.qbuf.fmt, group, average=average,
                                 post_scale=post_scale, async_op=async_op, chunk_bytes=self.chunk_bytes)

    def start_reduce_scatter(self, group, *, average: bool, post_scale: float, async_op: bool):
        """Reduce this rank's shard (Megatron's shard of the bucket) back into the 8-bit store, in place.

        Blocks of the rank's range that no other rank's range holds are requantized as their chunk
        arrives (their codes were sent before); the at most two blocks shared with a neighbour's range
        (a block across a shard boundary) are kept in fp32 until :meth:`finish_reduce_scatter`, because a
        later chunk still sends this rank's contribution to them. finalize_touched parameters get a full
        fp32 ``main_grad`` (zeros outside the shard), which finalize_model_grads reduces further.
        """
        if not self.reader_attached:
            raise RuntimeError(
                "8-bit gradient store with the distributed optimizer: the reduced shard stays 8-bit and the "
                "optimizer must read it through agoq.megatron.grads.grad_reader.attach(optimizer, model_chunks) "
                "(scripts/pretrain_llama.py does); Megatron's main_grad holds no reduced values"
            )
        self.qbuf.fold_residual_()
        shard = self.bucket.grad_data.numel() // self.world
        ranges = [self._blocks_of(r * shard, (r + 1) * shard) for r in range(self.world)]
        lo, hi = ranges[self.rank]
        # the overlaps with the other ranks' block ranges (at most one block at each end): O(world), not a
        # Python loop over every block of the shard (~78k per 40M-element bucket at d=2: ~0.35 s per step)
        self.shared_blocks = {b for r, (a, z) in enumerate(ranges) if r != self.rank
                              for b in range(max(lo, a), min(hi, z))}
        self.deferred = {}
        for p in self.touched:  # finalize_model_grads reads them even outside the shard
            self._install(p, torch.zeros(p.shape, dtype=torch.float32, device=self.qbuf.device))
            self.own_float.append(p.main_grad)
        self.reducing = True
        if self.peer is not None:
            chunk = blocks_per_chunk(self.qbuf.fmt, self.world, self.chunk_bytes,
                                     self.world * max(z - a for a, z in ranges))
            # the reduce kernel requantizes every other block of the range into this rank's store rows itself
            spans = self._float_spans(lo, hi)
            return run_maybe_async(self.qbuf.device, lambda: self.peer.reduce_to_owners(
                ranges, self._consume, average=average, post_scale=post_scale, chunk_blocks=chunk,
                float_spans=spans), async_op=async_op)
        return reduce_blocks_to_owners(self.qbuf.codes_u8, self.qbuf.scales, self.qbuf.fmt, ranges,
                                       self._consume, group, average=average,
                                       post_scale=post_scale, async_op=async_op, chunk_bytes=self.chunk_bytes)

    def finish_reduce_scatter(self) -> None:
        """Requantize the deferred shared blocks (after every chunk of the reduction has been sent)."""
        for b, values in sorted(self.deferred.items()):
            self.qbuf.store_blocks_(b, values)
            if values.is_cuda:  # made on the reduction's side stream, read here on the current one
                values.record_stream(torch.cuda.current_stream(values.device))
        self.deferred = {}
        self.reducing = False

    def _float_spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Blocks of [lo, hi) that must arrive in fp32 (through _consume): those shared with a neighbour's range
        (deferred until every chunk is reduced) and the finalize_touched parameters' (their fp32 main_grad),
        as sorted, merged intervals."""
        offs = self.qbuf.block_offsets
        spans = sorted([(b, b + 1) for b in self.shared_blocks]
                       + [(max(lo, offs[i]), min(hi, offs[i + 1])) for i in map(self.segment.get, self.touched)])
        merged: list[tuple[int, int]] = []
        for a, z in spans:
            if a >= z:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], z))
            else:
                merged.append((a, z))
        return merged

    def _blocks_of(self, lo: int, hi: int) -> tuple[int, int]:
        """Store blocks [first, last) holding the bucket-flat elements [lo, hi)."""
        block, offs = self.qbuf.fmt.block, self.qbuf.block_offsets
        first = last = None
        for i, (start, end) in enumerate(self.spans):
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            j0, j1 = offs[i] + (a - start) // block, offs[i] + -(-(b - start) // block)
            first = j0 if first is None else min(first, j0)
            last = j1 if last is None else max(last, j1)
        return (0, 0) if first is None else (first, last)

    def _consume(self, first_block: int, values_f32: torch.Tensor) -> None:
        """Reduced whole blocks [first_block, first_block + n): into the store (shared blocks deferred) and
        into the fp32 main_grad of finalize_touched parameters."""
        block = self.qbuf.fmt.block
        n = values_f32.numel() // block
        run = first_block
        for b in sorted(x for x in self.shared_blocks if first_block <= x < first_block + n) + [first_block + n]:
            if b > run:
                self.qbuf.store_blocks_(run, values_f32[(run - first_block) * block: (b - first_block) * block])
            if b < first_block + n:
                self.deferred[b] = values_f32[(b - first_block) * block: (b - first_block + 1) * block].clone()
            run = b + 1
        for p in self.touched:
            self._copy_blocks_into(p, first_block, n, values_f32)

    def _copy_blocks_into(self, param, first_block: int, n: int, values_f32: torch.Tensor) -> None:
        block, offs = self.qbuf.fmt.block, self.qbuf.block_offsets
        i = self.segment[param]
        b0, b1 = max(offs[i], first_block), min(offs[i + 1], first_block + n)
        if b0 >= b1:
            return
        e0, e1 = (b0 - offs[i]) * block, min(param.numel(), (b1 - offs[i]) * block)
        src0 = (b0 - first_block) * block
        self.float_main_grad[param].view(-1)[e0:e1].copy_(values_f32[src0: src0 + e1 - e0])

    # -- readers -------------------------------------------------------------------------------
    def grad(self, param) -> torch.Tensor:
        """fp32 reduced gradient of ``param`` (param's shape; a fresh tensor unless installed)."""
        if param in self.float_main_grad:
            return self.float_main_grad[param]
        return self.qbuf.dequantize(self.segment[param]).view(param.shape)

    def shard_grad(self, param, start: int, end: int) -> torch.Tensor:
        """fp32 reduced gradient of ``param``'s flat elements [start, end) (distributed optimizer: this
        rank's shard of it; a fresh tensor of end - start elements, or a view of an installed main_grad)."""
        if self.reducing:
            raise RuntimeError("8-bit shard read before finish_grad_sync completed its reduction")
        if param in self.float_main_grad:
            return self.float_main_grad[param].view(-1)[start:end]
        block, i = self.qbuf.fmt.block, self.segment[param]
        b0 = self.qbuf.block_offsets[i] + start // block
        count = -(-end // block) - start // block
        values = self.qbuf.dequantize_blocks(b0, count)
        skip = start - (start // block) * block
        if values.numel() == end - start:
            return values
        return values[skip: skip + end - start].clone()  # not a view that keeps the padding blocks alive

    def materialize(self) -> None:
        """Dequantize the reduced gradient into Megatron's float grad buffer (main_grad views)."""
        flat = self.bucket.grad_data.view(-1)
        for i, (start, end) in enumerate(self.spans):
            flat[start:end].copy_(self.qbuf.dequantize(i))
        self.materialized = True

    def install_touched(self) -> None:
        """All-reduce readers that do not materialize: real fp32 main_grad for finalize_touched params."""
        for p in self.touched:
            self._install(p, self.qbuf.dequantize(self.segment[p]).view(p.shape))
            self.own_float.append(p.main_grad)

    def scale_(self, factor) -> None:
        """Multiply the gradient wherever it lives now (not the materialised float buffer: the DDP
        scales that one as Megatron does)."""
        if self.materialized:
            return
        self.qbuf.scale_(factor)
        for tensor in self.own_float:
            tensor.mul_(factor)

    def _install(self, param, tensor: torch.Tensor) -> None:
        self.float_main_grad[param] = tensor
        param.main_grad = tensor

    def nonfinite(self) -> bool:
        bad = self.qbuf.has_nonfinite()
        return bad or any(not bool(torch.isfinite(t).all()) for t in self.float_main_grad.values())

    def release(self) -> None:
        for p in self.float_main_grad:
            p.main_grad = self.original_main_grad[p]
        self.float_main_grad, self.own_float = {}, []
        self.deferred, self.reducing = {}, False
        self.materialized = False
        self.qbuf.zero_()
