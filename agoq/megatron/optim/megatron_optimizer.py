"""agoq.optim in Megatron's optimizer interface without the distributed optimizer: ``AgoqMegatronOptimizer``
(Megatron's FP32Optimizer over an agoq.optim optimizer on the bf16 params, with compressed sharded checkpoints).
agoq.megatron.optim.optimizer.build_agoq_optimizer builds it; agoq.megatron.optim.release.AgoqReleaseOptimizer
extends it.

Path: agoq's optimizer runs directly on the bf16 model params inside Megatron's FP32Optimizer
wrapper (which copies param.main_grad to .grad, clips by the global norm and steps), so no fp32 main-param copy
exists: the split master replaces it. Checkpoints: ``sharded_state_dict`` saves the quantized codes, scales and
remainders as they are (flat ShardedTensors keyed by the model param's key, replicated over DP, so any DP size loads
them), and no torch param groups: those differ between pipeline stages, and a load keeps the live ones.
With 8-bit gradients (``--agoq-grads`` store mode) ``grad_reader`` is set and the gradients are read one parameter
at a time (agoq/megatron/grads/grad_reader.py).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer.optimizer import FP32Optimizer

from agoq.megatron.grads import grad_reader

STATE_PREFIX = "optimizer.agoq_state"


def init_all_states(optimizer, _config=None) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.init_state(p, group)


def _tp_fragment(param) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """(rank offsets, replica id) of a parameter's flat state under tensor parallelism."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if getattr(param, "tensor_model_parallel", False):
        return (0, tp_rank, tp_size), (0, 0, dp_rank)
    return (0, 0, 1), (0, tp_rank, dp_rank)


class AgoqMegatronOptimizer(FP32Optimizer):
    """FP32Optimizer over agoq.optim (works on bf16 params: agoq keeps the master), with compressed
    sharded checkpoints."""

    grad_reader = None  # set by agoq.megatron.grads.grad_reader.attach: 8-bit gradients read one param at a time

    def clip_grad_norm(self, clip_grad: float) -> float:
        if self.grad_reader is not None:
            return grad_reader.clip_grad_norm(self, clip_grad)
        return super().clip_grad_norm(clip_grad)

    def step_with_ready_grads(self) -> bool:
        if self.grad_reader is not None:
            return grad_reader.step_with_ready_grads(self)
        return super().step_with_ready_grads()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        if self.grad_reader is not None:
            return grad_reader.prepare_grads(self)
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            # bf16 main_grad (--grad-reduce-in-bf16): Megatron's clip path asserts an fp32 .grad, its
            # decoupled path (as in the distributed optimizer's precision-aware mode) reads .decoupled_grad
            # of either dtype; agoq's step reads it too (grad_attr, set in build_agoq_optimizer).
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    if hasattr(param, "main_grad"):
                        param.decoupled_grad = param.main_grad
            return False
        # FP32Optimizer assigns param.main_grad (fp32 with grad_reduce_in_fp32) to the bf16 param's
        # .grad; torch >= 2.10 refuses a dtype mismatch unless grad_dtype is None. agoq reads any dtype.
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad") and param.main_grad.dtype != param.dtype:
                    param.grad_dtype = None
        return super().prepare_grads()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        """{"state": {param name: {state key: ShardedTensor}, "common_step": step}}.

        Keyed by the model param's name, not torch's per-rank param index, and without torch's
        param_groups: under pipeline parallelism every stage holds other params, and the common
        (non-tensor) part of a checkpoint is rank 0's alone. Non-tensor and empty states (the formats
        string, an absent master remainder) are not saved: load keeps the live ones, which follow from
        the run's settings (the resume record makes sure they are the checkpoint's)."""
        if is_loading:
            init_all_states(self.optimizer)
        states, steps = {}, set()
        for param in self.get_parameters():
            live = self.optimizer.state.get(param)
            if not live:
                continue
            name = self.param_names[id(param)]
            offsets, replica_id = _tp_fragment(param)
            if "step" in live:
                steps.add(float(live["step"]))
            states[name] = {
                key: ShardedTensor.from_rank_offsets(f"{STATE_PREFIX}.{name}.{key}", value.reshape(-1), offsets,
                                                     replica_id=replica_id)
                for key, value in _saved_tensors(live)
            }  # fmt: skip
        if len(steps) > 1:
            raise RuntimeError(f"agoq optimizer states disagree on the step count: {sorted(steps)}")
        states["common_step"] = steps.pop() if steps else 0.0
        return {"state": states}

    def load_state_dict(self, state_dict):
        """Copy the loaded tensors into the live states (which _init_all_states created), param by param."""
        if "agoq_pieces" in state_dict:
            raise ValueError("this checkpoint's agoq optimizer states were saved with --use-distributed-optimizer; "
                             "resume with the same setting (the two state layouts differ)")  # fmt: skip
        saved = state_dict["state"]
        init_all_states(self.optimizer)
        step = saved.get("common_step")
        for param in self.get_parameters():
            name = self.param_names[id(param)]
            live = self.optimizer.state[param]
            for key, value in _saved_tensors(live):
                loaded = saved.get(name, {}).get(key)
                if not isinstance(loaded, torch.Tensor) or loaded.numel() != value.numel():
                    raise KeyError(f"checkpoint lacks agoq optimizer state {name}.{key} of {value.numel()} "
                                   f"elements (found {type(loaded).__name__})")  # fmt: skip
                value.copy_(loaded.reshape(value.shape))
            if step is not None:
                live["step"] = torch.tensor(float(step), dtype=torch.float32)
        self.optimizer.drop_plans()


def _saved_tensors(state: dict):
    """The (key, tensor) pairs of one param's state that a checkpoint holds."""
    for key, value in state.items():
        if key != "step" and isinstance(value, torch.Tensor) and value.numel() > 0:
            yield key, value


def keep_autograd_grad_dtype(params) -> None:
    """``grad_dtype = None``: autograd keeps each gradient in the dtype its backward produced instead of
    casting it to the param's dtype (torch >= 2.10). Measured on torch 2.14 CPU: torch's RMSNorm gives a
    bf16 gain an fp32 weight gradient, so the norm gains' gradients keep fp32 precision (the matmul
    weights' stay bf16). Megatron's fp32 main_grad receives them; gradient release steps with them."""
    for p in params:
        p.grad_dtype = None
