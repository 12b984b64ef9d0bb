"""agoq.convert.llama: the HF <-> Megatron LLaMA mapping as plain torch (no megatron, no transformers).

The logits of a converted model against transformers are in tests/megatron/test_hf_convert.py; these pin
the layouts themselves: Megatron's split of the fused QKV (SelfAttention.get_query_key_value_tensors: view
[.., g, (n/g + 2) d], split n/g*d | d | d), the [gate; up] order of fc1, padding, and the config checks.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from agoq.convert import llama

DIMS = llama.LlamaDims(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                       vocab_size=10, rotary_base=10000, norm_epsilon=1e-5, max_position_embeddings=32)
HF_CONFIG = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 10, "rms_norm_eps": 1e-6,
             "rope_theta": 500000.0, "max_position_embeddings": 32}


def _hf_state(dims: llama.LlamaDims, tied: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d, f = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    shapes = {"model.embed_tokens.weight": (dims.vocab_size, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (dims.vocab_size, h)
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (dims.num_attention_heads * d, h),
                   p + "self_attn.k_proj.weight": (dims.num_query_groups * d, h),
                   p + "self_attn.v_proj.weight": (dims.num_query_groups * d, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f)}  # fmt: skip
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_fused_qkv_splits_as_megatron_attention_does():
    """Megatron's view of linear_qkv's output: per group, its query heads, its key, its value; HF's repeat_kv
    gives query head i the key/value head i // (n/g). Project one input through both and compare per head."""
    hf = _hf_state(DIMS)
    x = torch.randn(3, DIMS.hidden_size)
    qkv = llama.fuse_qkv(hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"],
                         hf["model.layers.0.self_attn.v_proj.weight"], DIMS)  # fmt: skip
    g, d, per = DIMS.num_query_groups, DIMS.head_dim, DIMS.num_attention_heads // DIMS.num_query_groups
    mixed = (x @ qkv.T).view(3, g, (per + 2) * d)
    query, key, value = torch.split(mixed, [per * d, d, d], dim=2)
    q_hf = (x @ hf["model.layers.0.self_attn.q_proj.weight"].T).view(3, DIMS.num_attention_heads, d)
    k_hf = (x @ hf["model.layers.0.self_attn.k_proj.weight"].T).view(3, g, d)
    v_hf = (x @ hf["model.layers.0.self_attn.v_proj.weight"].T).view(3, g, d)
    for head in range(DIMS.num_attention_heads):
        group = head // per
        torch.testing.assert_close(query[:, group].reshape(3, per, d)[:, head % per], q_hf[:, head], rtol=0, atol=0)
        torch.testing.assert_close(key[:, group], k_hf[:, group], rtol=0, atol=0)
        torch.testing.assert_close(value[:, group], v_hf[:, group], rtol=0, atol=0)


def test_fc1_is_gate_then_up():
    """Megatron's glu: silu(chunk 0) * chunk 1 of linear_fc1's output = HF's silu(gate(x)) * up(x)."""
    hf = _hf_state(DIMS)
    mg = llama.hf_to_megatron(hf, DIMS, padded_vocab=16)
    x = torch.randn(3, DIMS.hidden_size)
    a, b = (x @ mg["decoder.layers.1.mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
    want = torch.nn.functional.silu(x @ hf["model.layers.1.mlp.gate_proj.weight"].T) * (
        x @ hf["model.layers.1.mlp.up_proj.weight"].T)
    # a wider matmul than HF's two: other fp32 summation blocking (a swapped order is off by O(1))
    torch.testing.assert_close(torch.nn.functional.silu(a) * b, want, rtol=1e-6, atol=1e-6)


def test_round_trip_is_exact_and_pads_with_zero_rows():
    hf = _hf_state(DIMS)
    mg = llama.hf_to_megatron(hf, DIMS, padded_vocab=16)
    assert mg["embedding.word_embeddings.weight"].shape == (16, 16)
    assert not mg["output_layer.weight"][10:].any() and not mg["embedding.word_embeddings.weight"][10:].any()
    back = llama.megatron_to_hf(mg, DIMS)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], v) for k, v in hf.items())


def test_tied_embeddings_stay_one_table():
    """tie_word_embeddings: Megatron's shared weight, no output_layer.weight (it used to be copied: the model grew by
    vocab x hidden and the two drifted apart in training); the export has no lm_head, as transformers saves it."""
    tied = llama.LlamaDims(**{**DIMS.as_dict(), "tie_word_embeddings": True})
    hf = _hf_state(tied, tied=True)
    mg = llama.hf_to_megatron(hf, tied, padded_vocab=16)
    assert "output_layer.weight" not in mg
    assert sum(t.numel() for t in mg.values()) == sum(t.numel() for t in hf.values()) + 6 * 16  # the 6 padded rows
    back = llama.megatron_to_hf(mg, tied)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], v) for k, v in hf.items())
    # a tied config whose files still hold lm_head: accepted when it is the embedding, refused when it differs
    llama.hf_to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}, tied, 16)
    with pytest.raises(ValueError, match="tie_word_embeddings is true, but the checkpoint's lm_head.weight differs"):
        llama.hf_to_megatron({**hf, "lm_head.weight": torch.zeros(10, 16)}, tied, 16)
    with pytest.raises(KeyError, match="lacks lm_head.weight .config.json: tie_word_embeddings is false"):
        llama.hf_to_megatron(hf, DIMS, 16)  # untied config, no lm_head in the files
    with pytest.raises(ValueError, match="output_layer.weight of its own"):
        llama.megatron_to_hf({**mg, "output_layer.weight": mg["embedding.word_embeddings.weight"]}, tied)


def test_unknown_and_missing_tensors_are_errors():
    hf = _hf_state(DIMS)
    with pytest.raises(KeyError, match="does not"):
        llama.hf_to_megatron({**hf, "model.layers.0.self_attn.q_proj.bias": torch.zeros(16)}, DIMS, 16)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="lacks model.layers.1.mlp.up_proj.weight"):
        llama.hf_to_megatron(hf, DIMS, 16)
    old = {**_hf_state(DIMS), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(2)}  # ignored
    llama.hf_to_megatron(old, DIMS, 16)


def test_config_mapping_and_yaml():
    dims = llama.dims_from_hf_config(HF_CONFIG)
    assert (dims.num_query_groups, dims.rotary_base, dims.norm_epsilon, dims.ffn_hidden_size) == (2, 500000, 1e-6, 24)
    v5 = {**HF_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}  # transformers 5 layout
    del v5["rope_theta"]
    assert llama.dims_from_hf_config(v5).rotary_base == 1_000_000
    text = llama.config_yaml(dims, divisible_by=128, source="x", tp=1, padded_vocab=128)
    values = yaml.safe_load(text)
    assert values["norm_epsilon"] == 1e-6 and isinstance(values["norm_epsilon"], float)
    assert values == {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "num_query_groups": 2,
                      "ffn_hidden_size": 24, "seq_length": 32, "rotary_base": 500000, "norm_epsilon": 1e-6,
                      "init_method_std": 0.02, "make_vocab_size_divisible_by": 128}  # fmt: skip
    assert llama.hf_config(dims, torch.bfloat16)["rope_theta"] == 500000.0


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_tying_and_eos_lists_map():
    """LLaMA-3.1-style config.json (transformers 4: rope_scaling; 5: rope_parameters) -> factor, tying, eos list; and
    back to config.json and the model YAML (Megatron-LM's flag names)."""
    eos = [128001, 128008, 128009]
    v4 = {**HF_CONFIG, "rope_scaling": LLAMA31_ROPE, "tie_word_embeddings": True, "eos_token_id": eos,
          "bos_token_id": 128000}
    dims = llama.dims_from_hf_config(v4)
    assert (dims.rope_scaling_factor, dims.tie_word_embeddings, dims.eos_token_id) == (8.0, True, eos)
    v5 = {**v4, "rope_parameters": {**LLAMA31_ROPE, "factor": 32.0, "rope_theta": 500000.0}}
    del v5["rope_scaling"], v5["rope_theta"]
    assert llama.dims_from_hf_config(v5).rope_scaling_factor == 32.0
    config = llama.hf_config(dims, torch.float32)
    assert config["rope_scaling"] == LLAMA31_ROPE and config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == [128001, 128008, 128009]
    assert llama.dims_from_hf_config(config) == dims  # config.json -> dims -> config.json: nothing lost
    values = yaml.safe_load(llama.config_yaml(dims, divisible_by=128, source="x", tp=1, padded_vocab=128))
    assert (values["use_rope_scaling"], values["rope_scaling_factor"]) == (True, 8.0)
    assert values["untie_embeddings_and_output_weights"] is False
    plain = llama.dims_from_hf_config({**HF_CONFIG, "rope_scaling": {"rope_type": "default"}})
    assert plain.rope_scaling_factor is None and llama.hf_config(plain, torch.float32)["rope_scaling"] is None
    assert "use_rope_scaling" not in llama.config_yaml(plain, divisible_by=128, source="x", tp=1, padded_vocab=128)


def test_mistral_without_sliding_window_converts_as_llama():
    mistral = {**HF_CONFIG, "model_type": "mistral", "sliding_window": None}
    assert llama.dims_from_hf_config(mistral) == llama.dims_from_hf_config(HF_CONFIG)
    assert llama.dims_from_hf_config({k: v for k, v in mistral.items() if k != "sliding_window"}).num_layers == 2


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {**LLAMA31_ROPE, "low_freq_factor": 2.0}},
     r"rope_scaling .rope_type 'llama3'. has low_freq_factor 2.0; megatron-core's LLaMA-3 RoPE scaling "
     r"\(--use-rope-scaling\) fixes low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192"),
    ({"rope_scaling": {**LLAMA31_ROPE, "original_max_position_embeddings": 4096, "high_freq_factor": 8.0}},
     "has high_freq_factor 8.0, original_max_position_embeddings 4096"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "has no 'factor'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type 'linear'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 8}, "head_dim"),
    ({"model_type": "qwen2"}, "model_type 'qwen2'; 'llama' .LlamaForCausalLM. and 'mistral' without a sliding window"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window = 4096 .model_type 'mistral'"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        llama.dims_from_hf_config({**HF_CONFIG, **change})
