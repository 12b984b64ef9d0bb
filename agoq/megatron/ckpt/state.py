"""What an agoq checkpoint holds, as ``megatron.core.dist_checkpointing`` state: the model chunks' and the
optimizer's sharded state dicts, the LR schedule, the progress counters, agoq's record and every rank's RNG states;
and the torch.optim ``step`` that megatron-core 0.19.2 does not keep. Saving (agoq.megatron.ckpt.save) and loading
(agoq.megatron.ckpt.load) build the same layout from here.

Seam card
---------
Touches: ``MegatronModule.sharded_state_dict`` / ``load_state_dict``, ``MegatronOptimizer.sharded_state_dict``
  (public API; ``distrib_optim_sharding_type`` metadata), ``dist_checkpointing.mapping.ShardedObject``,
  ``tensor_parallel.get_cuda_rng_tracker``; the torch.optim states inside Megatron's (chained) optimizer.
Why: the sharded format reloads under a different data-parallel size and is what Megatron users already use.
Verified on: megatron-core 0.19.2 (CPU gloo and GPU NCCL).
Guarded by: ``tests/megatron/test_resume.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

# Reloadable with another data-parallel size. Megatron's default, fully_sharded_model_space, fails in
# 0.19.2 with "ShardedTensor.flattened_range is not supported" (measured).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
# state["agoq"][WEIGHTS_ONLY_KEY] = True: a converted checkpoint (python -m agoq.convert hf-to-agoq,
# agoq.megatron.ckpt.hf_checkpoint) holding the model's tensors only; --load takes the weights and starts the
# optimizer, LR schedule and data position fresh.
WEIGHTS_ONLY_KEY = "weights_only"


@dataclass(frozen=True)
class Progress:
    iteration: int
    consumed_samples: int
    skipped_iterations: int = 0


def model_sharded_state_dict(model_chunks: list) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].module.sharded_state_dict()}
    return {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def full_sharded_state_dict(model_chunks, optimizer, scheduler, progress: Progress | None,
                            *, is_loading: bool, extra: dict | None = None) -> dict:
    state = model_sharded_state_dict(model_chunks)
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
    if scheduler is not None:  # a load reads the schedule from the common state
        state["opt_param_scheduler"] = scheduler.state_dict()
    if progress is not None:
        state["progress"] = progress.__dict__.copy()
    state["agoq"] = dict(extra or {})
    state["rng_state"] = _rng_sharded_object()
    return state


def data_parallel_size() -> int:
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _rng_sharded_object() -> ShardedObject:
    """This rank's RNG states (Python, NumPy, torch CPU/CUDA, Megatron's tracker), one object per
    (pp, tp, dp) rank, as Megatron's training checkpoints keep them."""
    rng = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    offset = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return ShardedObject("rng_state", rng, shape, offset, replica_id=0)


def restore_rng(rng: dict) -> None:
    random.setstate(rng["random"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


def load_model_chunks(state: dict, model_chunks) -> None:
    if len(model_chunks) == 1:
        model_chunks[0].module.load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            chunk.module.load_state_dict(state[f"model{i}"])


def _torch_optimizers(optimizer) -> list:
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def torch_optimizer_step(optimizer) -> float | None:
    """The common ``step`` of torch.optim states (None before the first step)."""
    steps = {
        float(state["step"])
        for torch_optimizer in _torch_optimizers(optimizer)
        for state in torch_optimizer.state.values()
        if "step" in state
    }
    if len(steps) > 1:
        raise RuntimeError(f"optimizer states disagree on the step count: {sorted(steps)}")
    return steps.pop() if steps else None


def set_torch_optimizer_step(optimizer, step: float | None) -> None:
    """Restore ``step`` as one tensor per parameter state.

    megatron-core 0.19.2 without TE/apex loses the step on load (it comes back as 0) and puts one
    shared tensor in every state, which torch's AdamW then increments once per parameter (measured:
    13 after one update). agoq saves the step itself and restores it here.
    """
    for torch_optimizer in _torch_optimizers(optimizer):
        for state in torch_optimizer.state.values():
            if step is None:
                state.pop("step", None)
            elif "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def init_torch_optimizer_steps(optimizer) -> None:
    """Give a fresh torch.optim state a ``step`` before loading into it.

    Without TE/apex, ``DistributedOptimizer.state_dict()`` (called while building the load template)
    asserts that every param state holds one common tensor ``step``; Megatron's ``init_state_fn``
    creates only ``exp_avg``/``exp_avg_sq`` (megatron-core 0.19.2, measured). The loaded state
    overwrites these zeros.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if inner.init_state_fn is not None:
            inner.init_state_fn(torch_optimizer, inner.config)
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if state and "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
