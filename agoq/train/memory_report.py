"""Start-up memory report: the planner's prediction per pipeline stage, then what each stage measured.

Prediction: ``agoq.plan.peak.predict_peaks`` per stage, for this run's optimizer and gradient format
(both named in the header, with the gradient bytes per parameter per rank): the held bytes (weights,
gradients, optimizer states, activations of the in-flight micro-batches from ``agoq.plan.plan_stages``)
and the predicted ``max_memory_allocated`` (backward / loss / optimizer-step temporaries on top; its
accuracy against every committed measurement: docs/benchmarks/planner.md). Measured:
``torch.cuda.max_memory_allocated`` on the first tensor- and data-parallel rank of each stage (RSS on
the CPU, not comparable).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from agoq.config import AgoqConfig
from agoq.megatron import runtime
from agoq.megatron.install import runs_on_cpu
from agoq.plan.headroom import OUTSIDE_ALLOCATOR_GIB, headroom_note
from agoq.plan.memory import GIB, Layout, plan_stages
from agoq.plan.peak import Recipe, StagePeak, format_peaks, grad_bytes_per_param, predict_peaks
from agoq.plan.recipe import recipe_of
from agoq.plan.shape import ModelShape
from agoq.plan.storage import sequence_parallel_note


def plan_layout(config: AgoqConfig, layout, *, data_parallel: int, micro_batch_size: int, global_batch_size: int,
                seq_length: int, distributed_optimizer: bool, sequence_parallel: bool = False) -> Layout:
    """The planner's Layout of a run: ``layout`` (an agoq.megatron.model.ParallelLayout) and Megatron's batch
    settings from the trainer; the gradient buffer's bytes per parameter from ``config.grads`` / ``optimizer``:
    fp32 main_grad, bf16 with --grad-reduce-in-bf16, none with --agoq-gradient-release (agoq.megatron.optim.release)."""
    grad_bytes = 0 if config.optimizer.gradient_release else 2 if config.grads.reduce_in_bf16 else 4
    return Layout(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, dp=data_parallel, mbs=micro_batch_size,
                  gbs=global_batch_size, seq=seq_length, distributed_optimizer=distributed_optimizer,
                  grad_bytes=grad_bytes, sequence_parallel=sequence_parallel)


def _plan_inputs(shape, policy):
    if policy is None:
        from agoq.policy import load_policy

        policy = load_policy(_bf16_policy_path())
    model = ModelShape.of(shape)
    return model, policy


def recipe_from_config(config: AgoqConfig) -> Recipe:
    """The planner's Recipe of a run's config (agoq.plan.recipe.recipe_of: the same for the planner's CLI), with
    the plain SwiGLU + FP8 fc2 fusion of ``config.kernels`` (the trainer's AGOQ_FP8_SWIGLU_FUSION,
    agoq.train.environment), which changes what plain FP8 layers hold (agoq.plan.fp8)."""
    return dataclasses.replace(recipe_of(config, on_cuda=not runs_on_cpu(config)),
                               fuse_plain_swiglu_fp8=config.kernels.fuse_swiglu_fp8)


def predicted_peaks(config: AgoqConfig, shape, plan: Layout, policy) -> list[StagePeak]:
    model, policy = _plan_inputs(shape, policy)
    return predict_peaks(model, plan, policy, recipe_from_config(config))


def headroom_line(peaks: list[StagePeak], device: torch.device, expandable: bool) -> str | None:
    """agoq.plan.headroom's start-up warning for the worst predicted stage against this rank's GPU (``expandable``:
    PYTORCH_CUDA_ALLOC_CONF has expandable segments); None on the CPU or with room to spare."""
    if device.type != "cuda" or not peaks:
        return None
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    return headroom_note(max(p.peak for p in peaks), gpu_bytes, expandable)


def optimizer_name(config: AgoqConfig, recipe: Recipe, dp: int, distributed_optimizer: bool) -> str:
    """The optimizer in use, as the report names it."""
    if recipe.optimizer == "torch":
        name = "Megatron's Adam (fp32 master + moments)"
    else:
        kind = {"adamw": "AdamW", "lion": "Lion", "sgd": "SGD"}.get(config.optimizer.kind, "optimizer")
        name = f"agoq {kind} ({','.join(recipe.moments)} states, master {recipe.master})"
    if distributed_optimizer:
        name += f", distributed over {dp} data-parallel rank{'s' if dp > 1 else ''}"
    return name


def gradient_name(config: AgoqConfig, recipe: Recipe, plan: Layout) -> str:
    """The gradient format in use and its bytes per parameter per rank (agoq.plan.peak.grad_bytes_per_param)."""
    held, after = grad_bytes_per_param(recipe, plan)
    if recipe.gradient_release:
        return "no gradient buffer (gradient release)"
    if recipe.grads is not None:
        text = f"{recipe.grads} gradients (8-bit store{' + bf16 error feedback' if recipe.grad_error_feedback else ''}"
    elif config.grads.quantized:
        text = f"{'bf16' if plan.grad_bytes == 2 else 'fp32'} gradients ({config.grads.format} reduction only"
    else:
        text = f"{'bf16' if plan.grad_bytes == 2 else 'fp32'} gradients (Megatron's buffer"
    text += f", {held:.3f} B/param held"
    if after:
        text += f" + {after:.3f} B/param fp32 from the reduction to zero_grad"
    return text + ")"


# Megatron's local CUDA graphs without Transformer Engine keep their static buffers and each layer's activations in
# the graph pool the capture reserved (a replay allocates nothing). Measured on H100, 2026-11-27, ~1B seq 4096 mbs 1
# (benchmarks/results/pretrain_graphs*.json): reserved bytes under graphs +2.1 to +7.1 GiB over eager (agoq 22.66 vs
# baseline 27.48 GiB at PP=1; 17.05 vs 18.98 on PP=2's last stage), while max_memory_allocated stays near the eager
# figures. The planner predicts eager runs only.
GRAPHS_NOTE = ("  note: --cuda-graph-impl local: the peaks above are for eager steps; under Megatron's CUDA graphs "
               "(no Transformer Engine) the graph pool holds the activations and static buffers, which agoq.plan does "
               "not model: measured reserved memory 2-7 GiB above eager at ~1B (docs/benchmarks/activations.md)")


def predicted_report(config: AgoqConfig, shape, plan: Layout, policy, cuda_graphs: bool = False) -> str:
    """Per stage: held GiB by component for this run's optimizer and gradients, and the predicted peak
    (rank 0 prints it); ``cuda_graphs``: Megatron's CUDA graphs are on (a note: their pool is not modelled)."""
    recipe = recipe_from_config(config)
    model, policy = _plan_inputs(shape, policy)
    stages = plan_stages(model, plan, policy, fp8=recipe.fp8, plain_swiglu_fusion=recipe.fuse_plain_swiglu_fp8,
                         core_attn_recompute=recipe.selective_recompute,
                         rope_fused=recipe.rope_fused)
    peaks = predict_peaks(model, plan, policy, recipe)
    lines = [f"predicted memory per GPU (agoq.plan; held bytes with "
             f"{optimizer_name(config, recipe, plan.dp, plan.distributed_optimizer)} "
             f"and {gradient_name(config, recipe, plan)}):"]
    for s, p in zip(stages, peaks, strict=True):
        total = p.weights + p.grads + p.optimizer + p.held
        lines.append(
            f"  stage {s.pp_rank}: weights {p.weights / GIB:.2f} | grads {p.grads / GIB:.2f} | optimizer "
            f"{p.optimizer / GIB:.2f} | activations {p.held / GIB:.2f} (in-flight {s.inflight}) | "
            f"total {total / GIB:.2f} GiB"
        )
    lines.append("predicted peak per GPU (agoq.plan.peak, this run's optimizer / gradients / recompute; "
                 "accuracy: docs/benchmarks/planner.md):")
    lines.append(format_peaks(peaks))
    if config.activations.recompute and config.activations.recompute_num_layers != 1:
        lines.append("  note: the peak model assumes --recompute-num-layers 1")
    if cuda_graphs:
        lines.append(GRAPHS_NOTE)
    if plan.sequence_parallel:
        lines.append("  note: " + sequence_parallel_note(plan.tp))
    return "\n".join(lines)


def _bf16_policy_path():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "configs" / "policy" / "bf16.yaml"


# How deep the optimizer object graph is walked for state tensors (Megatron wrapper -> torch optimizer ->
# state dict -> per-param dict -> tensor is depth 5; chained optimizers add one level).
OPTIMIZER_WALK_DEPTH = 7


def _tensors(obj, depth: int, seen_ids: set[int]):
    """Every tensor reachable from obj through attributes, dicts, lists and tuples (cycles and modules cut)."""
    if depth < 0 or id(obj) in seen_ids or isinstance(obj, (str, bytes, int, float, torch.nn.Module)):
        return
    seen_ids.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("megatron", "agoq", "torch"):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from _tensors(child, depth - 1, seen_ids)


def _add_unique(tensors, counted: dict[int, int]) -> int:
    """Bytes of the storages not yet in ``counted`` (data_ptr -> nbytes); views of one buffer count once."""
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in counted:
            counted[storage.data_ptr()] = storage.nbytes()
            total += storage.nbytes()
    return total


def _optimizer_param_grads(optimizer) -> list:
    """Gradients the optimizer's own parameters hold (``.grad`` / ``.decoupled_grad``: the distributed
    optimizer's fp32 shard gradients), so they count as gradients, not optimizer states."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            for p in group["params"]:
                out += [p.grad, getattr(p, "decoupled_grad", None)]
    return out


def static_breakdown_gib(model_chunks, optimizer) -> dict[str, float]:
    """Bytes held by this rank, by role, from the live tensors (exact accounting, no model): weights (the
    model's parameter storages), grads (main_grad buffers, agoq's quantized gradient buffers, the optimizer
    params' .grad / .decoupled_grad, e.g. the distributed optimizer's fp32 shard gradients) and optimizer
    (everything else the optimizer object reaches: fp32 main params, moments, agoq codes/scales/remainders).
    The rest of the peak is activations and temporaries."""
    counted: dict[int, int] = {}
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    weights = _add_unique((p.data for p in params), counted)
    grad_tensors = [getattr(p, "main_grad", None) for p in params] + [p.grad for p in params]
    grad_tensors += list(_tensors([getattr(c, "buffers", None) for c in model_chunks], 4, set()))
    qbufs = [c.quantized_grad_buffers() for c in model_chunks if hasattr(c, "quantized_grad_buffers")]
    grad_tensors += list(_tensors(qbufs, 4, set()))
    grad_tensors += _optimizer_param_grads(optimizer)
    grads = _add_unique((t for t in grad_tensors if t is not None), counted)
    optim = _add_unique(_tensors(optimizer, OPTIMIZER_WALK_DEPTH, set()), counted)
    numel = max(sum(p.numel() for p in {id(p): p for p in params}.values()), 1)
    return {"weights_gib": weights / GIB, "grads_gib": grads / GIB, "optimizer_gib": optim / GIB,
            # per parameter of this rank's model chunks (padding of Megatron's buffers included): with
            # the distributed optimizer the optimizer term is this rank's shard only
            "weights_bytes_per_param": weights / numel, "grads_bytes_per_param": grads / numel,
            "optimizer_bytes_per_param": optim / numel}  # fmt: skip


def measured_report(device, iteration: int, breakdown: dict[str, float] | None = None) -> str | None:
    """Gather every stage's reading (+ its static breakdown) to global rank 0; the text there, None elsewhere."""
    first = runtime.speaks_for_stage()
    reading = dict(runtime.memory_reading(device), **runtime.outside_allocator_gib(device), **(breakdown or {}))
    mine = (runtime.pipeline_rank(), reading) if first else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    parts = [f"stage {stage}: {runtime.format_memory(reading)}{_format_breakdown(reading)}"
             for stage, reading in sorted((g for g in gathered if g), key=lambda g: g[0])]
    return f"measured memory after iteration {iteration}: " + " || ".join(parts)


def _format_breakdown(reading: dict[str, float]) -> str:
    outside = ""
    if "outside_allocator_gib" in reading:
        outside = (f" | outside PyTorch's allocator {reading['outside_allocator_gib']:.2f} GiB (the planner reserves "
                   f"{OUTSIDE_ALLOCATOR_GIB})")
    if "weights_gib" not in reading:
        return outside
    held = reading["weights_gib"] + reading["grads_gib"] + reading["optimizer_gib"]
    text = (f" (weights {reading['weights_gib']:.2f} + grads {reading['grads_gib']:.2f} + optimizer "
            f"{reading['optimizer_gib']:.2f} GiB")
    if "peak_gib" in reading:
        text += f"; activations and temporaries at peak <= {reading['peak_gib'] - held:.2f} GiB"
    if "weights_bytes_per_param" in reading:
        w, g, o = (reading[f"{k}_bytes_per_param"] for k in ("weights", "grads", "optimizer"))
        text += f"; per parameter on this rank: weights {w:.3f} + grads {g:.3f} + optimizer {o:.3f} = {w + g + o:.3f} B"
    return text + ")" + outside
