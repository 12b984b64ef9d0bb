"""The model's shape the planner works from (LLaMA: GQA attention, SwiGLU MLP, untied embedding and LM head)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int

    def layer_params(self) -> int:
        h, d = self.hidden_size, self.hidden_size // self.num_attention_heads
        qkv = h * d * (self.num_attention_heads + 2 * self.num_query_groups)
        return qkv + h * h + 3 * h * self.ffn_hidden_size + 2 * h
