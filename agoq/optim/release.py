"""Gradient release (FlashOptim, arXiv 2602.23349): step each parameter inside its post-accumulate-grad hook and
free the gradient at once, so at most one parameter's gradient is alive (saves 2 B/param for bf16).

Valid only when every gradient is final after one backward: one pipeline stage, no gradient
accumulation, no data-parallel gradient reduction (the hook fires before any all-reduce), no global
gradient clipping and no loss scaler. check_release_compatible() names the conflicting flag.
"""

from __future__ import annotations

import torch

from agoq.optim.base import QuantizedOptimizer


def check_release_compatible(*, pipeline_parallel: int = 1, grad_accumulation: int = 1, data_parallel: int = 1,
                             clip_grad: float = 0.0, loss_scale: bool = False) -> None:  # fmt: skip
    """Raise ValueError naming the first setting that makes gradient release invalid."""
    conflicts = [
        (pipeline_parallel > 1, f"--pipeline-model-parallel-size {pipeline_parallel} (needs 1)"),
        (data_parallel > 1, f"data-parallel size {data_parallel} (the hook steps before the gradient all-reduce)"),
        (grad_accumulation > 1, f"gradient accumulation over {grad_accumulation} micro-batches (needs 1: "
                                "--global-batch-size = --micro-batch-size x data-parallel size)"),
        (clip_grad > 0, f"--clip-grad {clip_grad} (global-norm clipping needs every gradient first; use 0)"),
        (loss_scale, "fp16 loss scaling (use bf16)"),
    ]  # fmt: skip
    for bad, what in conflicts:
        if bad:
            raise ValueError(f"--agoq-gradient-release conflicts with {what}; drop one of the two")


class GradientRelease:
    """Registers the hooks; .remove() undoes them. optimizer.step() must not be called meanwhile
    (every parameter is stepped in its hook); zero_grad() is unnecessary (grads are freed).

    ``before_step(p, grad)``, if given, runs in the hook before the step (e.g. a non-finite check that
    raises). Each hook looks its param group up by index when it fires, so the learning rate and
    weight decay a scheduler wrote, and the group dicts ``load_state_dict`` re-creates, are the ones
    used. ``stepped`` counts the parameters stepped since the last ``reset_count()``.
    """

    def __init__(self, optimizer: QuantizedOptimizer, before_step=None):
        if not isinstance(optimizer, QuantizedOptimizer):
            raise ValueError(f"gradient release needs an agoq.optim optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.before_step = before_step
        self.stepped = 0
        self.handles = []
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._hook(index)))

    def _hook(self, group_index: int):
        def step_and_free(p: torch.Tensor) -> None:
            grad = p.grad
            if self.before_step is not None:
                self.before_step(p, grad)
            self.optimizer.step_param(p, grad, self.optimizer.param_groups[group_index])
            p.grad = None
            self.stepped += 1

        return step_and_free

    def reset_count(self) -> None:
        self.stepped = 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
