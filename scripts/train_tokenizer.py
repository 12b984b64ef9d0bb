"""Train a SentencePiece tokenizer (BPE, byte fallback) on jsonl/txt files or the default stdlib corpus.

Examples (from the repository root, agoq installed with ``pip install -e .``):

    # on your own data: one JSON object per line, text under "text"
    python scripts/train_tokenizer.py --input data/a.jsonl data/b.jsonl --vocab-size 32000 \
        --output data/tokenizer.model
    # on the default corpus (Python's standard library text, capped at 8 MiB)
    python scripts/train_tokenizer.py --vocab-size 4096 --output /tmp/stdlib.model

The model can then be passed to ``scripts/prepare_data.py --tokenizer-model``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from agoq.data.corpus import (
    DEFAULT_MAX_BYTES,
    TXT_MODES,
    check_input_paths,
    collect_stdlib_corpus,
    iter_input_documents,
)
from agoq.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    MODEL_TYPES,
    Tokenizer,
    TokenizerTrainConfig,
    train_sentencepiece,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input", nargs="+", type=Path, help=".jsonl or .txt files; default: the stdlib corpus"
    )
    parser.add_argument("--json-key", default="text", help="key of the text in each jsonl object")
    parser.add_argument(
        "--txt-mode",
        choices=TXT_MODES,
        default="file",
        help="a .txt file is one document ('file') or one per blank-line paragraph",
    )
    parser.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="stdlib corpus cap (no --input)"
    )
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    parser.add_argument(
        "--threads", type=int, default=2, help="trainer threads (BPE result does not depend on it)"
    )
    parser.add_argument("--output", type=Path, required=True, help="where to write the .model file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = TokenizerTrainConfig(
            vocab_size=args.vocab_size, model_type=args.model_type, num_threads=args.threads
        )
        if args.input:
            paths = check_input_paths(args.input)
            texts = (doc.text for doc in iter_input_documents(paths, args.json_key, args.txt_mode))
        else:
            texts = (doc.text for doc in collect_stdlib_corpus(args.max_bytes).documents)
        start = time.perf_counter()
        train_sentencepiece(texts, args.output, config)
    except (ValueError, NotImplementedError, OSError) as err:
        print(f"train_tokenizer.py: error: {err}", file=sys.stderr)
        return 1
    tokenizer = Tokenizer.load(args.output)
    print(
        f"wrote {args.output}: vocab {tokenizer.vocab_size}, eod {tokenizer.eod_id}, pad {tokenizer.pad_id}, "
        f"sha256 {tokenizer.sha256[:16]}, {time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
