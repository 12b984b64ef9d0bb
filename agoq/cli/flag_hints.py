"""What an unknown flag of ``scripts/pretrain_llama.py`` probably meant: the closest real flag (' (did you mean
--agoq-policy?)'), or for a Megatron-LM ``pretrain_gpt.py`` flag what this LLaMA-only trainer does instead.
"""

from __future__ import annotations

import difflib

from agoq.config import flag_for

_LLAMA_ALWAYS = "the model is always LLaMA on megatron-core's local layers (RMSNorm, SwiGLU, RoPE, no biases)"
# Megatron-LM pretrain_gpt.py flags a Megatron user passes out of habit, which this LLaMA-only trainer does not take
MEGATRON_LM_ONLY = {
    "--bf16": "bf16 is the default here (--fp32 for fp32)",
    "--fp16": "fp16 parameters are not supported here (bf16 is the default)",
    "--group-query-attention": "GQA follows --num-query-groups",
    "--max-position-embeddings": "RoPE positions follow --seq-length",
    "--tokenizer-type": "the type follows the --tokenizer-model file (SentencePiece .model or tokenizer.json)",
    **{flag: _LLAMA_ALWAYS for flag in ("--swiglu", "--normalization", "--disable-bias-linear", "--use-mcore-models",
                                        "--position-embedding-type",
                                        "--transformer-impl", "--use-rotary-position-embeddings")},
}

TE_FP8_HINT = (" (agoq's FP8 linears take no Transformer Engine recipe: Transformer Engine's FP8 runs through "
               "scripts/pretrain_gpt_agoq.py with --transformer-impl transformer_engine --fp8-format hybrid "
               f"--fp8-recipe delayed, docs/megatron_lm.md; or use {flag_for('fp8.recipe')} delayed)")


def unknown_flag_hints(words: list[str], flags) -> str:
    """For the unknown flags among ``words``: what a Megatron-LM-only flag means here, else the closest real flag
    (' (did you mean --agoq-policy?)')."""
    names = [w.split("=", 1)[0] for w in words if w.startswith("--")]
    megatron = [f"{n}: {MEGATRON_LM_ONLY[n]}" for n in names if n in MEGATRON_LM_ONLY]
    known = [f for f in flags if f.startswith("--") and f != "--help"]
    hints = []
    for name in (n for n in names if n not in MEGATRON_LM_ONLY):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hints += [close[0] if len(names) == 1 else f"{close[0]} for {name}"] if close else []
    text = f" (did you mean {', '.join(hints)}?)" if hints else ""
    if megatron:
        text += (f" (Megatron-LM flags this LLaMA-only trainer does not take: {'; '.join(megatron)}. Drop them, or "
                 "use scripts/pretrain_gpt_agoq.py, which takes every Megatron-LM flag: docs/megatron_lm.md)")
    return text
