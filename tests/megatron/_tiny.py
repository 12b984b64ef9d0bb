"""The tiny LLaMA of the in-process megatron-core tests, one definition shared by the test files (issue 20 item 5:
it was copied into five of them).

2 layers, hidden 64, GQA 4 heads / 2 KV groups, SwiGLU FFN 128, sequence 32, vocabulary 128: every GEMM dim a
multiple of 16, q and kv widths different, small enough for 2-4 gloo ranks on a 2-core CPU. A test that needs
another size says which field differs: ``tiny_shape(num_layers=4)``.
"""

from __future__ import annotations

TINY_SEQ = 32
TINY_VOCAB = 128
TINY_SHAPE_KW = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                     seq_length=TINY_SEQ, vocab_size=TINY_VOCAB)


def tiny_shape(**overrides):
    """``agoq.megatron.model.LlamaShape`` of the tiny model, with ``overrides`` (LlamaShape field names) applied.
    megatron is imported here, not at module import, so spawned ranks and CPU-only collection stay light."""
    from agoq.megatron.model import LlamaShape

    return LlamaShape(**{**TINY_SHAPE_KW, **overrides})
