"""The training step and loop on megatron-core: forward_step, loss, schedules, optimizer, logging.

Seam card
---------
Touches: the pipeline schedule :class:`StepRunner` is given (megatron-core's ``get_forward_backward_func()``, which
  the entry script hands in: agoq.train.megatron_setup.MegatronLoop), ``finalize_model_grads`` and the
  ``no_sync_func`` / ``grad_sync_func`` / ``param_sync_func`` / ``finalize_model_grads_func`` config hooks,
  Megatron's optimizer ``step()`` contract ``(update_successful, grad_norm, num_zeros)``; with
  ``--overlap-param-gather`` DDP's ``start_param_sync`` (the interleaved schedule's ``param_sync_func``) and
  ``disable_forward_pre_hook(param_sync=True)`` / ``enable_forward_pre_hook`` (:class:`ParamGather`).
Why: the shape of Megatron's ``pretrain_gpt.py`` / ``training.train_step``, rebuilt on megatron.core
  because ``megatron.training.pretrain`` is GPU-only in 0.19.2 (it asserts CUDA).
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_pretrain_script.py`` (loss falls), ``tests/megatron/test_layouts.py``
  (PP=2 1F1B and interleaved; DDP with and without the distributed optimizer, ``--overlap-param-gather``) and
  ``tests/megatron/test_resume.py`` (checkpoints, also with ``--overlap-param-gather``).

Shape legend: b = micro-batch, s = sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from agoq.config import flag_for
from agoq.megatron import graphs, runtime, training_parts
from agoq.megatron.optim.release import ReleaseDataParallel, TrainingStopped, finalize_release_grads
from agoq.ops.fp8_weight_cache import fp8_weights_changed
from agoq.ops.nonfinite import nonfinite_in
from agoq.train import hoststats


def _loss_func(loss_mask_BS: torch.Tensor, output_BS: torch.Tensor):
    """Mean next-token loss over unmasked tokens of one micro-batch (Megatron's 2-tuple contract)."""
    losses = output_BS.float().reshape(-1)
    mask = loss_mask_BS.float().reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def make_forward_step(device: torch.device, poison: dict | None = None, rope_per_microbatch: bool = False) -> Callable:
    """``poison["now"]`` True makes the loss NaN (fault-injection for tests of the skip path);
    ``rope_per_microbatch``: a fresh rotary table per micro-batch (CUDA graphs at PP > 1: agoq.megatron.graphs)."""

    def forward_step(data_iterator: Iterator, model):
        if rope_per_microbatch:
            graphs.rope_per_microbatch()
        batch = next(data_iterator)
        tokens_BS = batch["tokens"].to(device, non_blocking=True)
        labels_BS = batch["labels"].to(device, non_blocking=True)
        position_ids_BS = batch["position_ids"].to(device, non_blocking=True)
        loss_mask_BS = batch["loss_mask"].to(device, non_blocking=True)
        output_BS = model(tokens_BS, position_ids_BS, None, labels=labels_BS)
        if poison and poison.get("now"):
            output_BS = output_BS * float("nan")
        return output_BS, partial(_loss_func, loss_mask_BS)

    return forward_step


def configure_grad_hooks(model_chunks: list, config) -> None:
    """Megatron-LM's training.setup_model_and_optimizer hooks, for DDP-wrapped chunks: ``no_sync`` per chunk;
    with overlap_grad_reduce each chunk's ``start_grad_sync`` as ``grad_sync_func`` (Megatron-LM's default
    ``align_grad_reduce``: the pipeline schedules launch a chunk's reduction after its last backward)."""
    no_sync = [chunk.no_sync for chunk in model_chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_sync_func = None
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    if ddp_config is not None and ddp_config.overlap_grad_reduce:
        sync = [chunk.start_grad_sync for chunk in model_chunks]
        config.grad_sync_func = sync[0] if len(sync) == 1 else sync
    config.param_sync_func = None
    if ddp_config is not None and ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        # Megatron-LM's --overlap-param-gather with interleaved pipelines (align_param_gather, its default): the
        # schedule launches each chunk's parameter all-gather at the same point on every stage
        sync = [chunk.start_param_sync for chunk in model_chunks]
        config.param_sync_func = sync[0] if len(sync) == 1 else sync
    config.finalize_model_grads_func = training_parts.megatron_finalize_model_grads
    if any(isinstance(chunk, ReleaseDataParallel) for chunk in model_chunks):
        config.finalize_model_grads_func = finalize_release_grads  # gradients applied in backward: no reduction


class ParamGather:
    """``--overlap-param-gather`` (DDP ``overlap_param_gather`` with the distributed optimizer): after the
    step each rank holds only its own shard of the updated parameters; the rest arrive bucket by bucket in
    the next forward, through DDP's forward pre-hooks. Whatever reads the weights outside a training
    forward (a checkpoint save, evaluation, the end of training) first disables the hooks, which forces the
    all-gather (``disable_forward_pre_hook(param_sync=True)``), and re-enables them after: Megatron-LM's
    training loop does the same around saves, evaluation and at the end. Without the flag: nothing."""

    def __init__(self, model_chunks: list):
        self.chunks = [c for c in model_chunks
                       if getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False)]
        self.hooks_on = bool(self.chunks)  # DDP registers the pre-hooks in its constructor

    def pause(self) -> None:
        """All-gather the updated parameters now and take the pre-hooks off (no-op when they are off)."""
        if self.hooks_on:
            for chunk in self.chunks:
                chunk.disable_forward_pre_hook(param_sync=True)
            self.hooks_on = False

    def resume(self) -> None:
        if self.chunks and not self.hooks_on:
            for chunk in self.chunks:
                chunk.enable_forward_pre_hook()
            self.hooks_on = True

    @contextmanager
    def synced(self):
        """The updated parameters in every chunk for the ``with`` block; the overlap back on after it."""
        was_on = self.hooks_on
        self.pause()
        try:
            yield
        finally:
            if was_on:
                self.resume()


@dataclass
class StepResult:
    loss: float | None  # averaged over micro-batches and data-parallel ranks; None off the last stage
    grad_norm: float | None
    update_successful: bool
    seconds: float
    steal_seconds: float | None = None  # CPU-seconds the hypervisor took from the host (hoststats); None: unknown
    enqueue_seconds: float | None = None  # until the forward/backward schedule returned, before the loss's sync
    threads: list | None = None  # the busiest threads' CPU and run-queue seconds (hoststats.threads_since)
    gc_collections: int | None = None  # Python's garbage collections inside the step, and their seconds
    gc_seconds: float | None = None


@dataclass
class StepRunner:
    """Runs one global batch: zero grads, forward/backward over micro-batches, optimizer step."""

    model_chunks: list
    optimizer: object
    scheduler: object
    device: torch.device
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    forward_backward_func: Callable
    """Megatron's pipeline schedule for this run's layout (``get_forward_backward_func()``, as Megatron-LM's
    ``train_step`` takes it): no pipelining, 1F1B or interleaved."""
    forward_step: Callable = field(init=False)
    param_gather: ParamGather = field(init=False)
    poison: dict = field(default_factory=dict)
    iteration: int | None = None  # the iteration run() performs (labels gradient release's errors)

    def __post_init__(self):
        config = training_parts.model_config(self.model_chunks[0])
        self.forward_step = make_forward_step(self.device, self.poison, graphs.needs_rope_per_microbatch(config))
        self.param_gather = ParamGather(self.model_chunks)

    def evaluate(self, data_iterators: list[Iterator], num_batches: int) -> float | None:
        """Mean validation loss over ``num_batches`` global batches (forward only, no gradients)."""
        fp8_weights_changed()
        for chunk in self.model_chunks:
            chunk.eval()
        total = 0.0
        with torch.no_grad(), self.param_gather.synced():
            for _ in range(num_batches):
                losses = self.forward_backward_func(
                    forward_step_func=self.forward_step,
                    data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
                    model=self.model_chunks, num_microbatches=self.num_microbatches,
                    seq_length=self.seq_length, micro_batch_size=self.micro_batch_size, forward_only=True,
                )
                loss = _reduce_losses(losses, self.device)
                total += 0.0 if loss is None else loss
        for chunk in self.model_chunks:
            chunk.train()
        return total / num_batches if runtime.is_last_stage() else None

    def run(self, data_iterators: list[Iterator]) -> StepResult:
        """One step, with where its host time went (hoststats: steal, per-thread CPU / run-queue time, GC)."""
        steal_before, threads_before = hoststats.cpu_steal_seconds(), hoststats.thread_times()
        meter = hoststats.GCMeter().install()
        try:
            result = self._run(data_iterators)
        finally:
            meter.remove()
        result.steal_seconds = hoststats.steal_since(steal_before)
        result.threads = hoststats.threads_since(threads_before, hoststats.main_thread_id())
        result.gc_collections, result.gc_seconds = meter.reading()
        return result

    def _run(self, data_iterators: list[Iterator]) -> StepResult:
        start = time.perf_counter()
        fp8_weights_changed()  # FP8 weight caches: cast each weight once per step (the last step moved them)
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        release = getattr(self.optimizer, "release", None)  # --agoq-gradient-release: steps inside backward
        if release is not None:
            self.optimizer.iteration = self.iteration
        losses = self.forward_backward_func(
            forward_step_func=self.forward_step,
            data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
            model=self.model_chunks,
            num_microbatches=self.num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            forward_only=False,
        )
        enqueued = time.perf_counter() - start  # the host's pace when the step is host-bound (no sync before here)
        loss = _reduce_losses(losses, self.device)
        if _any_rank_nonfinite(self.model_chunks, loss, self.device):
            if release is not None:  # the parameters were stepped in backward: skipping is impossible
                raise TrainingStopped(f"{flag_for('optimizer.gradient_release')}: non-finite loss {loss} at iteration "
                                      f"{self.iteration} after the parameters were updated in backward; stopping "
                                      "(resume from the last checkpoint)")
            # Skip the update (Megatron's fp16 loss-scaler behaviour, applied to bf16): no optimizer or
            # LR-schedule step; the caller counts and reports it.
            return StepResult(loss=loss, grad_norm=None, update_successful=False,
                              seconds=time.perf_counter() - start, enqueue_seconds=enqueued)
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.global_batch_size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(
            loss=loss,
            grad_norm=None if grad_norm is None else float(grad_norm),
            update_successful=bool(update_successful),
            seconds=time.perf_counter() - start,
            enqueue_seconds=enqueued,
        )


def _any_rank_nonfinite(model_chunks: list, loss: float | None, device: torch.device) -> bool:
    """True on every rank when any rank's loss or reduced gradient buffer holds NaN/Inf."""
    bad = loss is not None and not math.isfinite(loss)
    found = None
    for chunk in model_chunks:
        check = getattr(chunk, "agoq_grads_nonfinite", None)  # 8-bit gradients (agoq/megatron/grads/ddp.py)
        if check is not None:
            bad = bad or check()
            continue
        for buffer in getattr(chunk, "buffers", []):
            found = nonfinite_in(buffer.grad_data, found)
    flag = torch.tensor([1 if bad else 0], device=device)
    if found is not None:
        flag = torch.maximum(flag, found.to(flag.dtype))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _reduce_losses(losses: list[dict], device: torch.device) -> float | None:
    """Average 'lm loss' over micro-batches, then over the data-parallel group (last stage only)."""
    if not runtime.is_last_stage():
        return None
    return runtime.mean_over_data_parallel(torch.stack([d["lm loss"].float() for d in losses]).mean().reshape(1)
                                           .to(device))


def is_logging_rank() -> bool:
    """The rank that prints and records the iteration: the last pipeline stage's first tensor- and data-parallel
    rank (its loss is the data-parallel mean; Megatron-LM's own log line comes from the last rank)."""
    return runtime.is_last_stage() and runtime.speaks_for_stage()


@dataclass
class IntervalMeter:
    """What one logged line reports for the iterations since the previous one (Megatron-LM's ``training_log``): the
    loss averaged over the interval's updated iterations (a skipped one's loss is left out; NaN when every one was
    skipped), the mean step time; the grad norm is the last iteration's. With --log-interval 1 the line is that
    iteration's own numbers (a skipped iteration's loss included); with N > 1 it used to be the N-th iteration's
    alone. Host readings: steal and enqueue time are means per iteration, garbage collections the interval's sums,
    the thread list the last iteration's (as the grad norm)."""

    loss_sum: float = 0.0
    losses: int = 0
    seconds_sum: float = 0.0
    iterations: int = 0
    steal_sum: float | None = 0.0  # None once an iteration's steal was unknown
    enqueue_sum: float | None = 0.0  # likewise
    gc_collections: int | None = 0
    gc_seconds: float | None = 0.0

    def add(self, result: StepResult) -> None:
        self.iterations += 1
        self.seconds_sum += result.seconds
        self.steal_sum = _sum_known(self.steal_sum, result.steal_seconds)
        self.enqueue_sum = _sum_known(self.enqueue_sum, result.enqueue_seconds)
        self.gc_collections = _sum_known(self.gc_collections, result.gc_collections)
        self.gc_seconds = _sum_known(self.gc_seconds, result.gc_seconds)
        if result.update_successful and result.loss is not None:
            self.loss_sum += result.loss
            self.losses += 1

    def take(self, last: StepResult) -> StepResult:
        """The interval's line values (``last``: the interval's last iteration), and a fresh interval."""
        steal, enqueue, gc_collections, gc_seconds = self.steal_sum, self.enqueue_sum, self.gc_collections, \
            self.gc_seconds
        if self.iterations <= 1:  # --log-interval 1: the iteration itself (a skipped one shows its own loss)
            self._reset()
            return last
        if last.loss is None:  # not the last pipeline stage: no loss here
            loss = None
        else:
            loss = self.loss_sum / self.losses if self.losses else float("nan")
        averaged = StepResult(loss=loss, grad_norm=last.grad_norm, update_successful=last.update_successful,
                              seconds=self.seconds_sum / max(1, self.iterations),
                              steal_seconds=None if steal is None else steal / self.iterations,
                              enqueue_seconds=None if enqueue is None else enqueue / self.iterations,
                              threads=last.threads, gc_collections=gc_collections, gc_seconds=gc_seconds)
        self._reset()
        return averaged

    def _reset(self) -> None:
        self.loss_sum, self.losses, self.seconds_sum, self.iterations, self.steal_sum = 0.0, 0, 0.0, 0, 0.0
        self.enqueue_sum, self.gc_collections, self.gc_seconds = 0.0, 0, 0.0


def _sum_known(total, value):
    """``total + value``; None once either is unknown."""
    return None if total is None or value is None else total + value


def format_iteration_line(
    iteration: int, train_iters: int, result: StepResult, *, lr: float, consumed_samples: int,
    tokens_per_step: int, memory: str, skipped: int,
) -> str:
    loss = "n/a" if result.loss is None else f"{result.loss:.6f}"  # non-finite prints as nan / inf
    grad_norm = "n/a" if result.grad_norm is None else f"{result.grad_norm:.4f}"
    return (
        f"iteration {iteration:6d}/{train_iters} | consumed samples: {consumed_samples} | "
        f"elapsed time per iteration (ms): {result.seconds * 1e3:.1f} | learning rate: {lr:.4e} | "
        f"lm loss: {loss} | grad norm: {grad_norm} | skipped iterations: {skipped} | "
        f"tokens/s: {tokens_per_step / result.seconds:.1f} | {memory}"
    )


def exit_interval_reached(iteration: int, exit_interval: int | None) -> bool:
    """Megatron-LM's ``--exit-interval N``: stop (after saving) at every iteration that is a multiple of N; None or 0:
    never. A run resumed past N stops at the next multiple, as in Megatron-LM (it used to stop only at iteration N
    itself, so a resumed run never stopped through it)."""
    return bool(exit_interval) and iteration % exit_interval == 0

