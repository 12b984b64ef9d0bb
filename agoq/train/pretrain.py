"""``pretrain()``: the driver behind ``scripts/pretrain_llama.py``, on megatron.core only.

Order of work (Megatron's ``training.pretrain`` shape): install agoq (contract check, CPU mode when
there is no GPU) → process groups → data (rank 0 builds caches first) → model chunks + DDP →
Megatron optimizer + LR schedule → resume → train loop (log, save on interval / signal / end).
Everything that can be wrong with the input is checked before the first forward pass.

A trainer entry point (with agoq.train.args): it reads the parsed Namespace for Megatron's own flags
(layout, batch sizes, lr, logging) and hands agoq's library code the run's ``AgoqConfig``
(``args.agoq_config``, built once by agoq.train.args.parse_args) or one of its sections.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agoq.cli.optim_args import check_release_flags
from agoq.config import AgoqConfig
from agoq.megatron import runtime
from agoq.megatron.activations import policy_of
from agoq.megatron.built_check import Expectation, any_rank_failed, check_built
from agoq.megatron.ckpt import state as ckpt_state
from agoq.megatron.ckpt.load import load_checkpoint
from agoq.megatron.ckpt.resume import RECORD_KEY, data_lines, run_record, schedule_line
from agoq.megatron.ckpt.save import save_checkpoint
from agoq.megatron.compute import fc2_input_amax
from agoq.megatron.install import install
from agoq.megatron.model import ParallelLayout
from agoq.policy import ScheduleInfo
from agoq.train import determinism, environment, memory_report, training
from agoq.train.checks import check_policy_requests
from agoq.train.ckpt_startup import CheckpointGuard, predicted_checkpoint_bytes
from agoq.train.flops import tflops_per_gpu, training_flops_per_iteration
from agoq.train.manual_gc import ManualGC
from agoq.train.megatron_setup import MegatronLoop, build_optimizer, build_scheduler
from agoq.train.orphan import LauncherWatch
from agoq.train.preflight import check_layout, microbatch_count
from agoq.train.tensorboard import open_tensorboard
from agoq.train.wandb_log import Loggers, open_wandb

log = logging.getLogger("agoq.pretrain")


def print_rank0(*parts) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


def print_last(*parts) -> None:
    """Megatron's print_rank_last: the rank that sees the loss."""
    if training.is_logging_rank():
        print(*parts, flush=True)


def _print_stage_first(text: str | None) -> None:
    """Print on the first tensor- and data-parallel rank of every pipeline stage, in stage order."""
    for stage in range(runtime.pipeline_size()):
        if text and runtime.pipeline_rank() == stage and runtime.speaks_for_stage():
            print(f"[pipeline stage {stage}] {text}", flush=True)
        dist.barrier()


class Progress:
    """Rank 0's start-up progress lines (without them setup was silent for minutes): ``setup [  12.3 s]: what``,
    seconds since pretrain() began, printed before each slow phase."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, text: str) -> None:
        print_rank0(f"setup [{time.perf_counter() - self.start:6.1f} s]: {text}")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class StopSignal:
    """SIGTERM / SIGINT / SIGUSR1 ask the loop to save and exit after the current iteration."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum, _frame):
        self.received = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank got a signal (ranks must stop at the same iteration)."""
        flag = torch.tensor([1 if self.received is not None else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@dataclass
class Components:
    model: list
    optimizer: object
    scheduler: object
    layout: ParallelLayout
    flops_per_iteration: int
    policy_report: str  # the resolved policy table, saved with every checkpoint
    run_record: dict  # the run's config, shape and layout, saved with every checkpoint, checked on --load


def num_microbatches(args, layout: ParallelLayout, world_size: int) -> int:
    """Micro-batches per step (agoq.train.preflight.microbatch_count: the script checks it before torch
    loads)."""
    return microbatch_count(args.global_batch_size, args.micro_batch_size, layout.tp, layout.pp, layout.vpp,
                            world_size)


def versions_line() -> str:
    """The start-up ``versions:`` line. megatron-core's release comes from pip's metadata
    (agoq.megatron.compat.installed_mcore_version): its own ``__version__`` appends ``git rev-parse HEAD`` of
    whatever repository its install folder sits in, so a virtual environment inside a checkout (agoq's
    ``.venv``) printed ``0.19.2+<agoq's commit>``."""
    import agoq
    from agoq.megatron.compat import installed_mcore_version

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return (
        f"versions: agoq {agoq.__version__} | megatron-core {installed_mcore_version()} | "
        f"torch {torch.__version__} | triton {triton_version} | python {sys.version.split()[0]}"
    )


def pretrain(args, model_provider: Callable, datasets_provider: Callable, policy_report: Callable,
             storage_report: Callable, loop: MegatronLoop) -> None:
    """Run the whole job described by ``args`` (see agoq.train.args; ``args.agoq_config``: agoq's part) with
    megatron-core's schedule and LR schedule (``loop``).

    ``datasets_provider(args)`` returns ``(tokenizer, factory)``; ``factory(consumed_samples, consumed_valid_samples)``
    returns the ``(train, valid, test)`` micro-batch iterators (scripts/pretrain_llama.py's), or ``(train, valid)``
    for a provider without a test split (no test evaluation then)."""
    config: AgoqConfig = args.agoq_config
    if getattr(args, "deterministic_mode", False):  # before the first communicator, cuBLAS handle and kernel (also
        # without the script; a caller's own Namespace may lack the flag)
        determinism.apply_environment(os.environ)
        args.determinism_line = determinism.enable_torch(os.environ)
    launch = environment.launch_from_environment()
    device = runtime.choose_device(config.device, launch.local_rank)
    stop = StopSignal()  # from the start: a signal during start-up stops the job after its first iteration
    watch = LauncherWatch(launch.rank).start() if environment.launched_by_torchrun() else None
    progress = Progress()
    install(config)
    info = runtime.init_distributed(device, launch)
    failed, guard = True, None
    try:
        guard = CheckpointGuard.start(args)  # --save folder and its lock, what --load means (docs/user-guide.md 8)
        _run(args, info, model_provider, datasets_provider, (policy_report, storage_report), (stop, progress, guard),
             loop)
        failed = False
    finally:
        if guard is not None:
            guard.release()
        runtime.shutdown(after_error=failed)  # no collective NCCL teardown on an exception (see shutdown)
        if watch is not None:
            watch.stop()
        # slurm sends USR1 to the batch step and the launcher relays it: a second copy arriving during
        # interpreter shutdown would kill the process (exit -10) after the checkpoint was saved.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _run(args, info: runtime.RankInfo, model_provider, datasets_provider, reports, control,
         loop: MegatronLoop) -> None:
    policy_report, storage_report = reports
    stop, progress, guard = control
    layout = ParallelLayout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, vpp=args.vpp)
    check_layout(args, info.world_size)  # the script checked it before torch loaded; callers of pretrain() may not
    check_release_flags(args, data_parallel=info.world_size // (layout.tp * layout.pp))
    microbatches = num_microbatches(args, layout, info.world_size)
    check_policy_requests(args, microbatches)  # the script's preflight did too; callers of pretrain() may not
    print_rank0(versions_line())
    if getattr(args, "determinism_line", None):
        print_rank0(args.determinism_line)
    if unused := getattr(args, "config_file_unused", None):  # parse_args fills it (callers of pretrain() may not)
        print_rank0(f"--config {args.config}: not used by this run: {'; '.join(unused)}")
    print_rank0(f"device: {info.device} | world size {info.world_size} | tp {layout.tp} pp {layout.pp} "
                f"vpp {layout.vpp or 1} dp {info.world_size // (layout.tp * layout.pp)} | "
                f"micro-batches per step {microbatches}")
    runtime.init_model_parallel(layout, args.seed, info.device, cuda_graphs=args.cuda_graph_impl != "none")
    progress("tokenizer and data files" + ("" if args.data_path else " (agoq's built-in corpus)"))
    tokenizer, data_factory = datasets_provider(args)
    progress(f"building the model ({args.num_layers} layers, hidden {args.hidden_size}, {layout.pp} pipeline "
             f"stage{'s' if layout.pp > 1 else ''}) and its {'Megatron' if args.agoq_disable else 'agoq'} layers")
    model, shape, spec = model_provider(args, layout, tokenizer, info, microbatches)
    report = policy_report(args, shape, layout, spec)  # the table of the model's plan (agoq.megatron.layer_plan)
    print_rank0(report)
    config: AgoqConfig = args.agoq_config
    plan = memory_report.plan_layout(config, layout, data_parallel=info.world_size // (layout.tp * layout.pp),
                                     micro_batch_size=args.micro_batch_size,
                                     global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                                     distributed_optimizer=args.use_distributed_optimizer,
                                     sequence_parallel=args.sequence_parallel)  # fmt: skip
    print_rank0(memory_report.predicted_report(config, shape, plan, policy_of(spec),
                                               cuda_graphs=args.cuda_graph_impl != "none"))
    peaks = memory_report.predicted_peaks(config, shape, plan, policy_of(spec))
    room = memory_report.headroom_line(peaks, info.device, environment.expandable_segments())
    if room is not None:
        print_rank0(room)
    if args.log_json and training.is_logging_rank():  # benchmarks/bench_pretrain.py puts it next to the measured peak
        with open(args.log_json, "a") as out:
            out.write(json.dumps({"predicted_memory": {
                "peak_gib": [p.peak / memory_report.GIB for p in peaks], "phase": [p.phase for p in peaks]}}) + "\n")
    _print_stage_first(storage_report(spec))
    params_dtype = torch.float32 if args.fp32 else torch.bfloat16
    progress("building the optimizer")
    optimizer = build_optimizer(args, model, params_dtype)
    scheduler = build_scheduler(args, optimizer, loop.lr_schedule)
    # never silent: what the flags ask of agoq is what was built, on every rank, before the first step
    check_built(config, model, optimizer, Expectation(args.attention_backend, ScheduleInfo(
        pp_size=layout.pp, vp_size=layout.vpp, num_microbatches=microbatches)), rank=info.rank, agree=any_rank_failed)
    if config.grads.reduce_in_bf16:
        print_rank0("gradients: bf16 main_grad, accumulated and reduced in bf16 (--grad-reduce-in-bf16)")
    if not config.optimizer.agoq:
        print_rank0("optimizer: Megatron Adam(W)")
    else:
        inner = getattr(optimizer, "optimizer", optimizer)
        fused = any(g.get("fused", False) for g in inner.param_groups)
        step = "fused Triton kernel, multi-tensor launches" if fused else "reference (PyTorch)"
        if config.optimizer.gradient_release:  # step_param: one launch per parameter, inside backward
            step = ("fused Triton kernel" if fused else "reference (PyTorch)") + \
                ", one parameter at a time inside backward (gradient release: no gradient buffer)"
        print_rank0(f"optimizer: agoq {config.optimizer.kind} | moments {config.optimizer.moments} | master "
                    f"{config.optimizer.master} | step: {step}")
    guard.check_space(predicted_checkpoint_bytes(config, shape, plan, fp32_params=args.fp32))
    record = run_record(config, shape=shape, tensor_parallel=layout.tp, pipeline_parallel=layout.pp,
                        virtual_pipeline=layout.vpp, distributed_optimizer=args.use_distributed_optimizer,
                        data={"seed": args.seed, "split": args.split, "data_path": args.data_path,
                              "global_batch_size": args.global_batch_size})
    if guard.load.folder is not None:
        progress(f"loading the checkpoint in {guard.load.folder}")
    start_state = _resume(args, record, report, (model, optimizer, scheduler), guard)
    # Megatron's valid iterator continues across evaluations; on resume it restarts where it was.
    consumed_valid = (start_state.iteration // args.eval_interval * args.eval_iters * args.global_batch_size
                      if args.eval_interval else 0)
    progress("building the datasets (train / valid / test splits and their sample indices, cached next to the "
             "data)")
    splits = [(*made, None)[:3] for made in (data_factory(start_state.consumed_samples, consumed_valid)
                                              for _ in range(layout.vpp or 1))]  # (train, valid[, test])
    iterators = [train for train, _, _ in splits]
    # valid: every --eval-interval iterations and at the end; test: once, when training completes (Megatron-LM)
    components_valid = [valid for _, valid, _ in splits] if args.eval_interval else None
    components_test = [test for _, _, test in splits] if args.eval_interval else None
    if components_test and None in components_test:  # --split gives the test split weight 0 (every rank alike)
        print_rank0(f"test split: weight 0 in --split {args.split}: no test evaluation when training completes")
        components_test = None
    components = Components(model, optimizer, scheduler, layout,
                            flops_per_iteration=training_flops_per_iteration(shape, args.global_batch_size),
                            policy_report=report, run_record=record)
    tensorboard = Loggers(open_tensorboard(args.tensorboard_dir, is_writer_rank=training.is_logging_rank()),
                          open_wandb(args, is_writer_rank=training.is_logging_rank()))
    tensorboard.log_policy_table(report)
    if start_state.iteration < args.train_iters:
        progress(f"setup done; iteration {start_state.iteration + 1} runs next (the first one also warms up: "
                 "kernel compilation, allocator, communicators)")
    manual_gc = ManualGC.from_args(args)
    if (gc_line := manual_gc.describe()) is not None:
        print_rank0(gc_line)
    try:
        with manual_gc.training():  # --manual-gc: Python's automatic collector off while training
            _train_loop(args, info, components, (iterators, components_valid, components_test), microbatches,
                        start_state,
                        tensorboard, stop, manual_gc, loop.schedule())
    finally:
        tensorboard.close()


def _resume(args, record: dict, policy: str, parts: tuple, guard: CheckpointGuard) -> ckpt_state.Progress:
    """--load (as resolved by ``guard``): the checkpoint's progress (iteration 0 without one), one line on the LR
    schedule in force and the data-order lines (resume.data_lines)."""
    model, optimizer, scheduler = parts
    target = guard.load
    if target.note:
        print_rank0(target.note)
    if target.folder is None:
        return ckpt_state.Progress(iteration=0, consumed_samples=0)
    requested = scheduler.state_dict()
    loaded = load_checkpoint(target.folder, model, optimizer, scheduler, record=record,
                             policy_report=policy, override_schedule=args.override_opt_param_scheduler,
                             iteration=target.iteration)
    if loaded is None:  # the tracker was there at start-up
        raise FileNotFoundError(f"--load {args.load}: its tracker file disappeared during start-up; another job "
                                "may be changing the folder")
    progress, extras = loaded
    guard.after_load(target.folder, progress.iteration)
    from agoq.megatron.ckpt.hf_checkpoint import carry_hf_identity

    carry_hf_identity(extras, record)  # a converted checkpoint's HF token ids / generation config, for the export
    print_rank0(f"resumed from {target.folder} at iteration {progress.iteration} "
                f"({progress.consumed_samples} samples consumed)")
    print_rank0(schedule_line(scheduler.state_dict(), requested, override=args.override_opt_param_scheduler,
                              global_batch_size=args.global_batch_size, train_iters=args.train_iters))
    if not extras.get(ckpt_state.WEIGHTS_ONLY_KEY):  # a converted checkpoint starts the data fresh
        for line in data_lines(extras.get(RECORD_KEY), record, progress.iteration):
            print_rank0(line)
    return progress


def _log_iteration(args, info, parts: Components, result, iteration, consumed, skipped, tokens_per_step,
                   tensorboard, eta_s: float):
    if not training.is_logging_rank():
        return
    lr = parts.scheduler.get_lr(parts.optimizer.param_groups[0])
    memory = runtime.memory_reading(info.device)
    tflops = tflops_per_gpu(parts.flops_per_iteration, result.seconds, info.world_size)
    print(training.format_iteration_line(
        iteration, args.train_iters, result, lr=lr, consumed_samples=consumed, tokens_per_step=tokens_per_step,
        skipped=skipped,
        memory=f"TFLOP/s/GPU: {tflops:.1f} | " + runtime.format_memory(memory) + f" | ETA {_duration(eta_s)}",
    ), flush=True)
    record = {"iteration": iteration, "lm_loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
              "consumed_samples": consumed, "skipped_iterations": skipped, "step_seconds": result.seconds,
              "tokens_per_second": tokens_per_step / result.seconds, "tflops_per_gpu": tflops,
              "host_steal_cpu_seconds": result.steal_seconds, "host_enqueue_seconds": result.enqueue_seconds,
              "host_threads": result.threads, "gc_collections": result.gc_collections,
              "gc_seconds": result.gc_seconds, **memory}
    if args.log_fc2_amax:  # the FP8 fc2-input outlier proxy (this rank's FP8 layers: the last pipeline stage's)
        record.update(fc2_input_amax(parts.model))
    tensorboard.log_iteration(record)
    if args.log_json:
        with open(args.log_json, "a") as out:
            out.write(json.dumps(record) + "\n")


def _train_loop(args, info, parts: Components, data, microbatches: int, progress, tensorboard, stop,
                manual_gc: ManualGC, forward_backward_func: Callable) -> None:
    """The training iterations; ``manual_gc``: --manual-gc's collections (the collector is off around this call);
    ``forward_backward_func``: Megatron's pipeline schedule for the run's layout."""
    iterators, valid_iterators, test_iterators = data
    runner = training.StepRunner(
        model_chunks=parts.model, optimizer=parts.optimizer, scheduler=parts.scheduler, device=info.device,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size, num_microbatches=microbatches,
        forward_backward_func=forward_backward_func,
    )
    iteration, consumed, skipped = progress.iteration, progress.consumed_samples, progress.skipped_iterations
    tokens_per_step = args.global_batch_size * args.seq_length
    interval = training.IntervalMeter()  # the logged line averages the iterations since the last one (Megatron-LM)
    start = time.perf_counter()
    while iteration < args.train_iters:
        runner.poison["now"] = iteration + 1 in (args.debug_nonfinite_at_iteration or ())
        runner.iteration = iteration + 1
        result = runner.run(iterators)
        iteration += 1
        consumed += args.global_batch_size
        interval.add(result)
        if not result.update_successful:
            skipped += 1
            # the logging rank, as the iteration line: two processes writing one pipe interleave their lines
            print_last(f"iteration {iteration}: non-finite loss or gradients on some rank: update skipped "
                       f"({skipped} skipped so far)")
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            eta_s = (time.perf_counter() - start) / (iteration - progress.iteration) * (args.train_iters - iteration)
            _log_iteration(args, info, parts, interval.take(result), iteration, consumed, skipped, tokens_per_step,
                           tensorboard, eta_s)
        manual_gc.after_step(iteration)
        if valid_iterators and (iteration % args.eval_interval == 0 or iteration == args.train_iters):
            _evaluate(args, runner, valid_iterators, iteration, "validation", manual_gc, tensorboard)
        if iteration == progress.iteration + 1 and args.cuda_graph_impl != "none":
            _report_graphs(args, parts.model)
        if iteration in (progress.iteration + 1, args.train_iters):
            breakdown = memory_report.static_breakdown_gib(parts.model, parts.optimizer)
            print_rank0(memory_report.measured_report(info.device, iteration, breakdown))
            if args.log_json and training.is_logging_rank():
                with open(args.log_json, "a") as out:
                    reading = dict(runtime.memory_reading(info.device), **runtime.outside_allocator_gib(info.device),
                                   **breakdown)
                    out.write(json.dumps({"iteration": iteration, "memory_breakdown": reading}) + "\n")
        state = ckpt_state.Progress(iteration, consumed, skipped)
        stopping = stop.agreed(info.device) or training.exit_interval_reached(iteration, args.exit_interval)
        periodic = args.save_interval and iteration % args.save_interval == 0
        if args.save and (periodic or stopping or iteration == args.train_iters):
            with runner.param_gather.synced():  # --overlap-param-gather: save the updated weights, not the stale
                path = save_checkpoint(args.save, state, parts.model, parts.optimizer, parts.scheduler,
                                       extra={"policy_report": parts.policy_report, RECORD_KEY: parts.run_record})
            print_rank0(f"saved checkpoint {path}")
        if stopping:
            print_rank0(f"stopping at iteration {iteration}"
                        + (f" on the {signal_name(stop.received)}" if stop.received else " (--exit-interval)"))
            break
    if iteration == args.train_iters:  # training complete (not stopped early): Megatron-LM's end-of-training evals
        if valid_iterators and iteration == progress.iteration:  # resumed at the end: no step ran, none evaluated
            _evaluate(args, runner, valid_iterators, iteration, "validation", manual_gc, tensorboard)
        if test_iterators:  # the test split once
            _evaluate(args, runner, test_iterators, iteration, "test", manual_gc, tensorboard)
    runner.param_gather.pause()  # the weights in memory are the updated ones when training ends (Megatron-LM)
    print_rank0(done_line(progress.iteration, iteration, args.train_iters, time.perf_counter() - start))


def _evaluate(args, runner: training.StepRunner, iterators: list, iteration: int, split: str, manual_gc: ManualGC,
              tensorboard) -> None:
    """--eval-iters global batches of ``split`` ("validation" or "test"): the loss line, tensorboard and
    --log-json (key ``<split>_lm_loss``)."""
    with manual_gc.evaluation():
        loss = runner.evaluate(iterators, args.eval_iters)
    if training.is_logging_rank():
        print(f"{split} at iteration {iteration} | lm loss: {loss:.6f} | lm loss PPL: {math.exp(min(loss, 50)):.3f}",
              flush=True)
        tensorboard.log_iteration({"iteration": iteration, f"{split}_lm_loss": loss})
        if args.log_json:
            with open(args.log_json, "a") as out:
                out.write(json.dumps({"iteration": iteration, f"{split}_lm_loss": loss}) + "\n")


def _report_graphs(args, model: list) -> None:
    """After the first iteration under --cuda-graph-impl local: how many layer graphs Megatron captured on this rank
    (every later call of those layers replays them)."""
    from agoq.megatron.graphs import captured_graphs

    found = captured_graphs(model)
    _print_stage_first(f"CUDA graphs ({args.cuda_graph_impl}): {found['captured']} of {found['runners']} layer graph "
                       "runners captured (forward + backward) in iteration 1, replayed from iteration 2 on")
    if args.log_json and training.is_logging_rank():
        with open(args.log_json, "a") as out:
            out.write(json.dumps({"cuda_graphs": found}) + "\n")


def signal_name(signum: int) -> str:
    """How a stop signal is reported: "save-and-exit signal (SIGUSR1)", not "signal 10"."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    return f"save-and-exit signal ({name})" if signum in StopSignal.SIGNALS else name


def done_line(first_iteration: int, last_iteration: int, train_iters: int, seconds: float) -> str:
    """The closing line: iterations this run did (a resumed run started at ``first_iteration``) and the total."""
    ran = last_iteration - first_iteration
    text = f"done: {ran} iteration{'s' if ran != 1 else ''} in {seconds:.1f} s"
    if first_iteration:
        text += f" (resumed at iteration {first_iteration}; now at {last_iteration} of {train_iters})"
    elif last_iteration < train_iters:
        text += f" (at {last_iteration} of {train_iters})"
    return text
