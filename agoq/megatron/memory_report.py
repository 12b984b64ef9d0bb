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

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from agoq.megatron import runtime
from agoq.plan.memory import GIB, Layout, ModelShape, plan_stages
from agoq.plan.peak import Recipe, StagePeak, format_peaks, grad_bytes_per_param, predict_peaks


def _plan_inputs(args, shape, layout, policy):
    if policy is None:
        from agoq.policy import load_policy

        policy = load_policy(_bf16_policy_path())
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    model = ModelShape(shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.num_query_groups,
                       shape.ffn_hidden_size, shape.vocab_size)
    plan_layout = Layout(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, dp=dp, mbs=args.micro_batch_size,
                         gbs=args.global_batch_size, seq=args.seq_length,
                         distributed_optimizer=args.use_distributed_optimizer,
                         grad_bytes=_grad_bytes(args))
    return model, plan_layout, policy


def _grad_bytes(args) -> int:
    """Bytes per parameter of the gradient buffer: fp32 main_grad, bf16 with --grad-reduce-in-bf16, none with
    --agoq-gradient-release (agoq.megatron.release)."""
    if getattr(args, "agoq_gradient_release", False):
        return 0
    return 2 if getattr(args, "grad_reduce_in_bf16", False) else 4


def recipe_from_args(args, policy=None) -> Recipe:
    """The optimizer / gradient / recompute / FP8 settings of scripts/pretrain_llama.py's flags; ``policy``
    (the agoq policy, None with --agoq-disable) supplies the fp8 section the flags override."""
    from agoq.megatron.compute import compute_spec
    from agoq.megatron.optim_args import parse_moments
    from agoq.policy import FP8Spec

    optimizer = getattr(args, "agoq_optimizer", "torch")
    grads = getattr(args, "agoq_grads", None)
    store = grads not in (None, "fp32", "bf16", "fp16") and getattr(args, "agoq_grads_mode", "store") == "store"
    moments = parse_moments(getattr(args, "agoq_moments", "flash"))
    return Recipe(optimizer="torch" if optimizer == "torch" else "agoq", grads=grads if store else None,
                  grad_error_feedback=bool(getattr(args, "agoq_grads_error_feedback", False)),
                  moments=moments if optimizer == "adamw" else moments[:1],
                  master=getattr(args, "agoq_master", "split24"),
                  recompute=getattr(args, "recompute_granularity", None) == "full",
                  gradient_release=bool(getattr(args, "agoq_gradient_release", False)),
                  fp8=FP8Spec() if getattr(args, "agoq_disable", False) else compute_spec(args, policy))


def predicted_peaks(args, shape, layout, policy) -> list[StagePeak]:
    recipe = recipe_from_args(args, policy)
    model, plan_layout, policy = _plan_inputs(args, shape, layout, policy)
    return predict_peaks(model, plan_layout, policy, recipe)


def optimizer_name(args, recipe: Recipe, dp: int) -> str:
    """The optimizer in use, as the report names it."""
    if recipe.optimizer == "torch":
        name = "Megatron's Adam (fp32 master + moments)"
    else:
        kind = {"adamw": "AdamW", "lion": "Lion", "sgd": "SGD"}.get(getattr(args, "agoq_optimizer", ""), "optimizer")
        name = f"agoq {kind} ({','.join(recipe.moments)} states, master {recipe.master})"
    if getattr(args, "use_distributed_optimizer", False):
        name += f", distributed over {dp} data-parallel rank{'s' if dp > 1 else ''}"
    return name


def gradient_name(args, recipe: Recipe, plan_layout) -> str:
    """The gradient format in use and its bytes per parameter per rank (agoq.plan.peak.grad_bytes_per_param)."""
    held, after = grad_bytes_per_param(recipe, plan_layout)
    if recipe.gradient_release:
        return "no gradient buffer (gradient release)"
    if recipe.grads is not None:
        text = f"{recipe.grads} gradients (8-bit store{' + bf16 error feedback' if recipe.grad_error_feedback else ''}"
    elif getattr(args, "agoq_grads", None) not in (None, "fp32", "bf16", "fp16"):
        text = f"{'bf16' if plan_layout.grad_bytes == 2 else 'fp32'} gradients ({args.agoq_grads} reduction only"
    else:
        text = f"{'bf16' if plan_layout.grad_bytes == 2 else 'fp32'} gradients (Megatron's buffer"
    text += f", {held:.3f} B/param held"
    if after:
        text += f" + {after:.3f} B/param fp32 from the reduction to zero_grad"
    return text + ")"


def predicted_report(args, shape, layout, policy) -> str:
    """Per stage: held GiB by component for this run's optimizer and gradients, and the predicted peak
    (rank 0 prints it)."""
    recipe = recipe_from_args(args, policy)
    model, plan_layout, policy = _plan_inputs(args, shape, layout, policy)
    plan = plan_stages(model, plan_layout, policy, fp8=recipe.fp8)
    peaks = predict_peaks(model, plan_layout, policy, recipe)
    lines = [f"predicted memory per GPU (agoq.plan; held bytes with {optimizer_name(args, recipe, plan_layout.dp)} "
             f"and {gradient_name(args, recipe, plan_layout)}):"]
    for s, p in zip(plan, peaks, strict=True):
        total = p.weights + p.grads + p.optimizer + p.held
        lines.append(
            f"  stage {s.pp_rank}: weights {p.weights / GIB:.2f} | grads {p.grads / GIB:.2f} | optimizer "
            f"{p.optimizer / GIB:.2f} | activations {p.held / GIB:.2f} (in-flight {s.inflight}) | "
            f"total {total / GIB:.2f} GiB"
        )
    lines.append("predicted peak per GPU (agoq.plan.peak, this run's optimizer / gradients / recompute; "
                 "accuracy: docs/benchmarks/planner.md):")
    lines.append(format_peaks(peaks))
    if getattr(args, "recompute_granularity", None) == "full" and getattr(args, "recompute_num_layers", 1) != 1:
        lines.append("  note: the peak model assumes --recompute-num-layers 1")
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
            # the distributed optimizer the optimizer term is this rank's shard only (../shared/spec/anchors.md §3.1)
            "weights_bytes_per_param": weights / numel, "grads_bytes_per_param": grads / numel,
            "optimizer_bytes_per_param": optim / numel}  # fmt: skip


def measured_report(device, iteration: int, breakdown: dict[str, float] | None = None) -> str | None:
    """Gather every stage's reading (+ its static breakdown) to global rank 0; the text there, None elsewhere."""
    first = (parallel_state.get_tensor_model_parallel_rank() == 0
             and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
    reading = dict(runtime.memory_reading(device), **(breakdown or {}))
    mine = (parallel_state.get_pipeline_model_parallel_rank(), reading) if first else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    parts = [f"stage {stage}: {runtime.format_memory(reading)}{_format_breakdown(reading)}"
             for stage, reading in sorted((g for g in gathered if g), key=lambda g: g[0])]
    return f"measured memory after iteration {iteration}: " + " || ".join(parts)


def _format_breakdown(reading: dict[str, float]) -> str:
    if "weights_gib" not in reading:
        return ""
    held = reading["weights_gib"] + reading["grads_gib"] + reading["optimizer_gib"]
    text = (f" (weights {reading['weights_gib']:.2f} + grads {reading['grads_gib']:.2f} + optimizer "
            f"{reading['optimizer_gib']:.2f} GiB")
    if "peak_gib" in reading:
        text += f"; activations and temporaries at peak <= {reading['peak_gib'] - held:.2f} GiB"
    if "weights_bytes_per_param" in reading:
        w, g, o = (reading[f"{k}_bytes_per_param"] for k in ("weights", "grads", "optimizer"))
        text += f"; per parameter on this rank: weights {w:.3f} + grads {g:.3f} + optimizer {o:.3f} = {w + g + o:.3f} B"
    return text + ")"
