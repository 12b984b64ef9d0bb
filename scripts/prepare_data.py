"""Tokenise jsonl/parquet/txt files into a Megatron indexed dataset (.bin/.idx); with no --input, build the default.

Inputs: ``.jsonl`` (one JSON object per line, text under --json-key, default "text"), ``.parquet``
(one document per row, text in the column --json-key; needs pyarrow) and ``.txt``
(``--txt-mode file``: one document per file, the default; ``paragraph``: one per blank-line-separated
paragraph). Each document becomes one sequence followed by the tokenizer's end-of-document id.

Examples (from the repository root, agoq installed with ``pip install -e .``):

    # the default dataset (Python's standard library text + a 4096-piece tokenizer trained on it),
    # cached in $AGOQ_CACHE or ~/.cache/agoq/data; prints its paths
    python scripts/prepare_data.py
    # your data with an existing tokenizer (e.g. LLaMA's tokenizer.model), 4 worker processes
    python scripts/prepare_data.py --input data/a.jsonl data/b.jsonl --tokenizer-model tokenizer.model \
        --output-prefix data/mydata --workers 4
    # your data, training a 32000-piece tokenizer on it first (written to data/mydata.tokenizer.model)
    python scripts/prepare_data.py --input data/book.txt --txt-mode paragraph --vocab-size 32000 \
        --output-prefix data/mydata

Output: ``<output-prefix>.bin`` and ``<output-prefix>.idx``, and ``<output-prefix>.tokenizer.json`` (which tokenizer
wrote them; pretrain_llama.py checks it against --tokenizer-model); pass ``<output-prefix>`` as the data path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from agoq.data.corpus import DEFAULT_MAX_BYTES, TXT_MODES, check_input_paths, iter_input_documents
from agoq.data.tokenizer import MODEL_TYPES, Tokenizer, TokenizerTrainConfig, train_sentencepiece
from agoq.train.data import build_indexed_dataset, default_cache_dir, ensure_default_dataset

PROGRESS_EVERY_DOCS = 1000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input", nargs="+", type=Path, help=".jsonl, .parquet or .txt files; none: the default dataset"
    )
    parser.add_argument("--json-key", default="text", help="jsonl key / parquet column of the text")
    parser.add_argument(
        "--txt-mode",
        choices=TXT_MODES,
        default="file",
        help="a .txt file is one document ('file') or one per blank-line paragraph",
    )
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer-model", type=Path,
        help="an existing tokenizer: SentencePiece .model (ours or LLaMA-2's) or Hugging Face tokenizer.json "
             "(LLaMA-3's; needs the [hf] extra)",
    )
    tok.add_argument("--vocab-size", type=int, help="train a tokenizer with this many pieces on the inputs")
    parser.add_argument("--tokenizer-type", choices=MODEL_TYPES, default="bpe", help="with --vocab-size")
    parser.add_argument("--tokenizer-sample-sentences", type=int, default=0,
                        help="with --vocab-size: train on this many seeded-random sentences (0 = all; large corpora)")
    parser.add_argument("--output-prefix", type=Path, help="write <prefix>.bin/.idx (required with --input)")
    parser.add_argument("--workers", type=int, default=1, help="tokeniser processes (output order is kept)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="default dataset cache (no --input); default $AGOQ_CACHE or ~/.cache/agoq/data",
    )
    parser.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="default corpus cap in bytes"
    )
    args = parser.parse_args(argv)
    if args.input and args.output_prefix is None:
        parser.error("--output-prefix is required with --input")
    if args.input and args.tokenizer_model is None and args.vocab_size is None:
        parser.error("give --tokenizer-model PATH or --vocab-size N (to train one on the inputs)")
    if not args.input and (args.output_prefix or args.tokenizer_model):
        parser.error(
            "without --input the default dataset is built in --cache-dir; "
            "--output-prefix/--tokenizer-model need --input"
        )
    return args


class Progress:
    """A one-line progress report on stderr, at most about once a second."""

    def __init__(self):
        self.start = self.last = time.perf_counter()

    def __call__(self, num_docs: int, num_tokens: int, num_bytes: int) -> None:
        now = time.perf_counter()
        if now - self.last < 1.0:
            return
        self.last = now
        rate = num_bytes / max(now - self.start, 1e-9) / 2**20
        print(
            f"\r{num_docs} documents, {num_tokens} tokens, {num_bytes / 2**20:.1f} MiB ({rate:.1f} MiB/s)",
            end="",
            file=sys.stderr,
            flush=True,
        )


def prepare_user_data(args: argparse.Namespace) -> dict:
    paths = check_input_paths(args.input)

    def texts():
        return (doc.text for doc in iter_input_documents(paths, args.json_key, args.txt_mode))

    if args.tokenizer_model is not None:
        tokenizer_path = args.tokenizer_model
    else:
        tokenizer_path = Path(f"{args.output_prefix}.tokenizer.model")
        config = TokenizerTrainConfig(vocab_size=args.vocab_size, model_type=args.tokenizer_type,
                                      input_sentence_size=args.tokenizer_sample_sentences)
        train_sentencepiece(texts(), tokenizer_path, config)
    tokenizer = Tokenizer.load(tokenizer_path)
    stats = build_indexed_dataset(
        texts(),
        tokenizer,
        args.output_prefix,
        workers=args.workers,
        progress=Progress(),
        progress_every=PROGRESS_EVERY_DOCS,
    )
    print(file=sys.stderr)
    return {
        "prefix": str(args.output_prefix),
        "tokenizer_model": str(tokenizer_path),
        "documents": stats.num_documents,
        "tokens": stats.num_tokens,
        "text_bytes": stats.num_text_bytes,
        "skipped_empty": stats.num_skipped_empty,
        "seconds": round(stats.seconds, 2),
    }


def prepare_default_data(args: argparse.Namespace) -> dict:
    cache_dir = args.cache_dir or Path(os.environ.get("AGOQ_CACHE") or default_cache_dir())
    tokenizer_config = TokenizerTrainConfig(vocab_size=args.vocab_size) if args.vocab_size else None
    paths = ensure_default_dataset(cache_dir, max_bytes=args.max_bytes, tokenizer_config=tokenizer_config)
    manifest = json.loads(paths.manifest.read_text())
    dataset = manifest["dataset"]
    return {
        "prefix": str(paths.prefix),
        "tokenizer_model": str(paths.tokenizer_model),
        "manifest": str(paths.manifest),
        "documents": dataset["num_documents"],
        "tokens": dataset["num_tokens"],
        "text_bytes": dataset["num_text_bytes"],
        "build_seconds": round(dataset["seconds"] + manifest["tokenizer"]["train_seconds"], 2),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = prepare_user_data(args) if args.input else prepare_default_data(args)
    except (ValueError, NotImplementedError, OSError) as err:
        print(f"prepare_data.py: error: {err}", file=sys.stderr)
        return 1
    for key, value in summary.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
