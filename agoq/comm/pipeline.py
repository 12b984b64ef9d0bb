"""The chunked software pipeline under agoq's 8-bit reductions, and the per-chunk op dispatch.

A reduction is cut into K chunks (whole blocks of every rank's row). Each chunk goes through
``send`` (quantize into a send slot, or take a view of 8-bit storage; issue the all-to-all),
``reduce`` (wait for it; dequantize the W received rows, sum in fp32, requantize or write the
result; issue the all-gather if any) and ``finish`` (wait for the all-gather; dequantize into
the destination if any). The host issues them in the order::

    send(0) send(1) reduce(0) send(2) reduce(1) finish(0) send(3) reduce(2) finish(1) ...

so the quantize kernel of chunk t+1 runs while chunk t is on the wire, and with two slots per
buffer every buffer is reused only after the op that last read it is known to be complete on the
issuing stream (see the ``_Slots`` docstring). On CUDA the collectives are issued with
``async_op=True`` and their ``wait()`` only orders streams, so the whole pipeline is enqueued
without blocking the host; an asynchronous reduction runs on a side stream and its handle makes
the caller's stream wait for it. On CPU (gloo) a reduction runs to completion when it is called
(its collectives still overlap the next chunk's quantization through gloo's worker threads).

Op dispatch (:func:`comm_ops_for`): CUDA tensors in a one-byte format (int8 round-to-nearest,
fp8) use the fused Triton kernels of :mod:`agoq.kernels.comm`; every other case uses
:mod:`agoq.ref.comm` (plain PyTorch, any device), which the kernels reproduce bit for bit. A CUDA tensor in a
format without a fused kernel is refused (:func:`check_reduction_kernel`: no quiet fallback to the slow reference
on the GPU); the DDP wrapper runs that check once, at construction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from agoq.formats import QuantFormat, uses_bytes_kernel

__all__ = ["comm_ops_for", "check_reduction_kernel", "run_pipeline", "Slots", "all_to_all", "all_gather", "Done",
           "scale_dtype", "DEFAULT_CHUNK_BYTES", "blocks_per_chunk", "chunk_bytes_for", "run_maybe_async"]

# Chunk size (codes moved per chunk, all W rows together) when the caller gives none: about
# TARGET_CHUNKS chunks, clamped to [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]. Why: pipelining needs a few
# chunks (the first quantize and the last dequantize are not overlapped: ~1/K of the local work
# shows), while every chunk costs ~5 launches and a few Python views on the host, which must stay
# ahead of the GPU; the clamps keep NCCL messages large and the slots (2 x ~3.5 x chunk) bounded.
# These are design choices, not measured optima: benchmarks/bench_allreduce.py --chunk-mib sweeps them
# (docs/numerics.md).
TARGET_CHUNKS = 4
MIN_CHUNK_BYTES = 16 << 20
MAX_CHUNK_BYTES = 64 << 20
DEFAULT_CHUNK_BYTES = None  # auto, see above


_SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "pow2": torch.uint8}


def scale_dtype(fmt: QuantFormat) -> torch.dtype:
    return _SCALE_DTYPES[fmt.scale]


def chunk_bytes_for(total_code_bytes: int, chunk_bytes: int | None) -> int:
    """The chunk size to use for a reduction moving ``total_code_bytes`` codes (auto when None)."""
    if chunk_bytes is None:
        return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, total_code_bytes // TARGET_CHUNKS))
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return chunk_bytes


def blocks_per_chunk(fmt: QuantFormat, world: int, chunk_bytes: int | None, total_blocks: int) -> int:
    """Blocks per row and chunk for chunks of about ``chunk_bytes`` codes over ``world`` rows, for a
    reduction of ``total_blocks`` blocks (all rows)."""
    block_bytes = fmt.code_bytes(fmt.block)
    chunk = chunk_bytes_for(total_blocks * block_bytes, chunk_bytes)
    return max(1, chunk // (world * block_bytes))


def check_reduction_kernel(device: torch.device, fmt: QuantFormat) -> None:
    """Raise unless tensors on ``device`` in ``fmt`` have reduction ops: any format on the CPU (the reference), a
    one-byte format (int8 round-to-nearest, fp8) on CUDA (the fused Triton kernels)."""
    if torch.device(device).type != "cuda":
        return
    if not uses_bytes_kernel(fmt):
        raise ValueError(f"agoq 8-bit reduction on CUDA: gradient format {fmt.name} has no fused reduction kernel "
                         "(one-byte formats only); use --agoq-grads int8_b256 (or another int8 / fp8e4m3 / fp8e5m2 "
                         "format)")


def comm_ops_for(device: torch.device, fmt: QuantFormat) -> tuple[Callable, Callable, Callable]:
    """(quantize_rows, reduce_rows, dequantize_rows) for tensors on ``device`` in ``fmt`` (the fused kernels on
    CUDA, the reference elsewhere; :func:`check_reduction_kernel` refuses the rest)."""
    check_reduction_kernel(device, fmt)
    if torch.device(device).type == "cuda":
        from agoq.kernels.comm import dequantize_rows, quantize_rows, reduce_rows

        return quantize_rows, reduce_rows, dequantize_rows
    from agoq.ref.comm import ref_dequantize_rows, ref_quantize_rows, ref_reduce_rows

    return ref_quantize_rows, ref_reduce_rows, ref_dequantize_rows


class Slots:
    """Two reusable buffers per name, allocated at the first (largest) request, handed out as views.

    Reuse is safe under the pipeline order without extra synchronisation: a slot of chunk t is
    written again by chunk t+2, whose writer is issued after the op that last read chunk t's
    contents has been waited on (send/receive: by reduce(t); own row: by finish(t); gathered: by
    finish(t)), and a collective's stream starts only after the issuing stream's earlier work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.bufs: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, name: str, k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, k % 2)
        buf = self.bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self.bufs[key] = buf
        return buf[:numel]


class Done:
    """Handle of finished work (``wait()`` returns at once)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _EventHandle:
    """Handle of a pipeline enqueued on a side stream: ``wait()`` orders the caller's stream after it."""

    def __init__(self, event: torch.cuda.Event, keep: list):
        self.event, self.keep = event, keep

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)
        self.keep = []

    def is_completed(self) -> bool:
        return self.event.query()


@functools.lru_cache(maxsize=8)
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


def _wait(works) -> None:
    for w in works or ():
        if w is not None:
            w.wait()


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None):
    """Async all_to_all_single (a plain copy for one rank). Returns the work or None."""
    if dist.get_world_size(group) == 1:
        out.copy_(inp)
        return None
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group):
    """Async all_gather_into_tensor of flat tensors (under its newer name where torch has it)."""
    if dist.get_world_size(group) == 1:
        out.copy_(inp)
        return None
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


def run_pipeline(device: torch.device, num_chunks: int, send: Callable[[int], list],
                 reduce: Callable[[int], list], finish: Callable[[int], None] | None, *, async_op: bool):
    """Run the three stages over ``num_chunks`` chunks in the pipeline order (module docstring).

    ``send(k)`` and ``reduce(k)`` return the works they issued (lists, entries may be None).
    Returns None (``async_op`` False), a finished handle (CPU) or a side-stream handle (CUDA).
    """

    def body() -> None:
        sent, gathered = {}, {}
        for t in range(num_chunks + 2):
            if t < num_chunks:
                sent[t] = send(t)
            if 0 <= t - 1 < num_chunks:
                _wait(sent.pop(t - 1))
                gathered[t - 1] = reduce(t - 1)
            if 0 <= t - 2 < num_chunks:
                _wait(gathered.pop(t - 2))
                if finish is not None:
                    finish(t - 2)

    return run_maybe_async(device, body, async_op=async_op)


def run_maybe_async(device: torch.device, body: Callable[[], None], *, async_op: bool):
    """Enqueue ``body()``: on CUDA with ``async_op`` on the side stream (after the caller's earlier work),
    returning a handle whose ``wait()`` orders the caller's stream after it; else run it here and return
    None (``async_op`` False) or a finished handle."""
    if torch.device(device).type == "cuda" and async_op:
        caller = torch.cuda.current_stream(device)
        side = _side_stream(torch.device(device).index or 0)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            body()
            event = torch.cuda.Event()
            event.record(side)
        return _EventHandle(event, [])
    body()
    return Done() if async_op else None
