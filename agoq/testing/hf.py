"""Test helpers for the Hugging Face doors: a small real-text corpus and a byte-level BPE
``tokenizer.json`` trained on it by the ``tokenizers`` library (optional extra ``[hf]``, imported on use)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

STDLIB_MODULES = ("textwrap.py", "string.py", "shlex.py", "fnmatch.py")


def stdlib_texts() -> list[str]:
    """A few standard-library modules: real prose and code, no download."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text() for name in STDLIB_MODULES]


def train_bpe_tokenizer(out: str | Path, vocab_size: int) -> Path:
    """A LLaMA-3-style tokenizer.json (byte-level BPE; ``<|begin_of_text|>`` = 0, ``<|end_of_text|>`` = 1 as
    special added tokens) of exactly ``vocab_size`` tokens, trained on :func:`stdlib_texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stdlib_texts(), trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"trained {tok.get_vocab_size(with_added_tokens=True)} tokens, asked for {vocab_size}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out
