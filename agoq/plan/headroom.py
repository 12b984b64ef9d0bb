"""How much of a GPU a prediction may take, and when the allocator needs expandable segments.

The planner predicts PyTorch's allocated bytes (``torch.cuda.max_memory_allocated``). Two things stand between that
and a GPU's memory, both measured on the LLaMA-3-70B PP=8 stage-0 proxy on one H100 80GB (torch 2.11, 2026-12-07;
benchmarks/results/stage_proxy_70b.json and stage_proxy_70b_es.json, docs/benchmarks/capacity.md):

* memory the process holds outside PyTorch's caching allocator (CUDA context, library handles): the out-of-memory
  report read 78.57 GiB in use by the process of which 77.29 GiB were reserved by PyTorch, so 1.29 GiB
  (:data:`OUTSIDE_ALLOCATOR_GIB`); a prediction must fit the GPU's memory less this (:func:`allocator_budget`);
* the caching allocator's fragmentation: 0.90 GiB reserved but unallocated when the stage ran out of memory in its
  second iteration with the default allocator (:data:`FRAGMENTATION_GIB`); with
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the same stage ran 4 iterations at 77.24 GiB against the
  planner's 77.29. A run closer than this to its budget needs expandable segments (:func:`needs_expandable`).

NCCL's buffers on several GPUs come on top and are not measured yet.
"""

from __future__ import annotations

from agoq.plan.memory import GIB

OUTSIDE_ALLOCATOR_GIB = 1.29
FRAGMENTATION_GIB = 0.90
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def allocator_budget(gpu_bytes: int) -> int:
    """The bytes PyTorch's allocator may hold on a GPU of ``gpu_bytes``."""
    return gpu_bytes - round(OUTSIDE_ALLOCATOR_GIB * GIB)


def needs_expandable(peak_bytes: float, budget_bytes: float) -> bool:
    """True when a predicted peak is within FRAGMENTATION_GIB of the allocator's budget."""
    return budget_bytes - peak_bytes < FRAGMENTATION_GIB * GIB


def headroom_note(peak_bytes: float, gpu_bytes: int, expandable: bool) -> str | None:
    """The trainer's start-up warning for a predicted peak on a GPU of ``gpu_bytes`` (``expandable``: whether
    PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True), or None when there is room."""
    budget = allocator_budget(gpu_bytes)
    where = (f"predicted peak {peak_bytes / GIB:.2f} GiB against this GPU's {gpu_bytes / GIB:.2f} GiB less "
             f"{OUTSIDE_ALLOCATOR_GIB} GiB outside PyTorch's allocator ({budget / GIB:.2f} GiB)")
    if peak_bytes > budget:
        return (f"warning: {where}: expect out of memory; python -m agoq.plan --gpus N (with this run's flags) "
                "finds a layout, policy and recompute that fit")
    if needs_expandable(peak_bytes, budget) and not expandable:
        return (f"warning: {where}: under {FRAGMENTATION_GIB} GiB to spare; launch with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (without it a stage this close ran out of memory "
                "in its second iteration: docs/benchmarks/capacity.md, one-GPU stage proxy)")
    return None
