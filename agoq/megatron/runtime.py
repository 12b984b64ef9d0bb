"""Process-level set-up for a megatron-core run: device, process groups, seeds, memory readings; and where this rank
sits once set up (pipeline stage, the rank that reports for its stage, the data-parallel group).

Seam card
---------
Touches: ``parallel_state.initialize_model_parallel`` / ``destroy_model_parallel`` and
  ``tensor_parallel.model_parallel_cuda_manual_seed`` (public functions; its ``use_cudagraphable_rng`` with CUDA
  graphs); ``parallel_state``'s rank and group queries.
Why: ``megatron.training.initialize_megatron`` asserts CUDA and skips model-parallel set-up without a
  GPU (megatron-core 0.19.2), so agoq initialises megatron-core itself: NCCL on GPU, gloo on CPU.
Verified on: megatron-core 0.19.2.
Guarded by: every multi-process test in ``tests/megatron``.

Reads no environment: where this process sits in the job (torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``
/ ``MASTER_ADDR``) comes in as a :class:`LaunchInfo`, which the trainer builds from the environment
(``agoq.train.environment.launch_from_environment``) and in-process users state (:data:`SINGLE_PROCESS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from agoq.config import flag_for
from agoq.megatron.model import ParallelLayout

GIB = 1024**3
# Megatron-LM's _set_random_seed (megatron/training/initialize.py): each pipeline rank seeds with seed + 100 x its
# rank, so the stages draw their layers' initial weights from different streams (with one seed everywhere, every
# stage past the first would draw the same numbers in the same order: at PP=4, stages 1-3 would start as copies).
PIPELINE_RANK_SEED_STRIDE = 100


def stage_seed(seed: int, pipeline_rank: int) -> int:
    """The seed pipeline rank ``pipeline_rank`` initialises with (Megatron-LM's offset, PIPELINE_RANK_SEED_STRIDE)."""
    return seed + PIPELINE_RANK_SEED_STRIDE * pipeline_rank


@dataclass(frozen=True, kw_only=True)
class LaunchInfo:
    """This process's place in the job as its launcher announced it (torchrun: RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    rendezvous_from_environment: bool = False
    """True: the launcher set MASTER_ADDR / MASTER_PORT, so the process group uses torch's ``env://``
    rendezvous. False: a world of one on a free local port, passed as ``init_method`` so no MASTER_* variable
    leaks to child processes started later (plain ``python script.py``, in-process tests)."""


SINGLE_PROCESS = LaunchInfo()  # one process, no launcher


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"


def choose_device(requested: str, local_rank: int) -> torch.device:
    """``auto`` picks this rank's GPU when CUDA is available, else the CPU; ``cuda`` without a GPU raises."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{flag_for('device')} {requested!r}: choose auto, cpu or cuda")
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ValueError(f"{flag_for('device')} cuda was given but no CUDA GPU is visible; use {flag_for('device')} "
                         "auto or cpu")
    if requested == "cpu" or not has_cuda:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device, launch: LaunchInfo) -> RankInfo:
    """Join the launcher's process group (``launch``: :data:`SINGLE_PROCESS` for a world of one)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = None if launch.rendezvous_from_environment else f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend=backend, rank=launch.rank, world_size=launch.world_size,
                                init_method=init_method)
    return RankInfo(rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank, device=device)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_model_parallel(layout: ParallelLayout, seed: int, device: torch.device, *, cuda_graphs: bool = False) -> None:
    """Process groups of ``layout`` and Megatron's RNG tracker, seeded per pipeline rank as Megatron-LM seeds them
    (:func:`stage_seed`; the data order does not use this seed). ``cuda_graphs`` (Megatron's CUDA graphs on): the
    graph-safe ``CudaRNGStatesTracker(use_cudagraphable_rng=True)`` that ``CudaGraphManager`` requires without
    Transformer Engine, as Megatron-LM's ``initialize`` seeds it (``use_cudagraphable_rng=cuda_graph_impl !=
    'none'``); its states are seeded alike, and the weights drawn under it are the same."""
    if cuda_graphs and device.type != "cuda":
        raise ValueError("--cuda-graph-impl local captures CUDA graphs: it needs a GPU (this run is on the "
                         f"{device.type}); drop it for CPU runs")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
    )
    # CPU: the default tracker snapshots CUDA RNG state; the inference tracker does not.
    # force_reset_rng: a tracker some earlier call made with the defaults would otherwise stay (not graph-safe)
    graph_safe = {"use_cudagraphable_rng": True, "force_reset_rng": True} if cuda_graphs else {}
    rank_seed = stage_seed(seed, parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(rank_seed, inference_rng_tracker=device.type == "cpu", **graph_safe)
    torch.manual_seed(rank_seed)


def shutdown(*, after_error: bool = False) -> None:
    """Tear down Megatron's parallel state and the process groups. ``after_error``: the job is leaving through an
    exception, possibly on this rank only; then NCCL groups are left to the process exit. Destroying them is
    collective (ncclCommDestroy waits for the peers), and a peer still blocked in a pipeline receive or a
    reduction would keep this rank from ever exiting, so the launcher would never see the failure and stop the
    job: the 2026-11-26 capacity_4gpu run on 4 H100 hung that way for its whole timeout (torchtitan stopped
    destroying process groups on its exception path for the same reason, pytorch/torchtitan#1342). Gloo's
    teardown is local and still runs."""
    if after_error and dist.is_initialized() and dist.get_backend() == dist.Backend.NCCL:
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ where this rank sits
def pipeline_rank() -> int:
    return parallel_state.get_pipeline_model_parallel_rank()


def pipeline_size() -> int:
    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    """On the last pipeline stage (of any virtual chunk): the stage that computes the loss."""
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def speaks_for_stage() -> bool:
    """The first tensor- and data-parallel rank (with context parallelism) of its pipeline stage: the rank that
    prints or reports what the stage's ranks share."""
    return (parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)


def data_parallel_group():
    """The data-parallel group with context parallelism (the group a loss is averaged over)."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def mean_over_data_parallel(value_1: torch.Tensor) -> float:
    """A per-rank value (shape [1], e.g. a rank's loss averaged over its micro-batches) averaged over
    :func:`data_parallel_group`: an fp32 all-reduce sum, then divided by the group's size as a Python float. Both
    trainers' loss records go through here, so that they agree bit for bit (agoq's trainer, agoq.train.training;
    the Megatron-LM door, agoq.train.megatron_lm_door). Every rank of the group must call it."""
    summed_1 = value_1.detach().float().reshape(1).clone()
    group = data_parallel_group()
    dist.all_reduce(summed_1, group=group)
    return float(summed_1.item()) / dist.get_world_size(group=group)


def memory_reading(device: torch.device) -> dict[str, float]:
    """GiB: allocated and peak on GPU (torch's allocator, plus the CUDA symmetric memory that holds agoq's
    8-bit gradient stores under the peer transport, which the allocator does not count: agoq.comm.symm_store);
    resident set size on CPU (not comparable)."""
    if device.type == "cuda":
        from agoq.comm.symm_store import symmetric_bytes

        symm = symmetric_bytes()
        return {
            "allocated_gib": (torch.cuda.memory_allocated(device) + symm) / GIB,
            "peak_gib": (torch.cuda.max_memory_allocated(device) + symm) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "symmetric_gib": symm / GIB,
        }
    return {"rss_gib": psutil.Process().memory_info().rss / GIB}


def outside_allocator_gib(device: torch.device) -> dict[str, float]:
    """GiB of this GPU in use outside PyTorch's caching allocator and agoq's symmetric memory: the device's used
    memory (``cudaMemGetInfo``) less the allocator's reserved bytes and the symmetric buffers -- the CUDA context,
    NCCL's communicator buffers, cuBLAS / cuDNN workspaces (and another process's memory on a shared GPU). The
    planner reserves agoq.plan.headroom.OUTSIDE_ALLOCATOR_GIB for it (one H100, without NCCL). Empty on the CPU."""
    if device.type != "cuda":
        return {}
    from agoq.comm.symm_store import symmetric_bytes

    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device) - symmetric_bytes()
    return {"outside_allocator_gib": outside / GIB, "device_total_gib": total / GIB}


def format_memory(reading: dict[str, float]) -> str:
    if "peak_gib" in reading:
        return f"mem alloc {reading['allocated_gib']:.2f} GiB | peak {reading['peak_gib']:.2f} GiB"
    return f"mem rss {reading['rss_gib']:.2f} GiB (cpu)"
