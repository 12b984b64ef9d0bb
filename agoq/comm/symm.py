"""agoq's 8-bit gradient reduction over NVLink peer memory (CUDA symmetric memory), without NCCL.

Same algorithm, rows and arithmetic as agoq.comm.reduce (read its docstring), so the results are bit
for bit those of :func:`agoq.comm.reduce.allreduce_8bit` / :func:`~agoq.comm.reduce.reduce_scatter_8bit`;
only the transport differs. Every rank owns a symmetric workspace that all ranks of the group map
(``torch.distributed._symmetric_memory``), and the communication is the reduce / dequantize kernels'
own loads from the peers' workspaces (agoq.kernels.comm ``*_peer_rows``)::

    quantize_rows(x -> my send rows [W, S])                       local HBM
    barrier                                                       every peer's send rows are written
    two-shot (bit-identical to allreduce_8bit; reduce-scatter stops after the first kernel, writing floats):
      reduce_peer_rows(row r of every peer -> my row, requantized) reads (W-1)/W x 1.02 N bytes over NVLink
      barrier                                                     every reduced row is written
      dequantize_peer_rows(row p of peer p -> x[p S:(p+1) S])    reads (W-1)/W x 1.02 N bytes again
    one-shot (all-reduce, default at W = 2):
      reduce_peer_rows(row q of every peer -> x[q S:(q+1) S])    reads (W-1) x 1.02 N bytes; fp32 sums,
                                                                  no second quantization (more precise)

No all-to-all / all-gather launch, no receive buffer and no second pass over it: at Megatron's bucket
sizes the two-collective version pays NCCL's per-collective latency and a write + read of every received
byte (docs/benchmarks/grads.md). The barriers are the symmetric-memory handle's stream-ordered device
barriers (release/acquire on the signal pads); no host synchronisation.

Workspace reuse without a closing barrier: calls alternate between two workspaces. A peer's reads of
workspace A in call k finish before it reaches call k+1's first barrier, which this rank passes before
it writes A again in call k+2.

Requirements, checked by :class:`PeerReducer` (it raises, never falls back): CUDA tensors, one-byte
formats (int8 round-to-nearest, fp8), a group whose ranks can map each other's memory (one NVLink
domain, e.g. one host), and a torch with ``torch.distributed._symmetric_memory``. NVLink multicast is
not used (the barriers are point-to-point signal pads).

Memory: two workspaces of (W + 1) packed rows each, about 2 (1 + 1/W) x 1.02 N bytes for the largest N
reduced so far (reallocated, collectively, when a larger tensor comes).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from agoq.comm.reduce import _check_op, _packed, _row_bytes, allreduce_row_numel, check_grad_format
from agoq.formats import QuantFormat, uses_bytes_kernel

__all__ = ["PeerReducer", "peer_reducer", "allreduce_8bit_peer", "reduce_scatter_8bit_peer"]

# Row geometries (one per distinct tensor size) whose views and address tables a reducer keeps: Megatron
# reduces a handful of bucket sizes per model; the oldest geometry is rebuilt if more come (a few host ms).
MAX_GEOMETRIES = 16
MAX_REDUCERS = 8  # (group, format, device) workspaces kept per process: DP groups x gradient formats in use
NUM_WORKSPACES = 2  # alternating workspaces: see "Workspace reuse" in the module docstring
# The one-shot all-reduce reads (W-1) rows of codes per rank, the two-shot 2 (W-1)/W rows plus a requantize
# pass and a second barrier: equal wire bytes at W = 2, where one-shot is taken by default (measured,
# docs/benchmarks/grads.md); more wire bytes beyond.
ONE_SHOT_MAX_WORLD = 2


def _symm_mem():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as err:  # pragma: no cover - torch without symmetric memory
        raise RuntimeError(f"agoq peer reduction needs torch.distributed._symmetric_memory ({err}); use the NCCL "
                           "transport (agoq.comm.allreduce_8bit)") from err
    return symm_mem


def enable_group(symm_mem, group_name: str) -> None:
    """Register the group with symmetric memory where this torch still needs it: torch 2.11 marks
    ``enable_symm_mem_for_group`` deprecated ("no need to call this function anymore", a FutureWarning on every
    call) and its rendezvous registers the group itself (a torch without the function: likewise); torch versions
    without that mark need the call."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return  # removed, or deprecated: the rendezvous registers the group
    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enabled is None or not enabled(group_name):
        enable(group_name)


class _Geometry:
    """Views and row address tables of one row layout (nb blocks per row) in both workspaces."""

    def __init__(self, peers: list[torch.Tensor], rank: int, world: int, nb: int, fmt: QuantFormat,
                 ws_bytes: int):
        from agoq.kernels.comm import peer_tables

        row = _row_bytes(nb, fmt)
        self.send, self.reduce_tables, self.mine, self.gather_rows, self.gather_tables = [], [], [], [], []
        self.one_shot_tables = []
        for ws in range(NUM_WORKSPACES):
            base = ws * ws_bytes
            sends = [_packed(p[base: base + world * row], world, nb, fmt) for p in peers]
            mines = [_packed(p[base + world * row: base + (world + 1) * row], 1, nb, fmt) for p in peers]
            self.send.append(sends[rank])  # my W rows, written by quantize_rows
            red_rows = ([c[rank] for c, _ in sends], [s[rank] for _, s in sends])  # row `rank` of every peer
            self.reduce_tables.append((red_rows, peer_tables(*red_rows)))
            self.mine.append(mines[rank])
            gather = ([c[0] for c, _ in mines], [s[0] for _, s in mines])  # every peer's reduced row
            self.gather_rows.append(gather)
            self.gather_tables.append(peer_tables(*gather))
            # one-shot all-reduce: output row q sums row q of every peer (q-major, the kernel's table order)
            every = ([c[q] for q in range(world) for c, _ in sends], [s[q] for q in range(world) for _, s in sends])
            self.one_shot_tables.append((every, peer_tables(*every)))


class PeerReducer:
    """Symmetric workspaces of one process group and format, reused across calls (see module docstring)."""

    def __init__(self, group, fmt: QuantFormat | str, device: torch.device):
        self.fmt = check_grad_format(fmt)
        if not uses_bytes_kernel(self.fmt):
            raise ValueError(f"agoq peer reduction: format {self.fmt.name} has no fused kernel (one-byte formats "
                             "only: int8 round-to-nearest, fp8); use the NCCL transport")
        device = torch.device(device)
        _check_device(device)
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.device = device
        self.ws_bytes, self.buffer, self.handle, self.peers = 0, None, None, []
        self.geometries: collections.OrderedDict[int, _Geometry] = collections.OrderedDict()
        self.turn = 0

    def _ensure(self, nb: int) -> _Geometry:
        ws_bytes = (self.world + 1) * _row_bytes(nb, self.fmt)
        if ws_bytes > self.ws_bytes:
            self._allocate(ws_bytes)
        geo = self.geometries.get(nb)
        if geo is None:
            geo = _Geometry(self.peers, self.rank, self.world, nb, self.fmt, self.ws_bytes)
            self.geometries[nb] = geo
            if len(self.geometries) > MAX_GEOMETRIES:
                self.geometries.popitem(last=False)
        else:
            self.geometries.move_to_end(nb)
        return geo

    def _allocate(self, ws_bytes: int) -> None:
        symm_mem = _symm_mem()
        name = self.group.group_name
        enable_group(symm_mem, name)
        total = NUM_WORKSPACES * ws_bytes
        self.buffer = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        try:
            self.handle = symm_mem.rendezvous(self.buffer, name)
        except RuntimeError as err:
            raise RuntimeError(f"agoq peer reduction: the ranks of group {name!r} cannot map each other's memory "
                               f"({err}); use the NCCL transport (agoq.comm.allreduce_8bit)") from err
        self.peers = [self.handle.get_buffer(p, (total,), torch.uint8) for p in range(self.world)]
        self.ws_bytes = ws_bytes
        self.geometries.clear()

    def _next(self) -> int:
        ws, self.turn = self.turn, (self.turn + 1) % NUM_WORKSPACES
        return ws

    def allreduce_(self, flat: torch.Tensor, *, average: bool, post_scale: float, one_shot: bool | None = None) -> None:
        """In-place all-reduce of the flat contiguous CUDA tensor ``flat``: two-shot (the results of
        allreduce_8bit, bit for bit) or one-shot (every rank sums every row: the fp32 sums of the dequantized
        peers, i.e. reduce_scatter_8bit's result for every row, without the second quantization; W-1 rows of
        codes read per rank instead of 2 (W-1)/W, equal at W = 2). ``one_shot=None``: one-shot at W = 2."""
        from agoq.kernels.comm import PEER_NUM_WARPS, dequantize_peer_rows, quantize_rows, reduce_peer_rows

        row_numel = allreduce_row_numel(flat.numel(), self.world, self.fmt)
        if row_numel == 0:
            return
        nb = self.fmt.num_blocks(row_numel)
        geo, ws = self._ensure(nb), self._next()
        codes, scales = geo.send[ws]
        quantize_rows(flat, codes, scales, self.fmt, row_stride=row_numel, row_numel=row_numel, col0=0,
                      num_warps=PEER_NUM_WARPS)
        self.handle.barrier(channel=0)
        if one_shot if one_shot is not None else self.world == ONE_SHOT_MAX_WORLD:
            (every_codes, every_scales), tables = geo.one_shot_tables[ws]
            reduce_peer_rows(every_codes, every_scales, self.fmt, average=average, post_scale=post_scale, out=flat,
                             out_numel=row_numel, out_rows=self.world, out_row_stride=row_numel,
                             out_total=flat.numel(), tables=tables)  # fmt: skip
            return
        (red_codes, red_scales), tables = geo.reduce_tables[ws]
        m_codes, m_scales = geo.mine[ws]
        reduce_peer_rows(red_codes, red_scales, self.fmt, average=average, post_scale=post_scale,
                         codes_out=m_codes, scales_out=m_scales, tables=tables)
        self.handle.barrier(channel=0)
        g_codes, g_scales = geo.gather_rows[ws]
        dequantize_peer_rows(g_codes, g_scales, flat, self.fmt, row_stride=row_numel, row_numel=row_numel, col0=0,
                             tables=geo.gather_tables[ws])  # fmt: skip

    def reduce_scatter(self, out: torch.Tensor, flat_in: torch.Tensor, *, average: bool, post_scale: float) -> None:
        """Rank r's ``out`` (contiguous) = the fp32 sum of shard r of every rank's ``flat_in`` (reduce_scatter_8bit)."""
        from agoq.kernels.comm import PEER_NUM_WARPS, quantize_rows, reduce_peer_rows

        n = out.numel()
        nb = self.fmt.num_blocks(n)
        geo, ws = self._ensure(nb), self._next()
        codes, scales = geo.send[ws]
        quantize_rows(flat_in, codes, scales, self.fmt, row_stride=n, row_numel=n, col0=0, num_warps=PEER_NUM_WARPS)
        self.handle.barrier(channel=0)
        (red_codes, red_scales), tables = geo.reduce_tables[ws]
        reduce_peer_rows(red_codes, red_scales, self.fmt, average=average, post_scale=post_scale, out=out.view(-1),
                         out_numel=n, tables=tables)  # fmt: skip


_REDUCERS: dict[tuple, PeerReducer] = {}


def _check_device(device: torch.device) -> None:
    if torch.device(device).type != "cuda":
        raise ValueError(f"agoq peer reduction runs on CUDA tensors (NVLink peer memory), got {device}; use "
                         "agoq.comm.allreduce_8bit / reduce_scatter_8bit (any backend)")


def peer_reducer(group, fmt: QuantFormat | str, device: torch.device) -> PeerReducer:
    """The process's reducer for (group, format, device), created (collectively) at the first call; at most
    MAX_REDUCERS (a few groups x formats per process; the oldest is dropped, its workspace freed)."""
    fmt = check_grad_format(fmt)
    _check_device(device)
    g = group if group is not None else dist.group.WORLD
    key = (g.group_name, fmt.name, str(torch.device(device)))
    if key not in _REDUCERS:
        _REDUCERS[key] = PeerReducer(g, fmt, device)
        while len(_REDUCERS) > MAX_REDUCERS:
            _REDUCERS.pop(next(iter(_REDUCERS)))
    return _REDUCERS[key]


def allreduce_8bit_peer(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, *, fmt: QuantFormat | str,
                        post_scale: float = 1.0, one_shot: bool | None = None) -> None:
    """:func:`agoq.comm.reduce.allreduce_8bit` (synchronous form) over NVLink peer memory: two-shot, the same
    results bit for bit; one-shot (default at 2 ranks), the fp32 sums without the second quantization
    (:meth:`PeerReducer.allreduce_`)."""
    fmt = check_grad_format(fmt)
    average = _check_op(op, tensor.dtype)
    _check_device(tensor.device)
    if not tensor.is_contiguous():
        raise ValueError("allreduce_8bit_peer: tensor must be contiguous (it is reduced in place)")
    peer_reducer(group, fmt, tensor.device).allreduce_(tensor.detach().view(-1), average=average,
                                                       post_scale=post_scale, one_shot=one_shot)


def reduce_scatter_8bit_peer(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, *,
                             fmt: QuantFormat | str, post_scale: float = 1.0) -> None:
    """:func:`agoq.comm.reduce.reduce_scatter_8bit` (synchronous form, same results) over NVLink peer memory."""
    fmt = check_grad_format(fmt)
    average = _check_op(op, input.dtype)
    _check_device(input.device)
    world = dist.get_world_size(group)
    if input.numel() != world * output.numel() or not output.is_contiguous():
        raise ValueError(f"reduce_scatter_8bit_peer: input ({input.numel()} elements) must be world_size ({world}) "
                         f"x a contiguous output ({output.numel()})")
    if output.numel() == 0:
        return
    peer_reducer(group, fmt, input.device).reduce_scatter(output.detach(), input.detach().reshape(-1),
                                                          average=average, post_scale=post_scale)
