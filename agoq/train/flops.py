"""Model FLOPs of LLaMA training (GQA, SwiGLU, untied output layer) and TFLOP/s per GPU.

Pure functions of the shape and batch; no torch, no megatron. The count is Megatron's
(``megatron.training.training.num_floating_point_operations`` in megatron-core 0.19.2, dense GQA +
SwiGLU path), so agoq's TFLOP/s/GPU reads the same as a Megatron log for the same model:

- only matrix multiplies count, 2 FLOPs per multiply-add (``FLOPS_PER_MAC``);
- training = forward + two backward GEMMs (data and weight gradient) = 3x forward (``PASSES``);
- per layer and token: QKV projection ``2 h (q + 2 kv)``, output projection ``2 q h``, SwiGLU MLP
  ``2 * 3 h f`` (gate, up, down);
- core attention is causal: ``QK^T`` and ``softmax(QK^T) V`` each cost ``2 q s`` per token over the
  full ``s x s`` matrix, and half of it is masked, so ``2 q s`` per token in all;
- the output layer (logits) ``2 h V``; the embedding lookup, norms, RoPE, softmax, the SwiGLU
  product, the loss and the optimizer are not counted.

Here q = heads x head_dim (= hidden), kv = query groups x head_dim, f = FFN size, s = sequence, V =
padded vocabulary. agoq recomputes nothing, so model FLOPs equal the FLOPs the GPU runs.
"""

from __future__ import annotations

PASSES = 3  # forward, backward data-gradient, backward weight-gradient GEMMs
FLOPS_PER_MAC = 2  # a multiply and an add
TERA = 10**12


def training_flops_per_token(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    ffn_hidden_size: int,
    seq_length: int,
    vocab_size: int,
) -> int:
    """Training FLOPs (forward + backward) per token of a full-length sequence; an exact integer."""
    for name, value in (("num_layers", num_layers), ("hidden_size", hidden_size),
                        ("num_attention_heads", num_attention_heads), ("num_query_groups", num_query_groups),
                        ("ffn_hidden_size", ffn_hidden_size), ("seq_length", seq_length),
                        ("vocab_size", vocab_size)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}")
    head_dim = hidden_size // num_attention_heads
    q_width = num_attention_heads * head_dim
    kv_width = num_query_groups * head_dim
    macs_per_layer = (
        hidden_size * (q_width + 2 * kv_width)  # QKV projection
        + q_width * hidden_size  # attention output projection
        + 3 * hidden_size * ffn_hidden_size  # SwiGLU: gate and up (h -> 2f), down (f -> h)
        + q_width * seq_length  # QK^T and softmax(QK^T)V: 2 q s MACs per token, half masked (causal)
    )
    macs = num_layers * macs_per_layer + hidden_size * vocab_size  # + output layer (logits)
    return PASSES * FLOPS_PER_MAC * macs


def training_flops_per_iteration(shape, global_batch_size: int) -> int:
    """FLOPs of one optimizer step of ``global_batch_size`` samples of a model of ``shape`` (an
    ``agoq.megatron.model.LlamaShape``: its ``vocab_size`` is the padded vocabulary the model was built with,
    the output layer's width)."""
    per_token = training_flops_per_token(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        seq_length=shape.seq_length,
        vocab_size=shape.vocab_size,
    )
    return per_token * global_batch_size * shape.seq_length


def tflops_per_gpu(flops_per_iteration: int, step_seconds: float, world_size: int) -> float:
    """Achieved TFLOP/s per GPU: all the step's FLOPs over all GPUs (Megatron's ``throughput`` line)."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    return flops_per_iteration / (step_seconds * world_size * TERA)
