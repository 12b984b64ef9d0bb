"""One-GPU stage proxy: the FIRST pipeline stage of a PP layout run alone on one GPU at full width, its peak memory per
phase beside the planner's prediction for the same stage (issue 47: show a layout fits before its GPUs are lent).

What runs is stage 0 of the layout the trainer flags describe (``scripts/pretrain_llama.py``'s own flags and
``--config`` / ``--agoq-preset`` files, parsed by agoq.train.args), built with the trainer's builders: the
TransformerConfig (agoq.megatron.model.llama_transformer_config), agoq's layer spec and its plan (policy resolved per
layer and pipeline stage), DDP or agoq's 8-bit gradient buffer (wrap_ddp / wrap_ddp_agoq, as the script's
model_provider picks), the gradient hooks (agoq.train.training.configure_grad_hooks), Megatron's or agoq's optimizer
and the LR schedule (agoq.train.megatron_setup.build_optimizer / build_scheduler), the trainer's forward step
(make_forward_step). Each iteration is what the trainer's StepRunner does on stage 0: zero the gradient buffers,
Megatron's 1F1B schedule over the micro-batches (warm-up P - 1 forwards whose graphs stay alive, then 1F1B, then the
cool-down backwards: at most min(P, micro-batches) in flight), the gradient finalisation, the optimizer step, the LR
step.

How one rank stands in for stage 0 of P (the narrowest honest way; agoq.megatron.stage_proxy's docstring has the
detail): Megatron's ``parallel_state`` is a world of one (TP = PP = DP = 1; it cannot hold PP = P on one rank), so
DDP, the optimizer and the reductions are those of a DP = 1 run. The TransformerConfig says PP = P, and the model
chunk is built with ``pg_collection.pp`` = a one-rank stand-in reporting rank 0 of P: Megatron builds layers 1..L/P
(global numbers, its own offset arithmetic) with the embedding and without final norm / output layer
(``pre_process=True, post_process=False``), and agoq's plan resolves every layer's policy row as on stage 0 of the
real run. Megatron's 1F1B schedule runs with a stand-in ``p2p_communicator``: nothing arrives forward, sends are
dropped, each backward receives a synthetic output gradient ([s, b, h], ``pipeline_dtype``, small normal values).

Not represented, refused with the reason: TP > 1, VPP, DP > 1 (``--data-parallel N``, the real run's DP size, which
the trainer reads from the world size: the distributed optimizer's 1/DP shards and the reduction's peers would be
emulated, not built; proxy the DP = 1 layout of the same TP x PP, whose unsharded optimizer is an upper bound),
sequence parallelism, tied embeddings. What stage 0 of a real run has that the proxy does not: NCCL's own buffers
(outside the allocator) and the data loader's prefetch (host memory).

The planner is asked for exactly the same run: agoq.train.memory_report.predicted_peaks (the trainer's start-up
prediction; agoq.plan.peak) for the layout (TP = 1, PP = P, DP = 1), micro-batch, global batch, sequence, optimizer,
gradients and policy of the flags; its stage-0 row is reported beside the measurement.

    python benchmarks/stage_proxy.py --out stage0.json --case NAME -- --config configs/model/llama3-70b.yaml \
        --agoq-preset agoq-full --seq-length 4096 --global-batch-size 16 --pipeline-model-parallel-size 8

Several ``--case NAME -- FLAGS`` groups may follow each other (``--case a -- ... --case b -- ...``); each runs in a
fresh process (``--one`` is the child's flag), one after the other, and the report lists them in order. Per case:
``measured_gib`` (max_memory_allocated per phase: build, forward, backward, optimizer step; their max ``peak``, over
``--iterations`` iterations), ``predicted`` (the planner's stage-0 peak and terms), ``error`` (predicted / measured
- 1), the saved bytes agoq's layers held at most (``saved_peak_gib``), step seconds, and the run's environment
(device, versions, commit). ``--microbatches N`` runs N micro-batches per iteration (default: min(P, the run's
micro-batches), the most 1F1B keeps in flight; the policy is resolved for the run's own count).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

GIB = 2**30
PHASES = ("build", "forward", "backward", "optimizer step")


def split_cases(argv: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(own flags, [(case name, trainer flags)]): ``--case NAME -- FLAGS`` groups after the script's own flags."""
    own, cases, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--case":
            if i + 2 >= len(argv) or argv[i + 2] != "--":
                raise SystemExit("stage_proxy.py: --case NAME must be followed by -- and the trainer's flags")
            name, j = argv[i + 1], i + 3
            while j < len(argv) and argv[j] != "--case":
                j += 1
            cases.append((name, argv[i + 3:j]))
            i = j
        else:
            own.append(argv[i])
            i += 1
    return own, cases


def parse_trainer(flags: list[str]):
    """The trainer's args (agoq.train.args.parse_args: flags, --config, --agoq-preset, AgoqConfig)."""
    from agoq.train.args import parse_args

    return parse_args(flags)


class PhaseMeter:
    """Peak ``max_memory_allocated`` per phase on CUDA (the peak counter reset at each phase change); on the CPU it
    records the order of phases only (tests)."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.current, self.peaks, self.order = None, {}, []

    def enter(self, phase: str) -> None:
        if phase == self.current:
            return
        self._close()
        self.current = phase
        self.order.append(phase)

    def _close(self) -> None:
        if self.current is None:
            return
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            peak = self.torch.cuda.max_memory_allocated(self.device)
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        self._close()
        self.current = None


def build_proxy(args, device, data_parallel: int = 1):
    """Stage 0 of the flags' layout on this one-rank world: (parts dict). ``data_parallel``: the real run's DP size
    (the trainer takes it from the world size; here ``--data-parallel``). Raises ValueError for what the proxy cannot
    represent (agoq.megatron.stage_proxy.check_proxy_layout: DP > 1 among them)."""
    import torch

    from agoq.data.tokenizer import padded_vocab_size
    from agoq.megatron import model as mmodel
    from agoq.megatron import stage_proxy
    from agoq.megatron.grads.ddp import wrap_ddp_agoq
    from agoq.megatron.optim.optimizer import shard_alignment_for
    from agoq.ops.saved_act import SavePaths
    from agoq.policy import ScheduleInfo
    from agoq.train.megatron_setup import build_optimizer, build_scheduler, ddp_config
    from agoq.train.preflight import microbatch_count
    from agoq.train.training import configure_grad_hooks

    agoq = args.agoq_config
    layout = mmodel.ParallelLayout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                                   vpp=args.vpp)
    stage_proxy.check_proxy_layout(layout, data_parallel=data_parallel, sequence_parallel=args.sequence_parallel,
                                   tied_embeddings=not args.untie_embeddings_and_output_weights)
    if agoq.optimizer.gradient_release:
        raise ValueError("stage proxy: --agoq-gradient-release needs PP = 1 (the trainer refuses it with PP > 1)")
    if not args.vocab_size:
        raise ValueError("stage proxy: give --vocab-size (or vocab_size in the --config file): the embedding's rows "
                         "(the proxy reads no tokenizer)")
    world = layout.tp * layout.pp * data_parallel  # the real run's world size
    microbatches = microbatch_count(args.global_batch_size, args.micro_batch_size, layout.tp, layout.pp, layout.vpp,
                                    world)
    shape = mmodel.LlamaShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        rotary_base=args.rotary_base, norm_epsilon=args.norm_epsilon, init_method_std=args.init_method_std,
        vocab_size=padded_vocab_size(args.vocab_size, layout.tp, args.make_vocab_size_divisible_by),
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        share_embeddings_and_output_weights=False, unpadded_vocab_size=args.vocab_size)
    layout.check(shape, world)
    params_dtype = torch.float32 if args.fp32 else torch.bfloat16
    config = mmodel.llama_transformer_config(
        shape, layout, params_dtype=params_dtype, use_cpu_initialization=device.type == "cpu",
        recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
        selective_recompute=args.recompute_granularity == "selective",
        cuda_graph_impl=args.cuda_graph_impl, cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        rope_fusion=agoq.rope_fused(on_cuda=device.type == "cuda"), sequence_parallel=args.sequence_parallel)
    schedule = ScheduleInfo(pp_size=layout.pp, vp_size=layout.vpp, num_microbatches=microbatches)
    compute = agoq.fp8 if agoq.enabled else None
    if compute is not None:
        from agoq.megatron.compute import check_compute

        check_compute(compute, device, num_layers=shape.num_layers, hidden=shape.hidden_size,
                      ffn=shape.ffn_hidden_size, heads=shape.num_attention_heads, groups=shape.num_query_groups,
                      tp=layout.tp, tokens_per_microbatch=args.seq_length * args.micro_batch_size)
    spec = mmodel.agoq_layer_spec(args.attention_backend, policy=agoq.policy.spec, schedule=schedule,
                                  compute=compute, save_paths=SavePaths(fuse_swiglu_fp8=agoq.kernels.fuse_swiglu_fp8))
    groups = stage_proxy.stage_process_groups(layout.pp)
    chunks = stage_proxy.build_first_stage(shape, config, spec, groups)
    if not agoq.grads.quantized:
        model = mmodel.wrap_ddp(chunks, config, ddp_config(args, params_dtype), device,
                                param_alignment=shard_alignment_for(agoq.optimizer, args.use_distributed_optimizer))
    else:
        model = wrap_ddp_agoq(chunks, config, ddp_config(args, params_dtype), device, agoq.grads)
    configure_grad_hooks(model, config)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # as the entry script does

    optimizer = build_optimizer(args, model, params_dtype)
    scheduler = build_scheduler(args, optimizer, OptimizerParamScheduler)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "spec": spec, "groups": groups,
            "shape": shape, "layout": layout, "config": config, "microbatches": microbatches,
            "params_dtype": params_dtype}


def synthetic_batches(shape, micro_batch: int, count: int, seed: int, token_limit: int) -> list[dict]:
    """``count`` micro-batches of random token ids below ``token_limit`` (the trainer's batch dict)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, token_limit, (micro_batch, shape.seq_length + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(micro_batch, shape.seq_length),
                    "position_ids": torch.arange(shape.seq_length).expand(micro_batch, -1)})
    return out


def run_iteration(parts: dict, args, device, meter: PhaseMeter, run_microbatches: int, seed: int) -> dict:
    """One iteration of stage 0 as the trainer's StepRunner runs it, through Megatron's 1F1B schedule."""
    import torch

    from agoq.megatron import stage_proxy
    from agoq.ops.fp8_weight_cache import fp8_weights_changed
    from agoq.train.training import make_forward_step

    model, optimizer, scheduler, shape = parts["model"], parts["optimizer"], parts["scheduler"], parts["shape"]
    step = make_forward_step(device)
    forwards = 0

    def forward_step(data, chunk):
        nonlocal forwards
        meter.enter("forward")
        forwards += 1
        return step(data, chunk)

    neighbours = stage_proxy.FirstStageNeighbours(parts["config"], parts["groups"], device,
                                                  on_recv_backward=lambda: meter.enter("backward"))
    batches = synthetic_batches(shape, args.micro_batch_size, run_microbatches, seed,
                                min(args.vocab_size, shape.vocab_size))
    start = time.perf_counter()
    fp8_weights_changed()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    stage_proxy.run_first_stage_schedule(model, forward_step, iter(batches), neighbours, parts["groups"],
                                         num_microbatches=run_microbatches, seq_length=shape.seq_length,
                                         micro_batch_size=args.micro_batch_size)
    meter.enter("optimizer step")
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    meter.stop()
    return {"seconds": time.perf_counter() - start, "forwards": forwards, "output_grads": neighbours.received,
            "update_successful": bool(update_successful),
            "grad_norm": None if grad_norm is None else float(grad_norm)}


def prediction(args, parts: dict) -> dict:
    """The planner's stage-0 prediction for the same run (the trainer's start-up prediction, agoq.plan.peak)."""
    from agoq.megatron.activations import policy_of
    from agoq.plan.capacity import terms_of
    from agoq.train import memory_report

    config, layout = args.agoq_config, parts["layout"]
    plan = memory_report.plan_layout(config, layout, data_parallel=1, micro_batch_size=args.micro_batch_size,
                                     global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                                     distributed_optimizer=args.use_distributed_optimizer,
                                     sequence_parallel=args.sequence_parallel)
    peaks = memory_report.predicted_peaks(config, parts["shape"], plan, policy_of(parts["spec"]))
    stage0 = peaks[0]
    recipe = memory_report.recipe_from_config(config)
    return {"peak_gib": stage0.peak / GIB, "phase": stage0.phase,
            "terms_gib": {k: v / GIB for k, v in terms_of(stage0, recipe).items()},
            "weights_gib": stage0.weights / GIB, "grads_gib": stage0.grads / GIB,
            "optimizer_gib": stage0.optimizer / GIB, "activations_gib": stage0.held / GIB,
            "all_stages_gib": [p.peak / GIB for p in peaks]}


def cap_allocator(device, gpu_memory_gib: float | None) -> dict | None:
    """Make this GPU stand in for a smaller one of ``gpu_memory_gib`` GiB (as torch reports its total memory): cap
    PyTorch's caching allocator, with ``torch.cuda.set_per_process_memory_fraction``, at what the smaller GPU leaves
    it (its memory less agoq.plan.headroom.OUTSIDE_ALLOCATOR_GIB, the CUDA context measured on an H100), so that an
    allocation the smaller GPU could not reserve fails here too; with expandable segments as with the default
    allocator, the cap is checked where the allocator asks the driver for memory. The record says what was capped."""
    if gpu_memory_gib is None:
        return None
    import torch

    from agoq.plan.headroom import OUTSIDE_ALLOCATOR_GIB

    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-gib {gpu_memory_gib}: emulates a smaller GPU on a larger one; this device "
                         f"is {device.type}, not a GPU")
    total = torch.cuda.get_device_properties(device).total_memory
    cap = (gpu_memory_gib - OUTSIDE_ALLOCATOR_GIB) * GIB
    if gpu_memory_gib * GIB > total:
        raise ValueError(f"--gpu-memory-gib {gpu_memory_gib}: emulates a smaller GPU on a larger one; this GPU has "
                         f"{total / GIB:.2f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return {"emulated_gpu_gib": gpu_memory_gib, "allocator_cap_gib": cap / GIB, "this_gpu_gib": total / GIB,
            "outside_allocator_gib": OUTSIDE_ALLOCATOR_GIB}


def run_case(name: str, flags: list[str], iterations: int, microbatches: int | None, data_parallel: int = 1,
             gpu_memory_gib: float | None = None) -> dict:
    """Build and run one case in this process; the report's record of it."""
    import torch

    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    args = parse_trainer(flags)
    device = runtime.choose_device(args.agoq_config.device, 0)
    handle = install(args.agoq_config)
    runtime.init_distributed(device, runtime.SINGLE_PROCESS)
    runtime.init_model_parallel(ParallelLayout(), args.seed, device)
    meter = PhaseMeter(device)
    try:
        capped = cap_allocator(device, gpu_memory_gib)
        meter.enter("build")
        parts = build_proxy(args, device, data_parallel)
        meter.stop()
        inflight = min(parts["layout"].pp, parts["microbatches"])
        run_mb = microbatches or inflight
        if run_mb < inflight:
            raise ValueError(f"--microbatches {run_mb}: stage 0 keeps {inflight} in flight in the real run; run at "
                             "least that many")
        n_params = sum(p.numel() for chunk in parts["model"] for p in chunk.parameters())
        storage = parts["spec"].params.get("agoq_plan") if hasattr(parts["spec"], "params") else None
        record = {"name": name, "flags": flags, "pipeline_stages": parts["layout"].pp,
                  "layers_on_stage": parts["shape"].num_layers // parts["layout"].pp,
                  "microbatches_per_step": parts["microbatches"], "microbatches_run": run_mb,
                  "in_flight": inflight, "parameters_on_stage": n_params, "predicted": prediction(args, parts),
                  "iterations": []}
        if capped:
            record["emulated"] = capped
        try:
            for i in range(iterations):
                record["iterations"].append(run_iteration(parts, args, device, meter, run_mb, seed=args.seed + i))
        except torch.OutOfMemoryError as exc:  # the answer too: which phase, and how far it got
            record.update(failed="out of memory", failed_in_phase=meter.current, error_text=str(exc)[:1500])
            meter.peaks[meter.current or "?"] = torch.cuda.max_memory_allocated(device)
        record["saved_peak_gib"] = None if storage is None else storage.counter.peak / GIB
        if device.type == "cuda":
            measured = {phase: meter.peaks[phase] / GIB for phase in meter.peaks}
            record["measured_gib"] = {**measured, "peak": max(measured.values())}
            record["error"] = record["predicted"]["peak_gib"] / record["measured_gib"]["peak"] - 1
            record["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        return record
    finally:
        runtime.shutdown()
        handle.uninstall()


def environment() -> dict:
    import platform

    import torch

    from agoq.testing.procs import source_commit

    info = {"python": platform.python_version(), "torch": torch.__version__, "agoq_commit": source_commit()}
    try:
        import triton

        from agoq.megatron.compat import installed_mcore_version

        info.update(megatron_core=installed_mcore_version(), triton=triton.__version__)
    except (ImportError, RuntimeError) as exc:
        info["import_error"] = str(exc)
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if torch.cuda.is_available():
        info["device_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
    return info


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, cases = split_cases(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON report")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches run per iteration (default: the most 1F1B keeps in flight on stage 0)")
    parser.add_argument("--data-parallel", type=int, default=1,
                        help="the real run's data-parallel size (only 1 is proxied; larger is refused with the reason)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="stand in for a smaller GPU of this total memory (torch's figure; an H100 80GB: 79.18): "
                             "PyTorch's allocator is capped at it less the measured CUDA context")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: run the one case here
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case")
    opts = parser.parse_args(own)
    if not cases:
        parser.error("give at least one --case NAME -- TRAINER FLAGS")
    if opts.one:
        name, flags = cases[0]
        try:
            record = run_case(name, flags, opts.iterations, opts.microbatches, opts.data_parallel,
                              opts.gpu_memory_gib)
        except ValueError as exc:
            record = {"name": name, "flags": flags, "refused": str(exc)}
        except torch_oom() as exc:  # while building (the iterations' own is recorded by run_case)
            record = {"name": name, "flags": flags, "failed": "out of memory while building",
                      "error_text": str(exc)[:2000]}
        Path(opts.out).write_text(json.dumps(record, indent=1) + "\n")
        return 0 if "refused" not in record and "failed" not in record else 1
    report = {"benchmark": "stage_proxy", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/stage_proxy.py", *argv]), "environment": environment(),
              "cases": []}
    rc = 0
    for name, flags in cases:
        child_out = Path(opts.out).with_suffix(f".{len(report['cases'])}.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--out", str(child_out),
               "--iterations", str(opts.iterations), "--data-parallel", str(opts.data_parallel)]
        cmd += ["--microbatches", str(opts.microbatches)] if opts.microbatches else []
        cmd += ["--gpu-memory-gib", str(opts.gpu_memory_gib)] if opts.gpu_memory_gib else []
        cmd += ["--case", name, "--", *flags]
        print(f"stage_proxy: {dt.datetime.now(dt.UTC):%H:%M:%S} {name}", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(cmd, timeout=opts.timeout, capture_output=True, text=True)
            record = json.loads(child_out.read_text()) if child_out.is_file() else {
                "name": name, "flags": flags, "failed": f"exit {done.returncode}"}
            if done.returncode:
                record["output_tail"] = (done.stdout + done.stderr)[-4000:]
                rc = 1
        except subprocess.TimeoutExpired:
            record, rc = {"name": name, "flags": flags, "failed": f"timed out after {opts.timeout:.0f} s"}, 1
        child_out.unlink(missing_ok=True)
        report["cases"].append(record)
        print(json.dumps({k: record.get(k) for k in ("name", "measured_gib", "error", "refused", "failed")}
                         | {"predicted_gib": record.get("predicted", {}).get("peak_gib")}), flush=True)
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(report, indent=1) + "\n")
    return rc


def torch_oom():
    import torch

    return torch.OutOfMemoryError


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
