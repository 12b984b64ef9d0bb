"""Memory planner: predict each pipeline stage's memory under a policy, pick the richest that fits.

Per stage r (bytes, one GPU): weights + gradients + optimizer states of its parameters, plus
activations = (bytes of one chunk-micro-batch on that stage) x in-flight count M_r
(``agoq.policy.inflight_microbatches``; with VPP every chunk holds layers / (P V) layers).
These are the *held* bytes; the predicted peak (held + backward / loss / optimizer-step temporaries,
agoq's optimizer and 8-bit gradients) is ``agoq.plan.peak.predict_peaks``.
Parameter bytes follow Megatron's bf16 recipe: bf16 weight (2), fp32 main_grad (4,
grad_reduce_in_fp32), fp32 master + Adam m, v (12; divided by DP with the distributed optimizer).
Per-layer activation bytes are ``agoq.plan.storage.agoq_bytes`` (exact: what agoq stores) plus
``megatron_bytes`` (modelled: what Megatron keeps itself). The last stage adds the LM head's saves
(``head_saved_bytes``: fp32 logits kept by vocab_parallel_cross_entropy, the head's and final norm's
inputs); the first stage nothing extra (the embedding backward needs only token ids). Not modelled
here: transients (see agoq.plan.peak), NCCL buffers, allocator fragmentation (reserved > allocated).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agoq.plan.fp8 import saved_delta_bytes
from agoq.plan.shape import ModelShape
from agoq.plan.storage import (
    BF16_BYTES,
    FP32_BYTES,
    LayerDims,
    LayerStorage,
    agoq_bytes,
    head_saved_bytes,
    layer_storage,
    megatron_bytes,
)
from agoq.policy import FP8Spec, PolicySpec, ScheduleInfo, Site, inflight_microbatches

WEIGHT_BYTES = BF16_BYTES
GRAD_BYTES = FP32_BYTES  # Megatron main_grad with grad_reduce_in_fp32 (bf16 default)
OPTIM_BYTES = 3 * FP32_BYTES  # fp32 master weight + Adam exp_avg + exp_avg_sq
GIB = 2**30
ExtraLayerBytes = Callable[[LayerStorage, LayerDims], int]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int = 1
    mbs: int = 1
    gbs: int = 1
    seq: int = 2048
    distributed_optimizer: bool = False
    grad_bytes: int = GRAD_BYTES  # 2 with --grad-reduce-in-bf16
    sequence_parallel: bool = False  # --sequence-parallel: the residual stream's saves 1/tp (agoq.plan.storage)

    @property
    def num_microbatches(self) -> int:
        per_step = self.mbs * self.dp
        if self.gbs % per_step:
            raise ValueError(f"--gbs {self.gbs} must be a multiple of --mbs {self.mbs} x dp {self.dp}")
        return self.gbs // per_step


@dataclass(frozen=True)
class StageMemory:
    pp_rank: int
    layers: tuple[int, ...]
    inflight: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    head_activations: int = 0  # part of ``activations``: the LM head's saves (last stage)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


def stage_layers(shape: ModelShape, layout: Layout) -> list[list[tuple[int, int | None]]]:
    """(global layer index, vp chunk) of every rank, uniform split as megatron-core 0.19.2."""
    chunks = layout.vpp or 1
    if shape.num_layers % (layout.pp * chunks):
        raise ValueError(f"--num-layers {shape.num_layers} must divide into pp x vpp = {layout.pp * chunks} chunks")
    per_chunk = shape.num_layers // (layout.pp * chunks)
    out = []
    for rank in range(layout.pp):
        layers = []
        for chunk in range(chunks):
            start = chunk * (shape.num_layers // chunks) + rank * per_chunk
            layers += [(i, None if layout.vpp is None else chunk) for i in range(start, start + per_chunk)]
        out.append(layers)
    return out


def plan_stages(shape: ModelShape, layout: Layout, policy: PolicySpec, *, fp8: FP8Spec | None = None,
                core_attn_recompute: bool = False, plain_swiglu_fusion: bool = True, rope_fused: bool = False,
                extra_layer_bytes: ExtraLayerBytes | None = None) -> list[StageMemory]:
    """``fp8``: the run's FP8 / Smooth-SwiGLU settings (saved-activation changes: ``agoq.plan.fp8``);
    ``plain_swiglu_fusion``: plain SwiGLU fused with the FP8 fc2 (``agoq.plan.fp8.fused_plain``; False: Megatron's
    SwiGLU before the FP8 fc2, as with AGOQ_FP8_SWIGLU_FUSION=0);
    ``core_attn_recompute``: Megatron's selective recompute of core attention (``megatron_bytes``);
    ``rope_fused``: agoq's fused RoPE (no per-layer cos / sin saves: ``megatron_bytes``);
    ``extra_layer_bytes(storage, dims)``: bytes a layer keeps per micro-batch besides the modelled ones (another
    version of the code than the current one: benchmarks/planner_history.py)."""
    schedule = ScheduleInfo(layout.pp, layout.vpp, layout.num_microbatches)
    dims = LayerDims(seq=layout.seq, micro_batch=layout.mbs, hidden=shape.hidden_size, ffn=shape.ffn_hidden_size,
                     heads=shape.num_attention_heads, groups=shape.num_query_groups, tp=layout.tp,
                     sequence_parallel=layout.sequence_parallel)
    chunks = layout.vpp or 1
    result = []
    for rank, layers in enumerate(stage_layers(shape, layout)):
        per_layer = []
        for idx, chunk in layers:
            storage = layer_storage(
                policy, lambda role, i=idx, c=chunk, r=rank: Site(i, r, layout.pp, c, layout.vpp, role), schedule
            )
            fp8_layer = fp8 is not None and fp8.uses_fp8(idx, shape.num_layers)
            per_layer.append(sum(agoq_bytes(storage, dims).values())
                             + sum(megatron_bytes(storage, dims, core_attn_recompute=core_attn_recompute,
                                                    rope_fused=rope_fused).values())
                             + saved_delta_bytes(fp8, storage, dims, fp8_layer, plain_swiglu_fusion)
                             + (extra_layer_bytes(storage, dims) if extra_layer_bytes is not None else 0))
        params = len(layers) * shape.layer_params() // layout.tp
        extra = 0
        if rank == 0:
            params += shape.vocab_size * shape.hidden_size // layout.tp
        if rank == layout.pp - 1:
            params += shape.vocab_size * shape.hidden_size // layout.tp + shape.hidden_size
            extra = head_saved_bytes(dims, shape.vocab_size)
        inflight = inflight_microbatches(rank, schedule)
        per_chunk_mb = sum(per_layer) / chunks  # one chunk-micro-batch holds one chunk's layers
        optim_share = layout.dp if layout.distributed_optimizer else 1
        result.append(StageMemory(
            pp_rank=rank, layers=tuple(i for i, _ in layers), inflight=inflight,
            weights=WEIGHT_BYTES * params, grads=layout.grad_bytes * params,
            optimizer=OPTIM_BYTES * params // optim_share,
            activations=int(per_chunk_mb * inflight) + extra * min(inflight, 1),
            head_activations=extra * min(inflight, 1),
        ))
    return result


def layer_storage_of(shape: ModelShape, layout: Layout, policy: PolicySpec, rank: int) -> LayerStorage:
    """What the last layer of pipeline rank ``rank`` stores (its first layer in backward order)."""
    schedule = ScheduleInfo(layout.pp, layout.vpp, layout.num_microbatches)
    idx, chunk = stage_layers(shape, layout)[rank][-1]
    return layer_storage(policy, lambda role: Site(idx, rank, layout.pp, chunk, layout.vpp, role), schedule)


MIN_UNITLESS_BYTES = 2**20  # a unitless budget below 1 MiB is a forgotten unit, not a GPU


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '512MiB', '1e9' -> bytes."""
    units = {"gib": GIB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "kib": 2**10, "kb": 10**3, "b": 1}
    low = text.strip().lower()
    unit = next((u for u in units if low.endswith(u)), None)
    try:
        number = float(low[: -len(unit)] if unit else low)
    except ValueError:  # 'eightyGiB' used to end in float()'s own message, naming no flag
        raise ValueError(f"--memory-budget {text!r}: write e.g. 80GiB, 141GB or a byte count") from None
    if not number > 0 or number == float("inf"):  # '-5GiB' / '0GiB' / 'nan': no policy could fit, reported as such
        raise ValueError(f"--memory-budget {text!r}: must be a positive size, e.g. 80GiB")
    if unit:
        return int(number * units[unit])
    count = int(number)
    if count < MIN_UNITLESS_BYTES:  # '80' was read as 80 bytes: every policy then "does not fit", silently
        raise ValueError(f"--memory-budget {text!r} is {count} bytes; give a unit (e.g. {text.strip()}GiB) or a "
                         "byte count")
    return count
