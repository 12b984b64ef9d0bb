"""The size of a LLaMA-family decoder (GQA attention, SwiGLU MLP, RMSNorm, no biases): the one declaration of its six
fields. The planner works from it; the plugin's model shape (agoq.megatron.model.LlamaShape) and the converter's
Hugging Face dimensions (agoq.convert.llama.LlamaDims) extend it with what they need besides, and checkpoint records
list these fields from :data:`SHAPE_FIELDS`. Pure data: no torch, no megatron."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    """The embedding's rows: the planner's is the tokenizer's vocabulary before padding; each extension says its own."""

    @classmethod
    def of(cls, shape) -> ModelShape:
        """The size of ``shape``, any object with these fields (an extension's instance: the planner's own type)."""
        return cls(**{name: getattr(shape, name) for name in SHAPE_FIELDS})

    def layer_params(self) -> int:
        """Parameters of one decoder layer: QKV, attention output, SwiGLU's three matrices, two norm gains."""
        h, d = self.hidden_size, self.hidden_size // self.num_attention_heads
        qkv = h * d * (self.num_attention_heads + 2 * self.num_query_groups)
        return qkv + h * h + 3 * h * self.ffn_hidden_size + 2 * h


SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelShape))
