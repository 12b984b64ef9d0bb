"""The planner's Recipe of a run's AgoqConfig: one function for the trainer's start-up report
(agoq.train.memory_report), benchmarks and ``python -m agoq.plan``."""

from __future__ import annotations

from agoq.config import AgoqConfig
from agoq.config.values import parse_moments
from agoq.plan.peak import Recipe
from agoq.policy import FP8Spec


def recipe_of(config: AgoqConfig, *, on_cuda: bool = True) -> Recipe:
    """Optimizer / gradient / recompute / FP8 / RoPE settings of ``config`` as agoq.plan.peak models them, for a run
    on CUDA (the planner's case) or not (``on_cuda``: the trainer's memory report on a CPU run)."""
    opt, grads = config.optimizer, config.grads
    store = grads.quantized and grads.mode == "store"
    return Recipe(optimizer="agoq" if opt.agoq else "torch", grads=grads.format_name if store else None,
                  grad_error_feedback=grads.error_feedback,
                  moments=opt.states.names if opt.agoq else parse_moments(opt.moments), master=opt.master,
                  recompute=config.activations.recompute,
                  selective_recompute=config.activations.selective_recompute, gradient_release=opt.gradient_release,
                  fp8=config.fp8 if config.enabled else FP8Spec(), rope_fused=config.rope_fused(on_cuda))
