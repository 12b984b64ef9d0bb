"""Megatron glue for agoq.optim: build_agoq_optimizer(args, model_chunks, params_dtype) -> (optimizer,
scheduler), a drop-in for agoq.megatron.pretrain.build_optimizer.

Path (megatron.md §1.4): without --use-distributed-optimizer, agoq's optimizer runs directly on the
bf16 model params inside Megatron's FP32Optimizer wrapper (which copies param.main_grad to .grad,
clips by the global norm and steps), so no fp32 main-param copy exists: the split master replaces it.
Megatron's LR schedule writes group["lr"] / group["weight_decay"] (wd_mult 0 for biases and 1-D
params, Megatron's default rule). Checkpoints: AgoqMegatronOptimizer.sharded_state_dict saves the
quantized codes, scales and remainders as they are (flat ShardedTensors keyed by the model param's
key, replicated over DP, so any DP size loads them).
Not yet: the distributed optimizer (precision-aware TE-FusedAdam interface) raises NotImplementedError.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from agoq.megatron.optim_args import parse_moments
from agoq.optim import SGD, AdamW, Lion
from agoq.optim.release import check_release_compatible

STATE_PREFIX = "optimizer.agoq_state"


def param_groups(model_chunks: list) -> list[dict]:
    """Megatron's default grouping: no weight decay for biases and 1-D params (norm gains)."""
    decay, no_decay = [], []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    groups = [dict(params=decay, wd_mult=1.0), dict(params=no_decay, wd_mult=0.0)]
    return [dict(g, default_config=True) for g in groups if g["params"]]


def make_agoq_optimizer(args, groups: list[dict]):
    m_fmt, v_fmt = parse_moments(args.agoq_moments)
    common = dict(master=args.agoq_master, fused=not args.agoq_unfused, small_numel=args.agoq_small_numel)
    if args.agoq_optimizer == "adamw":
        return AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                     weight_decay=args.weight_decay, state_formats={"exp_avg": m_fmt, "exp_avg_sq": v_fmt},
                     **common)  # fmt: skip
    if args.agoq_optimizer == "lion":
        return Lion(groups, lr=args.lr, betas=(args.agoq_lion_beta1, args.agoq_lion_beta2),
                    weight_decay=args.weight_decay, state_formats={"exp_avg": m_fmt}, **common)  # fmt: skip
    return SGD(groups, lr=args.lr, momentum=args.agoq_sgd_momentum, nesterov=args.agoq_sgd_nesterov,
               weight_decay=args.weight_decay, state_formats={"momentum_buffer": m_fmt}, **common)  # fmt: skip


def _init_all_states(optimizer, _config=None) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.init_state(p, group)


def _fragment(model_sp) -> tuple[int, int]:
    """(index, count) of this rank's TP fragment of a model param, from its ShardedTensor."""
    if isinstance(model_sp, ShardedTensorFactory):
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            raise NotImplementedError(f"agoq optimizer checkpoints of factory-sharded {model_sp.key} need TP=1")
        return 0, 1
    counts = model_sp.axis_fragmentations or (1,) * len(model_sp.local_shape)
    index = 0
    for off, local, count in zip(
        model_sp.global_offset[model_sp.prepend_axis_num :], model_sp.local_shape, counts, strict=False
    ):
        index = index * count + off // max(local, 1)
    return index, math.prod(counts)


class AgoqMegatronOptimizer(FP32Optimizer):
    """FP32Optimizer over agoq.optim (works on bf16 params: agoq keeps the master), with compressed
    sharded checkpoints."""

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        # FP32Optimizer assigns param.main_grad (fp32 with grad_reduce_in_fp32) to the bf16 param's
        # .grad; torch >= 2.10 refuses a dtype mismatch unless grad_dtype is None. agoq reads any dtype.
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad") and param.main_grad.dtype != param.dtype:
                    param.grad_dtype = None
        return super().prepare_grads()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            _init_all_states(self.optimizer)
        state_dict = self.optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.get_parameters())
        steps = set()
        for pid, st in state_dict["state"].items():
            model_sp = id_map[pid]
            index, count = _fragment(model_sp)
            for key, value in list(st.items()):
                if key == "step":
                    steps.add(float(st.pop("step")))
                elif isinstance(value, torch.Tensor):
                    flat = value.reshape(-1)
                    st[key] = ShardedTensor.from_rank_offsets(
                        f"{STATE_PREFIX}.{model_sp.key}.{key}", flat, (0, index, count), replica_id=model_sp.replica_id
                    )
        if len(steps) > 1:
            raise RuntimeError(f"agoq optimizer states disagree on the step count: {sorted(steps)}")
        state_dict["state"]["common_step"] = steps.pop() if steps else 0.0
        return state_dict

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict, state=dict(state_dict["state"]))
        step = state_dict["state"].pop("common_step", None)
        params = self.get_parameters()
        for pid, st in state_dict["state"].items():
            st = dict(st)
            if "master" in st:
                st["master"] = st["master"].reshape(params[pid].shape)
            if step is not None:
                st["step"] = torch.tensor(step, dtype=torch.float32)
            state_dict["state"][pid] = st
        self.optimizer.load_state_dict(state_dict)


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """The same schedule as agoq.megatron.pretrain.build_optimizer."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant",
    )  # fmt: skip


def build_agoq_optimizer(args, model_chunks: list, params_dtype: torch.dtype):
    """(optimizer, scheduler) for --agoq-optimizer adamw|lion|sgd; the caller keeps Megatron's own
    build_optimizer for --agoq-optimizer torch."""
    if args.agoq_optimizer == "torch":
        raise ValueError(
            "build_agoq_optimizer needs --agoq-optimizer adamw|lion|sgd (torch = pretrain.build_optimizer)"
        )
    if args.use_distributed_optimizer:
        raise NotImplementedError(
            "--agoq-optimizer with --use-distributed-optimizer is not implemented yet; drop "
            "--use-distributed-optimizer (agoq's states are ~5 B/param without sharding) or use --agoq-optimizer torch"
        )
    if args.agoq_gradient_release:
        check_release_compatible(
            pipeline_parallel=args.pipeline_model_parallel_size,
            data_parallel=parallel_state.get_data_parallel_world_size(),
            clip_grad=args.clip_grad,
        )
        raise NotImplementedError("--agoq-gradient-release inside Megatron's DDP is not wired yet (agoq.optim.release)")
    config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                             clip_grad=args.clip_grad, params_dtype=params_dtype)  # fmt: skip
    inner = make_agoq_optimizer(args, param_groups(model_chunks))
    optimizer = AgoqMegatronOptimizer(inner, config, _init_all_states)
    return optimizer, build_scheduler(args, optimizer)
