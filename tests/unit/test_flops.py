"""agoq.train.flops: training FLOPs per token / per step and TFLOP/s per GPU for LLaMA (GQA + SwiGLU).

Two independent oracles:
- an identity: every matmul weight is used once per token (2 FLOPs per multiply-add, 3 passes), so the
  count must be 6 x (parameters - embedding - norm gains) + the causal attention term 6 L q s, with the
  parameter count from ``LlamaShape.num_parameters`` (written separately, for the memory report);
- Megatron's own ``num_floating_point_operations`` (megatron-core 0.19.2), which agoq promises to match
  so that TFLOP/s/GPU reads the same as in a Megatron log.
All counts are integers, so equality is exact (Megatron's function uses floats: ~1e-15 relative).
"""

from __future__ import annotations

import argparse

import pytest

from agoq.train import flops

SHAPES = {
    # name: (layers, hidden, heads, query groups, ffn, seq, vocab)
    "tiny_gqa": (4, 64, 4, 2, 192, 128, 512),
    "llama2_7b": (32, 4096, 32, 32, 11008, 4096, 32000),
    "llama3_8b": (32, 4096, 32, 8, 14336, 8192, 128256),
    "qwen_like_32b": (64, 5120, 40, 8, 27648, 4096, 128256),
}
KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
        "seq_length", "vocab_size")


def _kwargs(name: str) -> dict:
    return dict(zip(KEYS, SHAPES[name], strict=True))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_flops_per_token_is_six_times_matmul_params_plus_causal_attention(name):
    from agoq.megatron.model import LlamaShape

    kw = _kwargs(name)
    shape = LlamaShape(**kw)
    layers, hidden, seq, vocab = kw["num_layers"], kw["hidden_size"], kw["seq_length"], kw["vocab_size"]
    norm_gains = (2 * layers + 1) * hidden  # two RMSNorms per layer + the final one: no matmul
    matmul_params = shape.num_parameters() - vocab * hidden - norm_gains  # the embedding is a lookup
    causal_attention = 6 * layers * hidden * seq  # (QK^T + PV) = 2 q s MACs/token, half masked, x2 x3
    assert flops.training_flops_per_token(**kw) == 6 * matmul_params + causal_attention


def _megatron_args(kw: dict) -> argparse.Namespace:
    """The Megatron flags num_floating_point_operations reads, for a dense GQA + SwiGLU model."""
    return argparse.Namespace(
        num_layers=kw["num_layers"], hidden_size=kw["hidden_size"], num_attention_heads=kw["num_attention_heads"],
        num_query_groups=kw["num_query_groups"], group_query_attention=True, ffn_hidden_size=kw["ffn_hidden_size"],
        seq_length=kw["seq_length"], padded_vocab_size=kw["vocab_size"], swiglu=True,
        kv_channels=kw["hidden_size"] // kw["num_attention_heads"], attention_output_gate=False,
        num_experts=None, mtp_num_layers=None, moe_ffn_hidden_size=None, moe_latent_size=None,
        moe_shared_expert_intermediate_size=None, moe_router_topk=1, multi_latent_attention=False,
        experimental_attention_variant=None, hybrid_layer_pattern=None, hybrid_override_pattern=None,
        is_hybrid_model=False,
    )


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_flops_per_iteration_matches_megatron(name):
    training = pytest.importorskip("megatron.training.training")
    kw = _kwargs(name)
    global_batch = 16
    shape = argparse.Namespace(**kw)  # the LlamaShape fields flops reads
    ours = flops.training_flops_per_iteration(shape, global_batch)
    try:
        theirs = training.num_floating_point_operations(_megatron_args(kw), global_batch)
    except AttributeError as exc:  # a Megatron version that reads another flag: say which
        pytest.fail(f"megatron's FLOPs function needs another flag in _megatron_args: {exc}")
    # float64 accumulation inside Megatron: 1e-12 relative is ~4 decimal orders above its rounding.
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_flops_grow_with_sequence_only_through_attention():
    kw = _kwargs("llama2_7b")
    short = flops.training_flops_per_token(**kw)
    longer = flops.training_flops_per_token(**{**kw, "seq_length": 2 * kw["seq_length"]})
    # doubling s adds exactly the causal attention term once more: 6 L q s
    assert longer - short == 6 * kw["num_layers"] * kw["hidden_size"] * kw["seq_length"]


def test_tflops_per_gpu_divides_by_time_and_gpus():
    assert flops.tflops_per_gpu(8 * 10**15, step_seconds=2.0, world_size=8) == pytest.approx(500.0)
    with pytest.raises(ValueError, match="step_seconds"):
        flops.tflops_per_gpu(1, step_seconds=0.0, world_size=1)
    with pytest.raises(ValueError, match="world_size"):
        flops.tflops_per_gpu(1, step_seconds=1.0, world_size=0)


def test_flops_rejects_bad_shapes_with_the_field_name():
    kw = _kwargs("tiny_gqa")
    with pytest.raises(ValueError, match="num_attention_heads"):
        flops.training_flops_per_token(**{**kw, "num_attention_heads": 3})
    with pytest.raises(ValueError, match="seq_length"):
        flops.training_flops_per_token(**{**kw, "seq_length": 0})
