"""Which transport carries a data-parallel group's 8-bit gradient reduction: NCCL collectives or NVLink
peer memory (agoq.comm.symm / agoq.comm.symm_store).

``--agoq-grad-transport`` (agoq.config.sections.GradsConfig.transport):
  * ``nccl``: NCCL (or gloo) collectives: any link, any number of hosts.
  * ``peer``: the reduce kernels read the peers' 8-bit stores over NVLink (CUDA symmetric memory). Every
    rank of the group must be on one host, on CUDA, with a one-byte format (int8 round-to-nearest, fp8);
    otherwise the run stops here with the reason.
  * ``auto`` (default): ``peer`` where those conditions hold, else ``nccl``; the choice and its reason are
    returned for the start-up report (asked-for fallback, never silent).

Across hosts the 8-bit NCCL reduction is the one that pays (docs/benchmarks/grads.md: socket link); inside
one NVLink host the peer transport is the faster one at Megatron's bucket sizes.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from agoq.config import flag_for
from agoq.formats import QuantFormat, uses_bytes_kernel

__all__ = ["resolve_transport", "peer_problems"]


def _symmetric_memory_available() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def _one_byte_kernel(fmt: QuantFormat) -> bool:
    return uses_bytes_kernel(fmt)


def peer_problems(group, device: torch.device, fmt: QuantFormat) -> list[str]:
    """Why the peer transport cannot serve ``group`` (empty: it can). Collective over ``group`` when the
    local checks pass (the ranks' host names are gathered); every rank reaches the same answer."""
    problems = []
    world = dist.get_world_size(group)
    if torch.device(device).type != "cuda":
        problems.append(f"the gradients are on {torch.device(device).type}, not CUDA")
    elif not _one_byte_kernel(fmt):
        problems.append(f"format {fmt} has no fused peer kernel (one-byte formats only, e.g. int8_b256)")
    elif world == 1:
        problems.append("the data-parallel group has one rank (nothing to reduce)")
    elif not _symmetric_memory_available():
        problems.append("this torch has no torch.distributed._symmetric_memory")
    if problems:
        return problems
    mine = torch.device(device).index
    mine = torch.cuda.current_device() if mine is None else mine
    ranks: list = [None] * world
    dist.all_gather_object(ranks, (socket.gethostname(), mine), group=group)
    hosts = {host for host, _ in ranks}
    if len(hosts) > 1:
        problems.append(f"the group spans {len(hosts)} hosts (peer memory is one NVLink domain)")
    elif not all(torch.cuda.can_device_access_peer(mine, other) for _, other in ranks if other != mine):
        problems.append(f"GPU {mine} cannot access the memory of every peer GPU {[d for _, d in ranks]} (no P2P)")
    return problems


def resolve_transport(requested: str, group, device: torch.device, fmt: QuantFormat) -> tuple[str, str]:
    """(transport, reason) for ``requested`` in auto / nccl / peer (module docstring)."""
    if requested == "nccl":
        return "nccl", f"{flag_for('grads.transport')} nccl"
    problems = peer_problems(group, device, fmt)
    if not problems:
        return "peer", f"NVLink peer memory, {dist.get_world_size(group)} ranks on one host"
    if requested == "peer":
        raise ValueError(f"{flag_for('grads.transport')} peer: {'; '.join(problems)}. Use "
                         f"{flag_for('grads.transport')} nccl (or auto, which picks nccl here)")
    return "nccl", f"auto: {'; '.join(problems)}"
