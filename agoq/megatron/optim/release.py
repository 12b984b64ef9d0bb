"""Gradient release in agoq's Megatron path (``--agoq-gradient-release``): each parameter is stepped by
agoq's optimizer inside its post-accumulate-grad hook and its gradient freed, so no gradient buffer
exists and at most about one parameter's gradient is alive (FlashOptim, arXiv 2602.23349).

Seam card
---------
Touches (megatron-core 0.19.2):
  * ``distributed.data_parallel_base._BaseDataParallel`` — subclassed (``ReleaseDataParallel``) instead of
    Megatron's ``DistributedDataParallel``, whose contiguous ``main_grad`` buffer (4 B/param with
    grad_reduce_in_fp32) is what release removes. It offers what the schedules, ``StepRunner`` and
    the checkpoint code call on a model chunk: ``no_sync``, ``start_grad_sync``, ``finish_grad_sync``,
    ``zero_grad_buffer``, ``scale_gradients``, ``broadcast_params``, ``.module``, ``.config`` (found by
    ``megatron.core.utils.get_model_config`` through the ``.module`` chain) and ``buffers`` (empty).
  * ``TransformerConfig.finalize_model_grads_func`` — set to ``finalize_release_grads`` (no reduction is
    needed with one data-parallel, tensor-parallel and pipeline rank; per-token loss scaling would
    need gradients that are already applied, so it raises).
  * ``optimizer.optimizer.FP32Optimizer`` through ``agoq.megatron.optim.megatron_optimizer.AgoqMegatronOptimizer``
    — ``AgoqReleaseOptimizer.step()`` steps nothing (the hooks did) and returns Megatron's
    ``(update_successful, grad_norm, num_zeros)`` = ``(True, None, None)``, as FP32Optimizer does with
    ``--clip-grad 0``; the caller's LR-schedule step and the checkpoint's per-param ``step`` advance
    exactly as without release.
Why: Megatron has no per-parameter step; its DDP would allocate the full buffer and add every gradient
  into it. Valid only where every gradient is final after one backward (agoq.optim.release), enforced
  by the trainer (``agoq.cli.optim_args.check_release_flags``) before anything is built.
Non-finite gradients: checked per parameter in the hook before its step (agoq.ops.nonfinite; one host
  sync per parameter). Other parameters may already be stepped, so the iteration cannot be skipped as
  without release: a ``RuntimeError`` naming the iteration and the parameter stops the job (like
  Megatron's ``check_for_nan_in_grad``); resume from the last checkpoint.
Verified on: megatron-core 0.19.2 (CPU/gloo tests; whole ~1B steps on an H100,
benchmarks/results/pretrain_release.json).
Guarded by: tests/megatron/test_release.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from agoq.config import flag_for
from agoq.megatron.optim.megatron_optimizer import AgoqMegatronOptimizer, keep_autograd_grad_dtype
from agoq.ops.fp8_weight_cache import fp8_weights_changed
from agoq.ops.nonfinite import nonfinite_in
from agoq.optim.release import GradientRelease


class TrainingStopped(RuntimeError):
    """A documented stop of training (not a bug): gradient release met a non-finite gradient or loss after
    parameters were already updated. scripts/pretrain_llama.py prints it in one line, without a traceback."""


class ReleaseDataParallel(_BaseDataParallel):
    """Megatron's data-parallel wrapper interface without a gradient buffer (one data-parallel rank)."""

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config=config, module=module)
        # Megatron's DDP keeps lists of grad buffers under these names (shadowing nn.Module.buffers());
        # code that walks a chunk's buffers (non-finite check, memory report) finds none here.
        self.buffers = []
        self.expert_parallel_buffers = []
        self.accumulating = False  # inside no_sync(): a backward there would accumulate micro-batches

    @contextmanager
    def no_sync(self):
        """Megatron's schedule enters it around all but the last micro-batch (with one micro-batch it
        wraps no backward); a backward inside it makes the release hook raise."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    def start_grad_sync(self, *unused):
        """Nothing to reduce: one data-parallel rank, and the gradients are already applied."""

    def finish_grad_sync(self, force_all_reduce: bool = False):
        """Nothing to reduce (see start_grad_sync)."""

    def scale_gradients(self, scaling_factor: float) -> None:
        raise RuntimeError(f"{flag_for('optimizer.gradient_release')}: gradients are applied inside backward and "
                           "cannot be scaled afterwards (per-token loss scaling is not supported with "
                           "release)")  # fmt: skip

    def zero_grad_buffer(self):
        """No buffer; drop any .grad left over (release frees each one inside backward)."""
        for p in self.module.parameters():
            p.grad = None

    def broadcast_params(self):
        """One data-parallel rank: nothing to broadcast."""


def wrap_release(chunks: list, config: TransformerConfig, device: torch.device) -> list[ReleaseDataParallel]:
    """agoq.megatron.model.wrap_ddp's shape (to device, Float16Module for bf16) without Megatron's DDP."""
    if len(chunks) != 1:
        raise ValueError(f"{flag_for('optimizer.gradient_release')} needs one model chunk (no virtual pipeline stages)")
    wrapped = []
    for chunk in chunks:
        chunk.to(device)
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)
        wrapped.append(ReleaseDataParallel(config, chunk))
    return wrapped


def finalize_release_grads(model: list, num_tokens=None, pg_collection=None, force_all_reduce=False) -> None:
    """Megatron's finalize_model_grads_func contract; with release there is nothing to finalize."""
    if num_tokens is not None:
        raise RuntimeError(f"{flag_for('optimizer.gradient_release')} does not support per-token loss scaling "
                           "(calculate_per_token_loss): the gradients are already applied")  # fmt: skip
    for chunk in model:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)


class AgoqReleaseOptimizer(AgoqMegatronOptimizer):
    """AgoqMegatronOptimizer whose parameters are stepped by release hooks during backward.

    ``step()`` checks that every parameter was stepped exactly once in the last backward and returns
    ``(True, None, None)``; checkpoints (sharded_state_dict / load_state_dict) are AgoqMegatronOptimizer's,
    so a run can be resumed with or without release. ``iteration`` (set by the training loop) and
    ``param_names`` label the error of a non-finite gradient."""

    def __init__(self, optimizer, config, init_state_fn, model_chunks: list):
        if not model_chunks or not all(isinstance(c, ReleaseDataParallel) for c in model_chunks):
            raise ValueError(f"{flag_for('optimizer.gradient_release')} needs the model wrapped by "
                             "agoq.megatron.optim.release.wrap_release "
                             "(Megatron's DDP would allocate the gradient buffer release removes)")  # fmt: skip
        super().__init__(optimizer, config, init_state_fn)
        self.model_chunks = model_chunks
        self.iteration: int | None = None
        self.param_names: dict[int, str] = {}
        self.num_params = sum(1 for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
        # the gradients the buffered path steps with: fp32 for the norm gains (see keep_autograd_grad_dtype)
        keep_autograd_grad_dtype([p for g in optimizer.param_groups for p in g["params"]])
        self.release = GradientRelease(optimizer, before_step=self._before_step)

    def _before_step(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        if any(getattr(chunk, "accumulating", False) for chunk in self.model_chunks):
            raise RuntimeError(f"{flag_for('optimizer.gradient_release')}: a backward ran inside no_sync(), i.e. "
                               "gradients are accumulated over several micro-batches; release needs one micro-batch "
                               "per step (--global-batch-size = --micro-batch-size)")  # fmt: skip
        if bool(nonfinite_in(grad.reshape(-1))):
            at = f"iteration {self.iteration}" if self.iteration is not None else "this step"
            name = self.param_names.get(id(p), f"<unnamed {tuple(p.shape)}>")
            raise TrainingStopped(
                f"{flag_for('optimizer.gradient_release')}: non-finite gradient (NaN/Inf) of {name} at {at}. The step "
                "cannot be skipped as without release (other parameters may already be updated): stopping. Resume from "
                f"the last checkpoint (lower --lr, or run without {flag_for('optimizer.gradient_release')} to skip "
                "such steps)")

    def zero_grad(self, set_to_none: bool = True):
        self.release.reset_count()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self):
        stepped, self.release.stepped = self.release.stepped, 0
        left = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if left or stepped != self.num_params:
            names = [self.param_names.get(id(p), str(tuple(p.shape))) for p in left[:3]]
            raise RuntimeError(
                f"{flag_for('optimizer.gradient_release')}: {stepped} of {self.num_params} parameters were stepped in "
                "backward"
                + (f"; gradients left unreleased: {names}" if left else "")
                + " (unused parameters, or a backward outside Megatron's schedule, are not supported with release)")
        fp8_weights_changed()  # the hooks moved the weights outside torch's Optimizer.step (its post-hook)
        return True, None, None
