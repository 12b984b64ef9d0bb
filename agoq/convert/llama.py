"""LLaMA weights: Hugging Face ``LlamaForCausalLM`` names and layouts <-> Megatron's ``GPTModel`` (TP=1, PP=1).

What differs between the two, and what this module does about it:

* **Fused QKV, per GQA group.** Megatron's ``linear_qkv.weight`` holds, for each of the ``g`` query groups
  in turn, the group's ``n/g`` query heads, then its key head, then its value head (``head_dim`` rows each):
  ``SelfAttention.get_query_key_value_tensors`` views the output as ``[.., g, (n/g + 2) * d]`` and splits
  it that way. HF keeps ``q_proj`` (``n * d`` rows), ``k_proj`` and ``v_proj`` (``g * d`` rows each), and
  its ``repeat_kv`` gives query head ``i`` the key/value head ``i // (n/g)``: the same grouping.
  Tensor parallelism cuts this layout into whole groups, so a TP=1 tensor serves every TP size.
* **Fused gate/up.** Megatron's gated ``linear_fc1.weight`` is ``[gate; up]`` (``glu``: ``silu(x[0]) *
  x[1]`` of ``chunk(2)``); HF has ``gate_proj`` and ``up_proj``. ``linear_fc2`` is ``down_proj``.
* **RoPE.** HF's checkpoints are already permuted for ``rotate_half`` (the halves ``[0, d/2)`` and
  ``[d/2, d)`` rotate together), which is Megatron's ``rotary_interleaved=False`` default: no permutation.
  Base = ``rope_theta``; frequencies ``theta^(-2i/d)`` in both. LLaMA-3's scaled RoPE (``rope_type: llama3`` of
  3.1 / 3.2 / 3.3) is Megatron's ``--use-rope-scaling`` with ``--rope-scaling-factor`` = ``factor``; megatron-core
  fixes the other three values (agoq.ref.rope.LLAMA3_ROPE_FIXED: low 1, high 4, original context 8192, what every
  released LLaMA-3.x has), so a config with other values is refused naming them. Other RoPE types are refused.
* **Norms.** ``input_layernorm`` and ``post_attention_layernorm`` (Megatron: ``pre_mlp_layernorm``) are
  RMSNorm gains, eps = ``rms_norm_eps``; ``model.norm`` is ``decoder.final_layernorm``.
* **Tied or untied head, padded vocabulary.** ``tie_word_embeddings`` is Megatron's
  ``share_embeddings_and_output_weights`` (the trainer's ``untie_embeddings_and_output_weights: false``): a tied
  model keeps one table (no ``output_layer.weight``, no ``lm_head.weight``), an untied one two. Megatron pads the
  vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``; the padded rows are zero (their logits are 0
  until training pushes them down) and are cut on export.
* **Mistral.** ``model_type: mistral`` without a sliding window (``sliding_window: null``) is the LLaMA
  architecture with the same tensor names: it converts as LLaMA (and exports as ``LlamaForCausalLM``); with a
  sliding window it is refused.

No megatron, transformers or safetensors import: state dicts of tensors in, state dicts out.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch

from agoq.plan.shape import ModelShape
from agoq.ref.rope import LLAMA3_ROPE_FIXED

# HF keys that carry no weights (old checkpoints saved RoPE's inverse frequencies)
IGNORED_HF_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class LlamaDims(ModelShape):
    """The architecture both sides agree on: the model's size (agoq.plan.shape.ModelShape; ``vocab_size`` is the real,
    unpadded vocabulary) and the Hugging Face config's other values."""

    rotary_base: int
    norm_epsilon: float
    max_position_embeddings: int
    init_method_std: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # LLaMA-3.1 Instruct: a list, kept as one
    rope_scaling_factor: float | None = None  # LLaMA-3 scaled RoPE (bands LLAMA3_ROPE_FIXED); None: plain RoPE
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def as_dict(self) -> dict:
        return asdict(self)


def dims_from_hf_config(config: dict) -> LlamaDims:
    """Check a LLaMA ``config.json`` (as a dict) against what agoq's model computes; raise naming the key."""
    model_type = config.get("model_type", "llama")
    if model_type not in ("llama", "mistral"):
        raise ValueError(f"config.json: model_type {model_type!r}; 'llama' (LlamaForCausalLM) and 'mistral' without "
                         "a sliding window convert")  # fmt: skip
    if model_type == "mistral" and config.get("sliding_window") is not None:
        raise ValueError(f"config.json: sliding_window = {config['sliding_window']!r} (model_type 'mistral'); agoq's "
                         "LLaMA attends over the whole sequence: only Mistral configs with sliding_window null "
                         "convert")  # fmt: skip
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    checks = {
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
    }
    for key, (value, wanted) in checks.items():
        if value != wanted:
            raise ValueError(f"config.json: {key} = {value!r}; agoq's LLaMA needs {wanted!r}")
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"config.json: head_dim {head_dim} x num_attention_heads {heads} != hidden_size {hidden}; "
                         "agoq's LLaMA uses head_dim = hidden_size / heads")  # fmt: skip
    theta = rope_theta(config)
    if theta != int(theta):
        raise ValueError(f"config.json: rope_theta {theta} is not an integer (agoq's --rotary-base is)")
    return LlamaDims(
        num_layers=config["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads, ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"], rotary_base=int(theta), norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        init_method_std=float(config.get("initializer_range", 0.02)),
        bos_token_id=_token_ids(config, "bos_token_id"), eos_token_id=_token_ids(config, "eos_token_id"),
        rope_scaling_factor=rope_scaling_factor(config), tie_word_embeddings=bool(config.get("tie_word_embeddings")),
    )  # fmt: skip


def _token_ids(config: dict, key: str) -> int | list[int] | None:
    value = config.get(key)
    if isinstance(value, list):
        if not all(isinstance(v, int) for v in value):
            raise ValueError(f"config.json: {key} = {value!r}; expected a token id or a list of token ids")
        return value[0] if len(value) == 1 else list(value)
    return value


def _rope_sections(config: dict) -> list[tuple[str, dict]]:
    """(key, dict) of transformers 5's ``rope_parameters`` and transformers 4's ``rope_scaling``, where present."""
    return [(key, config[key]) for key in ("rope_parameters", "rope_scaling") if config.get(key)]


def rope_theta(config: dict) -> float:
    """``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (transformers 5)."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def rope_scaling_factor(config: dict) -> float | None:
    """LLaMA-3's RoPE scaling factor (``rope_type: llama3``), None for plain RoPE; any other RoPE type, or llama3
    bands other than megatron-core's fixed ones (LLAMA3_ROPE_FIXED), raise naming the key and the values."""
    factors = []
    for key, section in _rope_sections(config):
        kind = section.get("rope_type", section.get("type", "default"))
        if kind in ("default", None):
            continue
        if kind != "llama3":
            raise ValueError(f"config.json: {key}.rope_type {kind!r}; agoq's model has plain RoPE and LLaMA-3's "
                             "scaled RoPE ('llama3') only")  # fmt: skip
        if "factor" not in section:
            raise ValueError(f"config.json: {key} of rope_type 'llama3' has no 'factor'")
        differ = {name: section.get(name) for name, value in LLAMA3_ROPE_FIXED.items()
                  if section.get(name) is None or float(section[name]) != float(value)}
        if differ:
            wanted = ", ".join(f"{name} {value}" for name, value in LLAMA3_ROPE_FIXED.items())
            got = ", ".join(f"{name} {value!r}" for name, value in differ.items())
            raise ValueError(f"config.json: {key} (rope_type 'llama3') has {got}; megatron-core's LLaMA-3 RoPE "
                             f"scaling (--use-rope-scaling) fixes {wanted} (every released LLaMA-3.1 / 3.2 / 3.3) "
                             "and takes only the factor, so this model cannot be reproduced")  # fmt: skip
        factors.append(float(section["factor"]))
    if len(set(factors)) > 1:
        raise ValueError(f"config.json: rope_scaling and rope_parameters give different factors {factors}")
    return factors[0] if factors else None


def hf_rope_scaling(dims: LlamaDims) -> dict | None:
    """``rope_scaling`` of config.json for these dims (None: plain RoPE)."""
    if dims.rope_scaling_factor is None:
        return None
    return {"rope_type": "llama3", "factor": dims.rope_scaling_factor, **LLAMA3_ROPE_FIXED}


def hf_config(dims: LlamaDims, dtype: torch.dtype) -> dict:
    """The ``config.json`` fields of a LlamaForCausalLM with these dims (no biases; tying, RoPE scaling and token
    ids as recorded), in transformers 4's spelling (``rope_theta`` + ``rope_scaling``), which transformers 5
    reads too."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": dims.vocab_size, "hidden_size": dims.hidden_size, "intermediate_size": dims.ffn_hidden_size,
        "num_hidden_layers": dims.num_layers, "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_query_groups, "head_dim": dims.head_dim, "hidden_act": "silu",
        "max_position_embeddings": dims.max_position_embeddings, "initializer_range": dims.init_method_std,
        "rms_norm_eps": dims.norm_epsilon, "rope_theta": float(dims.rotary_base),
        "rope_scaling": hf_rope_scaling(dims), "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": dims.tie_word_embeddings,
        "bos_token_id": dims.bos_token_id, "eos_token_id": dims.eos_token_id,
        "torch_dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
    }  # fmt: skip


def padded_rows(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's embedding rows (agoq.data.tokenizer.padded_vocab_size)."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < weight.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the checkpoint's {weight.shape[0]} rows")
    if rows == weight.shape[0]:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: LlamaDims) -> torch.Tensor:
    """HF q/k/v_proj -> Megatron linear_qkv: per group, its query heads, its key head, its value head."""
    g, d, h = dims.num_query_groups, dims.head_dim, dims.hidden_size
    per_group = dims.num_attention_heads // g
    fused = torch.cat([q.reshape(g, per_group * d, h), k.reshape(g, d, h), v.reshape(g, d, h)], dim=1)
    return fused.reshape((dims.num_attention_heads + 2 * g) * d, h)


def split_qkv(qkv: torch.Tensor, dims: LlamaDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, h = dims.num_query_groups, dims.head_dim, dims.hidden_size
    per_group = dims.num_attention_heads // g
    grouped = qkv.reshape(g, (per_group + 2) * d, h)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def hf_to_megatron(hf: dict[str, torch.Tensor], dims: LlamaDims, padded_vocab: int) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> Megatron GPTModel (TP=1, PP=1) state dict (global layer indices).
    Every HF tensor is used once; an unknown or missing one raises."""
    left = {k: v for k, v in hf.items() if not IGNORED_HF_KEYS.fullmatch(k)}

    def take(key: str) -> torch.Tensor:
        if key not in left:
            raise KeyError(f"HF checkpoint lacks {key}")
        return left.pop(key)

    out = {"embedding.word_embeddings.weight": _pad_rows(take("model.embed_tokens.weight"), padded_vocab)}
    for i in range(dims.num_layers):
        hf_l, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mg + "input_layernorm.weight"] = take(hf_l + "input_layernorm.weight")
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(hf_l + "self_attn.q_proj.weight"), take(hf_l + "self_attn.k_proj.weight"),
            take(hf_l + "self_attn.v_proj.weight"), dims)  # fmt: skip
        out[mg + "self_attention.linear_proj.weight"] = take(hf_l + "self_attn.o_proj.weight")
        out[mg + "pre_mlp_layernorm.weight"] = take(hf_l + "post_attention_layernorm.weight")
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([take(hf_l + "mlp.gate_proj.weight"),
                                                       take(hf_l + "mlp.up_proj.weight")])  # fmt: skip
        out[mg + "mlp.linear_fc2.weight"] = take(hf_l + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    head = left.pop("lm_head.weight", None)
    if dims.tie_word_embeddings:  # one table; a saved lm_head of a tied model must be that table
        if head is not None and not torch.equal(head, hf["model.embed_tokens.weight"]):
            raise ValueError("config.json: tie_word_embeddings is true, but the checkpoint's lm_head.weight differs "
                             "from model.embed_tokens.weight; set tie_word_embeddings to false to keep both")
    elif head is None:
        raise KeyError("HF checkpoint lacks lm_head.weight (config.json: tie_word_embeddings is false)")
    else:
        out["output_layer.weight"] = _pad_rows(head, padded_vocab)
    if left:
        raise KeyError(f"HF checkpoint has tensors agoq's LLaMA does not: {sorted(left)[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(mg: dict[str, torch.Tensor], dims: LlamaDims) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron`: padded vocabulary rows cut; ``lm_head`` only when untied."""
    v = dims.vocab_size
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:v]}
    for i in range(dims.num_layers):
        hf_l, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[hf_l + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
        q, k, vv = split_qkv(mg[m + "self_attention.linear_qkv.weight"], dims)
        out[hf_l + "self_attn.q_proj.weight"], out[hf_l + "self_attn.k_proj.weight"] = q, k
        out[hf_l + "self_attn.v_proj.weight"] = vv
        out[hf_l + "self_attn.o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        out[hf_l + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2)
        out[hf_l + "mlp.gate_proj.weight"], out[hf_l + "mlp.up_proj.weight"] = gate, up
        out[hf_l + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not dims.tie_word_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][:v]
    elif "output_layer.weight" in mg:
        raise ValueError("the checkpoint has an output_layer.weight of its own, but its record says the embeddings are "
                         "tied")
    return {k: t.contiguous() for k, t in out.items()}


def config_yaml(dims: LlamaDims, *, divisible_by: int, source: str, tp: int, padded_vocab: int) -> str:
    """A configs/model-style YAML (scripts/pretrain_llama.py --config) for the converted checkpoint."""
    lines = [
        f"# Converted from the Hugging Face LlamaForCausalLM {source} by python -m agoq.convert hf-to-agoq.",
        f"# Vocabulary: {dims.vocab_size} tokens, {padded_vocab} embedding rows (padded to a multiple of "
        f"{divisible_by} x TP {tp});",
        "#   train with the model's own tokenizer (--tokenizer-model .../tokenizer.json) and a",
        f"#   --tensor-model-parallel-size whose padding gives {padded_vocab} rows; any pipeline layout loads it.",
        f"# Context: max_position_embeddings {dims.max_position_embeddings} (seq_length below; lower it freely).",
        f"num_layers: {dims.num_layers}",
        f"hidden_size: {dims.hidden_size}",
        f"num_attention_heads: {dims.num_attention_heads}",
        f"num_query_groups: {dims.num_query_groups}",
        f"ffn_hidden_size: {dims.ffn_hidden_size}",
        f"seq_length: {dims.max_position_embeddings}",
        f"rotary_base: {dims.rotary_base}",
        f"norm_epsilon: {_yaml_float(dims.norm_epsilon)}",
        f"init_method_std: {_yaml_float(dims.init_method_std)}",
        f"make_vocab_size_divisible_by: {divisible_by}",
    ]
    if dims.rope_scaling_factor is not None:
        fixed = ", ".join(f"{k} {v}" for k, v in LLAMA3_ROPE_FIXED.items())
        lines += [f"# LLaMA-3 scaled RoPE (rope_type llama3; megatron-core fixes {fixed})",
                  "use_rope_scaling: true", f"rope_scaling_factor: {_yaml_float(dims.rope_scaling_factor)}"]
    if dims.tie_word_embeddings:
        lines += ["# tie_word_embeddings: the output layer shares the embedding's weight",
                  "untie_embeddings_and_output_weights: false"]
    return "\n".join(lines) + "\n"


def _yaml_float(value: float) -> str:
    """A float YAML reads back as a float (PyYAML reads ``1e-05`` as a string: it wants ``1.0e-05``)."""
    text = repr(float(value))
    mantissa, _, exponent = text.partition("e")
    if exponent and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text
