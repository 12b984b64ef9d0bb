"""The linear shapes the FP8 benchmarks time (benchmarks/bench_fp8.py, benchmarks/bench_fp8_host.py)."""

from __future__ import annotations

LLAMA_1B = dict(hidden=2048, heads=32, kv_heads=8, head_dim=64)  # Llama-3.2-1B attention
FFNS = (5632, 8192)  # LLaMA's 8/3 ratio (5632 = 2.75 x 2048) and Llama-3.2-1B's 8192


def linear_shapes(hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of one layer's linears."""
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "proj": (hidden, heads * head_dim),
            "fc1": (2 * ffn, hidden), "fc2": (hidden, ffn)}
