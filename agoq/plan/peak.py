"""Predicted per-GPU peak of ``torch.cuda.max_memory_allocated`` for one pipeline stage.

peak = max(DDP construction, persistent state + max(forward/backward phase, optimizer-step phase)), every
term from what the code allocates (file and function named at each term). Pure Python (no torch, no
Megatron).

DDP construction (``StagePeak.construction``): Megatron's ``_ParamAndGradBuffer.__init__``
(megatron.core.distributed.param_and_grad_buffer) allocates, with the distributed optimizer, the bf16
parameter buffer while the model's original parameters are still alive (copied in afterwards), and the
float gradient buffer (grad dtype x buffer elements). With agoq's 8-bit store the gradient buffer is a
meta placeholder (agoq/megatron/grads/deferred_grad_buffer.py): construction holds parameters + parameter
buffer, and the 8-bit store is built after the parameters were copied (<= the parameters' bytes, in the
persistent term). Gradient release builds no DDP.

Persistent (held for the whole run after the first step):
- weights: bf16 parameters (2 B each) of the stage's layers, embedding (first stage), final norm and
  output layer (last stage; untied, as agoq's LLaMA builds it).
- gradients: Megatron's float ``main_grad`` buffer (4 B fp32, 2 B with --grad-reduce-in-bf16; with the
  distributed optimizer each parameter starts on a multiple of 64 elements and the buffer ends on a
  multiple of lcm(dp, 128): megatron.core.distributed.param_and_grad_buffer ``_pad``), or agoq's 8-bit
  store (codes + scales: ``QuantFormat.bytes_per_element``, + 2 B bf16 residual with error feedback).
- optimizer: Megatron's AdamW 12 B/param (fp32 master, exp_avg, exp_avg_sq; / dp with the distributed
  optimizer), or agoq's (master remainder + moment codes + scales, from the formats).
- ``CUDA_RUNTIME_BYTES``: cuBLAS + cuBLASLt workspaces (empirical constant, see below).

Forward/backward phase: the held activations of every in-flight micro-batch (``plan_stages``), the
last stage's LM head (fp32 logits kept by Megatron's cross entropy, its input and the final norm's
input), and the larger of two transients: the bf16 logits alive while the loss is computed (end of the
forward), or the largest temporary of one layer's backward (``layer_backward_transient``). With the
8-bit store and Megatron's AdamW the float buffer exists only from the reduction to the next zero_grad,
so it is not in this phase.

Optimizer-step phase: persistent state plus the step's temporaries. Megatron's AdamW without TE/apex is
``torch.optim.AdamW(foreach=True)``: ``torch._foreach_sqrt(exp_avg_sq)`` allocates one fp32 tensor per
parameter (4 B/param; the other foreach ops are in place). With bf16 gradients Megatron's
``_copy_model_grads_to_main_grads`` makes fp32 copies (``main_grad.float()``, 4 B/param). With the 8-bit
store and Megatron's AdamW the reduced gradient is dequantized into a float buffer (4 B/param,
agoq.megatron.grads.grad_store; with the distributed optimizer only the rank's fp32 shard gradients, 4/dp; with
agoq's optimizer nothing: it reads the 8-bit shard one parameter at a time). agoq's optimizer steps one
parameter (or shard) at a time with the fused Triton step, which allocates nothing; what it does allocate is
``agoq_step_bytes``: the 8-bit store's fp32 read of the largest parameter and its clipped copy (the states are
created at their final size, without temporaries).

Gradient release (``Recipe.gradient_release``, --agoq-gradient-release): 0 gradient bytes and no step
phase; the per-parameter step and non-finite check run inside backward (``release_step_bytes``), the
largest at the start of backward on top of the layers' held activations (a third forward/backward candidate).

FP8 linears and Smooth-SwiGLU (``Recipe.fp8``, an ``agoq.policy.FP8Spec``): the FP8 weight caches and
delayed scaling's state are persistent (``StagePeak.fp8``, in both phases), the FP8 inputs saved for
backward and Smooth-SwiGLU's saves change the held bytes (agoq.plan.fp8, which also says why the casts
add no transient at either peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agoq.formats import parse_format
from agoq.plan.fp8 import fp8_persistent_bytes
from agoq.plan.memory import GIB, ExtraLayerBytes, Layout, layer_storage_of, plan_stages, stage_layers
from agoq.plan.shape import ModelShape
from agoq.plan.storage import BF16_BYTES, FP32_BYTES, LayerDims
from agoq.policy import FP8Spec, PolicySpec

# Empirical: allocated bytes that are neither parameters, gradients nor optimizer states, read as
# ``allocated - (weights + grads + optimizer)`` after the step: 0.063 GiB in all 11 variants of
# pretrain_memory_2026-11-24.json (H100, torch 2.11; commit ff040ca:
# git show ff040ca:docs/benchmarks/pretrain_memory_2026-11-24.json), and the constant part of bench_memory's
# peaks (docs/benchmarks/planner.md). It is what torch allocates through the caching allocator for the cuBLAS
# and cuBLASLt workspaces on sm_90 (32 MiB each by default) plus the token/label/position batch.
CUDA_RUNTIME_BYTES = 64 * 2**20
DIST_OPT_PARAM_ALIGN = 64  # elements; megatron param_and_grad_buffer pads each param start (dist-opt)
DIST_OPT_BUCKET_ALIGN = 128  # bucket end padded to a multiple of lcm(dp, 128) (dist-opt)
TORCH_ADAM_STEP_BYTES = FP32_BYTES  # torch._foreach_sqrt(exp_avg_sq): one fp32 list, per parameter
# agoq's optimizer with the 8-bit store reads one parameter's (shard's) reduced gradient as fp32
# (agoq.megatron.grads.grad_reader: QuantizedGradReader.grad / ShardGradReader.clipped_grad) and, while Megatron's
# --clip-grad (default 1.0) scales it, ``g * clip_coeff`` is a second fp32 tensor until the first is dropped;
# the fused step (agoq.kernels.optim._launch_step) then allocates nothing. Measured: capacity_1gpu.json
# 8b/agoq full, iteration 1 (grad norm 56): 48.419 GiB = 46.036 allocated after the step - 1.529 GiB of
# states the output layer (stepped last) creates in its own step + 2 x 4 B x its 525,336,576 elements.
# With Megatron's float buffer the step reads main_grad in place (FP32Optimizer clips in place): 0.
STORE_GRAD_READ_FP32_COPIES = 2
MASTER_BYTES = {"none": 0, "split24": 1, "split32": 2, "fp32": 4}
# The non-finite gradient check before the step (agoq.train.training / ddp, agoq.ops.nonfinite):
# torch.isfinite of a float slice allocates |x| (grad dtype) plus three bool temporaries. It runs over slices of
# NONFINITE_CHECK_SLICE elements (agoq.ops.nonfinite, equal by test).
NONFINITE_CHECK_SLICE = 2**24
ISFINITE_BOOL_TEMPORARIES = 3


@dataclass(frozen=True)
class Recipe:
    """What besides the activation policy decides the peak (pretrain_llama.py flags)."""

    optimizer: str = "torch"  # "torch": Megatron's AdamW; "agoq": agoq's optimizer (--agoq-optimizer)
    grads: str | None = None  # agoq 8-bit gradient store format (--agoq-grads, store mode), or None
    grad_error_feedback: bool = False
    moments: tuple[str, str] = ("cint8_b32", "cuint8_b32")  # agoq optimizer's m, v formats
    master: str = "split24"
    recompute: bool = False  # Megatron's full recompute, one layer per group (--recompute-granularity full)
    # Megatron's selective recompute of core attention (--recompute-granularity selective): changes what
    # attention saves (agoq.plan.storage.megatron_bytes); the recomputed attention's own temporaries in
    # backward ([T, n d] out + fp32 log-sum-exp) are below the MLP's and are not added
    selective_recompute: bool = False
    gradient_release: bool = False  # --agoq-gradient-release: no gradient buffer, each param stepped in backward
    # --agoq-fp8 / --agoq-smooth-swiglu / --agoq-fp8-bf16-*-layers over the policy's fp8 section
    # (agoq.megatron.compute.compute_spec): weight caches, scaling state, saved inputs (agoq.plan.fp8)
    fp8: FP8Spec = FP8Spec()
    # plain SwiGLU fused with the FP8 fc2 under delayed scaling (agoq.plan.fp8.fused_plain); False: Megatron's SwiGLU
    # before the FP8 fc2, as with the trainer's AGOQ_FP8_SWIGLU_FUSION=0 (agoq.train.memory_report)
    fuse_plain_swiglu_fp8: bool = True
    # agoq's fused RoPE in Megatron's slot (--rope-fusion; agoq.megatron.rope): no per-layer cos / sin saves
    # (agoq.plan.storage.megatron_bytes); False: Megatron's unfused RoPE
    rope_fused: bool = False


@dataclass(frozen=True)
class StagePeak:
    pp_rank: int
    weights: int
    grads: int
    optimizer: int
    runtime: int
    held: int  # activations of every in-flight micro-batch + the LM head's saves (last stage)
    transient: int  # largest forward/backward temporary on top of ``held``
    step_extra: int  # optimizer-step temporaries (and float gradient buffers that exist only then)
    transient_source: str
    fp8: int = 0  # FP8 weight caches + scaling state of the stage's FP8 linears (agoq.plan.fp8)
    construction: int = 0  # model parameters + Megatron DDP's buffers at construction (module docstring)
    head_held: int = 0  # part of ``held``: the LM head's and loss's saves (last stage; storage.head_saved_bytes)
    step_source: str = "step temporaries"  # what ``step_extra`` is (agoq's first step: the states' initialisation)

    @property
    def persistent(self) -> int:
        return self.weights + self.grads + self.optimizer + self.runtime + self.fp8

    @property
    def fwd_bwd(self) -> int:
        return self.persistent + self.held + self.transient

    @property
    def step(self) -> int:
        return self.persistent + self.step_extra

    @property
    def peak(self) -> int:
        return max(self.fwd_bwd, self.step, self.construction)

    @property
    def phase(self) -> str:
        if self.construction > max(self.fwd_bwd, self.step):
            return "DDP construction"
        return "forward/backward" if self.fwd_bwd >= self.step else "optimizer step"


def param_tensors(shape: ModelShape, layout: Layout, rank: int) -> list[int]:
    """numel of every parameter tensor on pipeline rank ``rank`` (one tensor-parallel rank)."""
    h, tp = shape.hidden_size, layout.tp
    d = h // shape.num_attention_heads
    layer = [h * d * (shape.num_attention_heads + 2 * shape.num_query_groups) // tp, h * h // tp,
             2 * h * shape.ffn_hidden_size // tp, h * shape.ffn_hidden_size // tp, h, h]  # fmt: skip
    out = layer * len(stage_layers(shape, layout)[rank])
    if rank == 0:
        out.append(shape.vocab_size * h // tp)
    if rank == layout.pp - 1:
        out += [h, shape.vocab_size * h // tp]
    return out


def grad_buffer_numel(tensors: list[int], layout: Layout) -> int:
    """Elements of Megatron's float gradient buffer (padding of the distributed optimizer included)."""
    if not layout.distributed_optimizer:
        return sum(tensors)
    total = sum(math.ceil(n / DIST_OPT_PARAM_ALIGN) * DIST_OPT_PARAM_ALIGN for n in tensors)
    align = math.lcm(layout.dp, DIST_OPT_BUCKET_ALIGN)
    return math.ceil(total / align) * align


def layer_backward_transient(dims: LayerDims, swiglu_recompute: bool, norm_recompute: bool) -> int:
    """Largest temporary of one transformer layer's backward, on top of what the layers hold.

    F = bf16 [T, f] bytes. The MLP dominates (f >= h):
    - Megatron's SwiGLU (autograd of ``silu(x_glu) * x_linear``): MulBackward holds the incoming grad
      and writes two [T, f] grads before its saved inputs are released: 3F.
    - agoq's SwiGLU recompute (agoq.ops.saved_swiglu): fc2's backward dequantizes the fc1 output h^ (2F,
      cached in the stash) and recomputes z (F); the SwiGLU backward (agoq.kernels.swiglu.swiglu_bwd)
      then holds h^ (2F), grad_z (F) and writes grad_h (2F): 5F.
    - plus the bf16 weight gradient of fc1 before DDP adds it to main_grad ([2f, h]), and with norm
      recompute the dequantized norm input and the recomputed norm output (2 x [T, h]) are not alive
      at the same time as the SwiGLU temporaries (fc1's backward runs after SwiGLU's).
    """
    big_f = BF16_BYTES * dims.tokens * dims.ffn // dims.tp
    mlp = 5 * big_f if swiglu_recompute else 3 * big_f
    wgrad = BF16_BYTES * 2 * dims.ffn * dims.hidden // dims.tp
    return mlp + wgrad


def logits_transient(dims: LayerDims, vocab: int) -> int:
    """The bf16 logits (2 B x T x V), alive while the loss is computed at the end of the forward, on top
    of what the head keeps (``agoq.plan.storage.head_saved_bytes``: the fp32 copy becomes the saved exp)."""
    return BF16_BYTES * dims.tokens * (vocab // dims.tp)


def nonfinite_check_bytes(numel: int, elem_bytes: int) -> int:
    """Temporaries of the non-finite check over a float gradient buffer of ``numel`` elements; it runs
    after the backward (activations released) and before the optimizer step, so it is a step-phase term."""
    return min(numel, NONFINITE_CHECK_SLICE) * (elem_bytes + ISFINITE_BOOL_TEMPORARIES)


def agoq_step_bytes(largest_numel: int, recipe: Recipe) -> int:
    """Temporaries of agoq's optimizer step, bounded by its largest parameter (or shard; the one stepped last
    finds every other state allocated). With the 8-bit store: the fp32 read and its clipped copy
    (``STORE_GRAD_READ_FP32_COPIES``); with Megatron's float buffer none (the states are created at their final
    size, with no temporaries)."""
    read = FP32_BYTES * largest_numel if recipe.grads is not None else 0
    return STORE_GRAD_READ_FP32_COPIES * read


def release_step_bytes(largest_numel: int) -> int:
    """Gradient release (agoq.megatron.optim.release): inside backward, one parameter's hook holds its bf16 gradient
    and the non-finite check's temporaries (``nonfinite_check_bytes``: one slice); the fused step allocates
    nothing. Bounded by the largest parameter. The output layer's hook fires at the start of backward, after
    the loss's and the output layer's backward released the head's saves: counted on top of the layers' held
    activations. Measured: capacity_1gpu.json 8b/agoq gradient release, iteration 1: 39.451 GiB = 38.473
    allocated after the step + the embedding's bf16 gradient (2 B x 525,336,576; stepped last: in the first
    step its states, 1.5 GiB, are created after the check, whose 80 MiB fit in the room they take later)."""
    check = min(largest_numel, NONFINITE_CHECK_SLICE) * (BF16_BYTES + ISFINITE_BOOL_TEMPORARIES)
    return BF16_BYTES * largest_numel + check


def grad_bytes_per_param(recipe: Recipe, layout: Layout) -> tuple[float, float]:
    """Gradient bytes per parameter on one rank as agoq builds them (padding ignored): (held through
    forward/backward, extra float bytes from the reduction to the next zero_grad).

    Megatron's float buffer: 4 (2 with --grad-reduce-in-bf16); Megatron's fp32 step over a bf16 buffer adds
    fp32 copies (4/share). agoq's 8-bit store (agoq.megatron.grads.grad_store): codes + scales (+ 2 B residual
    with error feedback), the reduced gradient requantized in place with or without the distributed
    optimizer; agoq's optimizer reads it one parameter (shard) at a time (0 extra); Megatron's Adam needs
    every fp32 gradient at once: the whole float buffer (4) without the distributed optimizer, its fp32
    shard gradients (4/dp) with it. Gradient release: (0, 0).
    """
    share = layout.dp if layout.distributed_optimizer else 1
    if recipe.gradient_release:
        return 0.0, 0.0
    if recipe.grads is not None:
        held = parse_format(recipe.grads).bytes_per_element() + (BF16_BYTES if recipe.grad_error_feedback else 0)
        return held, (FP32_BYTES / share if recipe.optimizer == "torch" else 0.0)
    after = FP32_BYTES / share if recipe.optimizer == "torch" and layout.grad_bytes != FP32_BYTES else 0.0
    return float(layout.grad_bytes), after


def ddp_construction_bytes(weights: int, buffer_numel: int, layout: Layout, recipe: Recipe) -> int:
    """Allocated while Megatron's DDP builds its buffers (module docstring): the model's parameters, with the
    distributed optimizer the bf16 parameter buffer, and the float gradient buffer, except with agoq's 8-bit
    store (a meta placeholder, agoq/megatron/grads/deferred_grad_buffer.py). 0 with gradient release
    (agoq.megatron.optim.release wraps the model without Megatron's DDP)."""
    if recipe.gradient_release:
        return 0
    param_buffer = BF16_BYTES * buffer_numel if layout.distributed_optimizer else 0
    deferred = recipe.grads is not None
    float_grads = 0 if deferred else layout.grad_bytes * buffer_numel
    return weights + param_buffer + float_grads


def _fwd_bwd_transient(dims: LayerDims, storage, st, last: bool, vocab: int, largest: int,
                       recipe: Recipe) -> tuple[int, str]:
    """(bytes, source) of the largest forward/backward temporary on top of the held bytes. The loss's backward
    and the output layer's run before the last layer's: by then the head's saves are released, so the layer
    transient (and gradient release's step) sits on top of the layers' held bytes only."""
    backward = layer_backward_transient(dims, storage.swiglu_recompute, storage.norm_recompute)
    candidates = [(logits_transient(dims, vocab) if last else 0, "LM-head logits"),
                  (backward - st.head_activations, "layer backward")]
    if recipe.gradient_release:
        candidates.append((release_step_bytes(largest) - st.head_activations, "release step"))
    return max(candidates)


def stage_dims(shape: ModelShape, layout: Layout) -> LayerDims:
    return LayerDims(seq=layout.seq, micro_batch=layout.mbs, hidden=shape.hidden_size, ffn=shape.ffn_hidden_size,
                     heads=shape.num_attention_heads, groups=shape.num_query_groups, tp=layout.tp,
                     sequence_parallel=layout.sequence_parallel)


def predict_peaks(shape: ModelShape, layout: Layout, policy: PolicySpec, recipe: Recipe = Recipe(), *,
                  extra_layer_bytes: ExtraLayerBytes | None = None) -> list[StagePeak]:
    """One StagePeak per pipeline rank. ``extra_layer_bytes``: bytes a layer keeps per micro-batch besides the
    modelled ones (``agoq.plan.memory.plan_stages``)."""
    dims = stage_dims(shape, layout)
    stages = plan_stages(shape, layout, policy, fp8=recipe.fp8, extra_layer_bytes=extra_layer_bytes,
                         core_attn_recompute=recipe.selective_recompute, rope_fused=recipe.rope_fused,
                         plain_swiglu_fusion=recipe.fuse_plain_swiglu_fp8)
    out = []
    for st in stages:
        rank = st.pp_rank
        tensors = param_tensors(shape, layout, rank)
        params = sum(tensors)
        weights = BF16_BYTES * params
        buffer = grad_buffer_numel(tensors, layout)
        share = layout.dp if layout.distributed_optimizer else 1
        step_extra, step_source = 0, "step temporaries"
        if recipe.grads is not None:
            fmt = parse_format(recipe.grads)
            grads = int(fmt.bytes_per_element() * params) + (BF16_BYTES * params if recipe.grad_error_feedback else 0)
            if recipe.optimizer == "torch":
                step_extra += FP32_BYTES * buffer // share  # float buffer the reduced grads are dequantized into
        else:
            grads = layout.grad_bytes * buffer
            if recipe.optimizer == "torch" and layout.grad_bytes != FP32_BYTES:
                step_extra += FP32_BYTES * buffer // share  # main_grad.float() copies for the fp32 step
        if recipe.optimizer == "torch":
            optimizer = 3 * FP32_BYTES * buffer // share
            step_extra += TORCH_ADAM_STEP_BYTES * buffer // share
        else:
            per_param = sum(parse_format(m).bytes_per_element() for m in recipe.moments) + MASTER_BYTES[recipe.master]
            optimizer = int(per_param * params / share)
            step_extra += agoq_step_bytes(max(tensors), recipe)
        storage = layer_storage_of(shape, layout, policy, rank)
        layer_held = st.activations - st.head_activations  # every in-flight micro-batch's layers
        if recipe.recompute:
            # Megatron's full recompute (uniform, 1 layer): each in-flight micro-batch keeps every layer's
            # bf16 input; the layer being recomputed holds its own saves again during its backward.
            per_layer = layer_held // max(st.inflight * len(st.layers), 1)
            layer_held = st.inflight * len(st.layers) * BF16_BYTES * dims.tokens * dims.hidden // dims.tp + per_layer
        transient, source = _fwd_bwd_transient(dims, storage, st, rank == layout.pp - 1, shape.vocab_size,
                                               max(tensors), recipe)
        if recipe.grads is None:  # Megatron's float buffers are checked (8-bit grads: their own check)
            step_extra = max(step_extra, nonfinite_check_bytes(buffer, layout.grad_bytes))
        if recipe.gradient_release:  # no buffer; the per-parameter step and check moved into backward (above)
            grads, step_extra = 0, 0
        fp8 = fp8_persistent_bytes(recipe.fp8, shape, layout.tp, st.layers)
        construction = ddp_construction_bytes(weights, buffer, layout, recipe)
        out.append(StagePeak(rank, weights, grads, optimizer, CUDA_RUNTIME_BYTES, layer_held + st.head_activations,
                             transient, step_extra, source, fp8, construction, st.head_activations, step_source))
    return out


def format_peaks(peaks: list[StagePeak]) -> str:
    lines = []
    for p in peaks:
        head = f"  stage {p.pp_rank}: predicted peak {p.peak / GIB:.2f} GiB ({p.phase}) = "
        if p.phase == "DDP construction":
            lines.append(head + f"parameters {p.weights / GIB:.2f} + Megatron's DDP buffers "
                         f"{(p.construction - p.weights) / GIB:.2f} GiB (parameter buffer with the distributed "
                         f"optimizer, float gradient buffer unless agoq's 8-bit store defers it; training peak "
                         f"{max(p.fwd_bwd, p.step) / GIB:.2f} GiB)")
            continue
        lines.append(
            head + f"weights {p.weights / GIB:.2f}"
            f" + grads {p.grads / GIB:.2f} + optimizer {p.optimizer / GIB:.2f} + runtime {p.runtime / GIB:.2f}"
            + (f" + fp8 weight cache {p.fp8 / GIB:.2f}" if p.fp8 else "")
            + (f" + activations {p.held / GIB:.2f} + {p.transient_source} {p.transient / GIB:.2f}"
               if p.phase == "forward/backward" else f" + {p.step_source} {p.step_extra / GIB:.2f}")
            + " GiB")
    return "\n".join(lines)


def choose_by_peak(shape: ModelShape, layout: Layout, candidates, budget: int, recipe: Recipe = Recipe(), *,
                   recipes: dict[str, Recipe] | None = None):
    """(name, report) of the first candidate policy (richest first) whose predicted peak fits ``budget`` on
    every stage, else (None, report); report = [(name, [StagePeak, ...]), ...] of the candidates tried.
    ``recipes``: a candidate's own recipe by name (its policy's fp8 / grads sections), else ``recipe``."""
    report = []
    for name, policy in candidates:
        peaks = predict_peaks(shape, layout, policy, (recipes or {}).get(name, recipe))
        report.append((name, peaks))
        if all(p.peak <= budget for p in peaks):
            return name, report
    return None, report


def format_peak_report(report, budget: int) -> str:
    lines = [f"budget {budget / GIB:.2f} GiB per GPU (predicted peak: agoq.plan.peak)"]
    for name, peaks in report:
        for p in peaks:
            fits = "fits" if p.peak <= budget else "DOES NOT FIT"
            lines.append(
                f"{name:>12}  stage {p.pp_rank}  persistent {p.persistent / GIB:6.2f}  activations "
                f"{p.held / GIB:7.2f}  transient {p.transient / GIB:5.2f}  step {p.step_extra / GIB:5.2f}  "
                f"peak {p.peak / GIB:7.2f} GiB ({p.phase})  {fits}")
    return "\n".join(lines)
