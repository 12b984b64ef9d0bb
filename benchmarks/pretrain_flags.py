"""The flags the benchmarks/bench_pretrain.py suites share: model shapes, the common schedule, the model files'
architecture keys and LLaMA-3's vocabulary (pretrain_suites.py, pretrain_suites_scale.py and the runner import them).

benchmarks/ is not a package: the runner puts this folder on ``sys.path`` and imports these modules by name.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Shapes: LLaMA-style, bf16, seq 2048. "350m" is a GPT-3-Medium-sized body (24 x 1024, the issue's
# 350M example); "1b" is the LLaMA-3.2-1B body (16 x 2048, 32 heads, 8 KV groups, ffn 8192).
SHAPES = {
    "350m": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--num-query-groups", "16", "--ffn-hidden-size", "2816"],
    "1b": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32",
           "--num-query-groups", "8", "--ffn-hidden-size", "8192"],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--ffn-hidden-size", "192"],
}
COMMON = ["--seq-length", "2048", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--log-interval", "1"]
MODEL_DIR = REPO_ROOT / "configs" / "model"
# The trainer flags of a model file's architecture (its layout, batch and schedule keys are the suite's to set).
ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "rotary_base",
             "norm_epsilon")
# LLaMA-3's vocabulary (meta-llama/Meta-Llama-3-8B config.json vocab_size; configs/model/llama3-8b.yaml). The
# suites reach it without LLaMA-3's tokenizer (the GPU machines reach no network) by padding the built-in
# corpus's tokenizer (agoq.data.tokenizer.DEFAULT_VOCAB_SIZE 4096 rows) to a multiple of 128,256 at TP=1: the
# embedding, the output layer and the logits have the real 128,256 rows; the token ids stay below 4096.
LLAMA3_VOCAB = 128256
REAL_VOCAB = ["--make-vocab-size-divisible-by", str(LLAMA3_VOCAB)]


def arch_flags(model: str) -> list[str]:
    """``--num-layers ...`` of configs/model/<model>.yaml's architecture (ARCH_KEYS)."""
    import yaml

    cfg = yaml.safe_load((MODEL_DIR / f"{model}.yaml").read_text())
    return [arg for key in ARCH_KEYS for arg in ("--" + key.replace("_", "-"), str(cfg[key]))]
