"""A step-time model for ranking layouts (``python -m agoq.plan --gpus``): which of the layouts that fit on N GPUs is
fastest. It is a model with stated constants, not a measurement; it ranks layouts by the terms they differ in:

- compute: the model's FLOPs of one micro-batch on the slowest pipeline stage (the last: its layers plus the LM
  head), split over TP, at ``ACHIEVED_FLOPS``; backward is twice the forward. Recompute adds the forward again:
  every layer's (``full``) or core attention's (``selective``);
- tensor parallelism: 4 all-reduces of the [tokens, hidden] bf16 activations per layer per micro-batch (2 forward, 2
  backward; 6 with full recompute), ring cost 2 (TP-1)/TP x bytes at ``TP_BUS_BYTES_PER_S``, not overlapped;
- the pipeline bubble: 1F1B runs (m + (PP-1)/V) micro-batch times per step for m micro-batches per data-parallel rank
  and V virtual chunks (Narayanan et al. 2021, arXiv 2104.04473, section 2.2);
- not modelled: the data-parallel gradient reduction (overlapped with backward: --overlap-grad-reduce), pipeline
  point-to-point transfers, agoq's quantize / dequantize time (measured 0.90-1.07x of the bf16 step,
  docs/benchmarks/activations.md) and host-bound small micro-batches; equal times are broken towards the larger
  micro-batch (__main__'s order).
"""

from __future__ import annotations

from dataclasses import dataclass

from agoq.plan.shape import ModelShape

PEAK_BF16_FLOPS = 989e12  # H100 SXM dense bf16 tensor-core peak (NVIDIA H100 datasheet)
ACHIEVED_FRACTION = 0.5  # the 8B shape's measured MFU on one H100 (docs/benchmarks/capacity.md)
ACHIEVED_FLOPS = PEAK_BF16_FLOPS * ACHIEVED_FRACTION
TP_BUS_BYTES_PER_S = 360e9  # assumed NCCL all-reduce bus bandwidth inside one NVLink node (H100 SXM: 450 GB/s links)
BF16_BYTES = 2


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by term (per micro-batch terms times the micro-batch slots of the schedule)."""

    compute: float
    recompute: float
    tp_comm: float
    bubble: float  # the pipeline's idle slots, already in (compute + recompute + tp_comm) x slots

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.bubble


def step_time(shape: ModelShape, *, tp: int, pp: int, vpp: int | None, dp: int, mbs: int, gbs: int, seq: int,
              recompute: str | None) -> StepTime:
    """The modelled step time of ``shape`` (its vocabulary padded as built) at one layout."""
    h, ffn = shape.hidden_size, shape.ffn_hidden_size
    kv = h // shape.num_attention_heads * shape.num_query_groups
    linear_macs = h * (h + 2 * kv) + h * h + 3 * h * ffn  # per token per layer: QKV, output projection, SwiGLU
    attention_macs = seq * h  # per token per layer: QK^T and PV over a causal half of the sequence each
    head_macs = h * shape.vocab_size
    tokens = mbs * seq
    layers = shape.num_layers // pp
    forward = 2 * tokens * (layers * (linear_macs + attention_macs) + head_macs) / tp / ACHIEVED_FLOPS
    redo = {"full": layers * (linear_macs + attention_macs), "selective": layers * attention_macs}.get(recompute, 0)
    again = 2 * tokens * redo / tp / ACHIEVED_FLOPS
    reduces = (6 if recompute == "full" else 4) * layers
    comm = reduces * 2 * (tp - 1) / tp * tokens * h * BF16_BYTES / TP_BUS_BYTES_PER_S if tp > 1 else 0.0
    micro = gbs // (mbs * dp)
    per_micro = 3 * forward + again + comm
    return StepTime(compute=3 * forward * micro, recompute=again * micro, tp_comm=comm * micro,
                    bubble=per_micro * (pp - 1) / (vpp or 1))
