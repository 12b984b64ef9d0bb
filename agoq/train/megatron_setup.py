"""What the trainer builds on megatron-core from its flags: Megatron's OptimizerConfig and DDP config, the optimizer
(Megatron's Adam or agoq's) and the LR schedule; and :class:`MegatronLoop`, megatron-core's parts of the loop that the
entry script hands in. Megatron-LM's ``setup_model_and_optimizer`` / ``get_optimizer_param_scheduler`` shape, on
megatron.core through agoq.megatron's functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agoq.megatron import training_parts
from agoq.megatron.optim.optimizer import build_agoq_optimizer, build_megatron_optimizer


def megatron_optimizer_config(args, params_dtype: torch.dtype):
    """Megatron's OptimizerConfig of the run's flags (Megatron's Adam, and the Megatron side of agoq's)."""
    return training_parts.optimizer_config(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


@dataclass(frozen=True)
class MegatronLoop:
    """megatron-core's parts of a training loop, which the trainer runs: handed in by the entry script
    (scripts/pretrain_llama.py imports them from megatron-core, as Megatron-LM's training package does), because the
    trainer imports no megatron and the plugin (agoq.megatron) runs no loop and names none of its parts
    (tests/unit/test_boundaries.py)."""

    schedule: Callable[[], Callable]
    """``megatron.core.pipeline_parallel.get_forward_backward_func``: the pipeline schedule for the run's layout."""
    lr_schedule: Callable[..., Any]
    """``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler``: the LR and weight-decay schedule."""


def build_optimizer(args, model_chunks: list, params_dtype: torch.dtype):
    """Megatron's Adam (--agoq-optimizer torch) or agoq's (args.agoq_config.optimizer)."""
    config = megatron_optimizer_config(args, params_dtype)
    if args.agoq_config.optimizer.agoq:
        return build_agoq_optimizer(args.agoq_config, config, model_chunks)
    return build_megatron_optimizer(config, model_chunks)


def build_scheduler(args, optimizer, lr_schedule: Callable[..., Any]):
    """``lr_schedule`` (Megatron's OptimizerParamScheduler, :attr:`MegatronLoop.lr_schedule`) over ``optimizer`` for
    the run's flags (steps counted in samples, as Megatron)."""
    return lr_schedule(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant",
    )  # fmt: skip


def ddp_config(args, params_dtype: torch.dtype):
    # Megatron's bf16 default: accumulate and reduce gradients in fp32 (arguments.py sets
    # accumulate_allreduce_grads_in_fp32 for bf16); --grad-reduce-in-bf16 keeps them in bf16 (as
    # Megatron's flag of the same name).
    return training_parts.ddp_config(
        grad_reduce_in_fp32=params_dtype != torch.float32 and not getattr(args, "grad_reduce_in_bf16", False),
        overlap_grad_reduce=args.overlap_grad_reduce,
        # --overlap-param-gather: the updated parameters are all-gathered in the next forward (DDP's forward
        # pre-hooks; agoq.train.training.ParamGather syncs them before saves and evaluation); with
        # interleaved pipelines the stages launch the gathers together (Megatron-LM's default
        # align_param_gather: the schedule calls each chunk's start_param_sync, training.configure_grad_hooks)
        overlap_param_gather=getattr(args, "overlap_param_gather", False),
        align_param_gather=bool(getattr(args, "overlap_param_gather", False) and getattr(args, "vpp", None)),
        bucket_size=args.ddp_bucket_size,  # None: Megatron's max(40M, 1M x DP) with overlap, one bucket without
        use_distributed_optimizer=args.use_distributed_optimizer,
        # agoq's step checks loss and reduced gradients itself and skips a non-finite step (counted,
        # logged); Megatron's check would stop the job from inside the gradient reduction instead.
        check_for_nan_in_grad=False,
    )
