"""Tokenizers: training a small SentencePiece one on a corpus, loading any SentencePiece ``tokenizer.model``
or Hugging Face ``tokenizers`` file (``tokenizer.json``, e.g. LLaMA-3's 128k BPE; :class:`HFTokenizer`).

Training settings follow LLaMA's SentencePiece recipe where it matters for code and prose: BPE,
``byte_fallback`` (every string encodes, unknown characters become byte pieces), identity
normalisation and no whitespace squeezing (indentation survives, decode(encode(x)) == x), split digits.
Special ids: ``<unk>``=0, ``<s>``=1, ``</s>``=2 (used as end-of-document), ``<pad>``=3.

Determinism (measured with sentencepiece 0.2.x, 2026-05, 2-core CPU): BPE training on all input
sentences (``input_sentence_size=0``, no sampling) gives the same pieces and scores for 1 and 2 threads
and across runs. The seed is still set for the sampling path (``input_sentence_size > 0``).

No torch, no megatron, no environment reads; the ``tokenizers`` package (optional extra ``[hf]``) is
imported only when a ``tokenizer.json`` is loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import multiprocessing
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

# 4096 pieces: small enough that a tiny model's embedding is cheap and BPE training on the 8 MiB default
# corpus takes ~1.5 s on 2 cores (measured); 256 of them are byte-fallback pieces.
DEFAULT_VOCAB_SIZE = 4096
# 256 byte pieces + 4 specials + room for the corpus' characters; SentencePiece fails below this.
MIN_VOCAB_SIZE = 320
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# SentencePiece's default longest training sentence (bytes); longer lines are skipped by the trainer.
MAX_SENTENCE_BYTES = 4192
# Megatron pads the embedding to a multiple of make_vocab_size_divisible_by (default 128) times TP
# (megatron/training/tokenizer: _vocab_size_with_padding).
MEGATRON_VOCAB_DIVISIBLE_BY = 128
MODEL_TYPES = ("bpe", "unigram")
DEFAULT_SEED = 1234


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainConfig:
    """Options of :func:`train_sentencepiece` (also recorded in the default dataset's cache key)."""

    vocab_size: int = DEFAULT_VOCAB_SIZE
    """Number of pieces, including the 4 specials and 256 byte-fallback pieces."""
    model_type: str = "bpe"
    """'bpe' (fast: ~1.5 s on 8 MiB) or 'unigram' (~20 s on 8 MiB, 2 cores)."""
    character_coverage: float = 0.9995
    """Fraction of characters covered by their own piece; the rest fall back to bytes."""
    input_sentence_size: int = 0
    """Train on a seeded sample of this many lines; 0 uses every line (deterministic, the default)."""
    seed: int = DEFAULT_SEED
    """Seed for SentencePiece's sentence sampling."""
    num_threads: int = 2
    """Trainer threads; the result does not depend on it for BPE (measured)."""

    def __post_init__(self):
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={self.vocab_size} is below {MIN_VOCAB_SIZE} (256 byte pieces + "
                "specials + characters); pick e.g. 512 for tests or 4096+ for training"
            )
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


def iter_training_sentences(texts: Iterable[str]) -> Iterator[str]:
    """SentencePiece trains on lines: every non-blank line of every text, in order."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(texts: Iterable[str], out_path: Path, config: TokenizerTrainConfig) -> Path:
    """Train a SentencePiece model on ``texts`` and write it atomically to ``out_path``."""
    out_path = Path(out_path)
    spm.set_random_generator_seed(config.seed)
    model_buf = io.BytesIO()
    input_errors: list[BaseException] = []

    def sentences() -> Iterator[str]:
        # SentencePiece turns exceptions raised by the iterator into RuntimeError("INTERNAL: ...");
        # keep the original (e.g. "file.jsonl:7: invalid JSON") to re-raise it unchanged.
        try:
            yield from iter_training_sentences(texts)
        except BaseException as err:
            input_errors.append(err)
            raise

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model_buf,
            vocab_size=config.vocab_size,
            model_type=config.model_type,
            character_coverage=config.character_coverage,
            input_sentence_size=config.input_sentence_size,
            shuffle_input_sentence=config.input_sentence_size > 0,
            num_threads=config.num_threads,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=MAX_SENTENCE_BYTES,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            minloglevel=2,
        )
    except RuntimeError as err:
        if input_errors:
            raise input_errors[0] from None
        raise ValueError(
            f"SentencePiece training failed: {err}. If the vocabulary is too large for the "
            "corpus, lower vocab_size or give more text"
        ) from err
    _write_atomic(out_path, model_buf.getvalue())
    return out_path


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Tokenizer:
    """A loaded SentencePiece model (ours or any other, e.g. LLaMA's ``tokenizer.model``).

    ``eod_id`` is the model's ``</s>`` id, appended after each document; ``pad_id`` is -1 when the
    model has no pad piece (LLaMA). Pickles as the model bytes, so worker processes can use it.
    """

    def __init__(self, model_bytes: bytes, path: Path | None = None):
        self._model_bytes = bytes(model_bytes)
        self.path = Path(path) if path is not None else None
        self._sp = spm.SentencePieceProcessor(model_proto=self._model_bytes)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """A SentencePiece ``.model``, or a Hugging Face ``tokenizers`` JSON file (an :class:`HFTokenizer`)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer model {path} not found; train one with scripts/train_tokenizer.py")
        data = path.read_bytes()
        if is_hf_tokenizer_file(data):
            return HFTokenizer.load_file(path, data)
        _refuse_broken_json(path, data)
        if not data:  # sentencepiece "loads" empty bytes as a model of 0 pieces
            raise ValueError(f"tokenizer model {path} is empty; pass the SentencePiece .model the data was "
                             "prepared with (or train one with scripts/train_tokenizer.py)")
        try:
            tokenizer = cls(data, path)
        except RuntimeError as err:
            raise ValueError(f"{path} is not a SentencePiece model ({err})") from err
        if tokenizer.vocab_size == 0:
            raise ValueError(f"tokenizer model {path} has no pieces; pass a trained SentencePiece .model")
        return tokenizer

    def __getstate__(self):
        return {"model_bytes": self._model_bytes, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["model_bytes"], state["path"])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(
                f"tokenizer {self.path} has no </s> piece to mark end of document; "
                "train one with scripts/train_tokenizer.py"
            )
        return eos

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def model_bytes(self) -> bytes:
        return self._model_bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._model_bytes).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))


def _refuse_broken_json(path: Path, data: bytes) -> None:
    """A file that is meant to be JSON (``*.json``, or text starting with ``{``) but is not a Hugging Face
    tokenizers file: say what is wrong with it as JSON (SentencePiece models are binary protobuf, never JSON), not
    "not a SentencePiece model"."""
    if path.suffix != ".json" and data.lstrip()[:1] != b"{":
        return
    try:
        obj = json.loads(data)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 JSON file ({err}); a Hugging Face tokenizer.json is UTF-8 text") \
            from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}:{err.colno}: invalid JSON ({err.msg}); the tokenizer.json is damaged "
                         "or truncated: copy it again from the model's repository") from None
    keys = "'model' (an object) and 'added_tokens'"
    found = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
    raise ValueError(f"{path}: valid JSON, but not a Hugging Face tokenizers file (it needs {keys}; found {found}); "
                     "pass the model's tokenizer.json or a SentencePiece .model")


def is_hf_tokenizer_file(data: bytes) -> bool:
    """A Hugging Face ``tokenizers`` file: a JSON object with a ``model`` object (SentencePiece models are
    protobuf, never JSON; agoq's ``<prefix>.tokenizer.json`` data record has no ``model``)."""
    if not data.lstrip()[:1] == b"{":
        return False
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("model"), dict) and "added_tokens" in obj


# End-of-document / beginning-of-sequence tokens of common HF tokenizers, tried in order when no
# tokenizer_config.json names them: LLaMA-1/2 and Mistral, LLaMA-3, GPT-2/NeoX, Gemma.
HF_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
HF_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``), with the interface of :class:`Tokenizer`.

    ``vocab_size`` counts the added (special) tokens: LLaMA-3's file gives 128,256, the rows of its
    embedding. Special ids come from the files: ``eos_token`` / ``bos_token`` / ``pad_token`` of a
    ``tokenizer_config.json`` next to it (as ``transformers`` ships them), else the first special added
    token named in ``HF_EOS_NAMES`` / ``HF_BOS_NAMES`` (LLaMA-3: ``<|end_of_text|>`` = 128001 ends a
    document, ``<|begin_of_text|>`` = 128000); pad is -1 unless the config names one. Documents are encoded
    without the file's template (no BOS added), as SentencePiece documents are. Pickles as the file's bytes
    and the resolved ids.
    """

    def __init__(self, model_bytes: bytes, path: Path | None = None, *, special: dict | None = None):
        from tokenizers import Tokenizer as _HFTokenizer  # optional extra [hf]

        self._model_bytes = bytes(model_bytes)
        self.path = Path(path) if path is not None else None
        self._tok = _HFTokenizer.from_str(self._model_bytes.decode("utf-8"))
        self._special = dict(special) if special is not None else self._resolve_special(self.path)

    @classmethod
    def load_file(cls, path: Path, data: bytes) -> HFTokenizer:
        try:
            tokenizer = cls(data, path)
        except ImportError as err:
            raise ValueError(f"{path} is a Hugging Face tokenizers file; install the optional extra: "
                             "pip install 'agoq[hf]' (the tokenizers package)") from err
        except Exception as err:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise ValueError(f"{path} is not a loadable Hugging Face tokenizers file ({err})") from err
        if tokenizer.vocab_size == 0:
            raise ValueError(f"tokenizer {path} has no tokens")
        return tokenizer

    def _resolve_special(self, path: Path | None) -> dict:
        config = {}
        if path is not None and (path.parent / "tokenizer_config.json").is_file():
            config = json.loads((path.parent / "tokenizer_config.json").read_text())
        added = [t["content"] for t in json.loads(self._model_bytes).get("added_tokens", []) if t.get("special")]
        special = {}
        for role, names in (("eos", HF_EOS_NAMES), ("bos", HF_BOS_NAMES), ("pad", ())):
            name = config.get(f"{role}_token")
            name = name.get("content") if isinstance(name, dict) else name
            if name is None:
                name = next((n for n in names if n in added), None)
            token_id = self._tok.token_to_id(name) if name is not None else None
            special[role] = -1 if token_id is None else token_id
        return special

    def __getstate__(self):
        return {"model_bytes": self._model_bytes, "path": self.path, "special": self._special}

    def __setstate__(self, state):
        self.__init__(state["model_bytes"], state["path"], special=state["special"])

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        if self._special["eos"] < 0:
            raise ValueError(
                f"tokenizer {self.path} names no end-of-document token: put a tokenizer_config.json with "
                f"\"eos_token\" next to it, or add one of {', '.join(HF_EOS_NAMES)} as a special token"
            )
        return self._special["eos"]

    @property
    def pad_id(self) -> int:
        return self._special["pad"]

    @property
    def bos_id(self) -> int:
        return self._special["bos"]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))


def model_vocab_size(tokenizer_vocab: int, vocab_size: int | None, tokenizer: str = "the tokenizer") -> int:
    """The model's vocabulary before padding: ``vocab_size`` (the trainer's --vocab-size) where given, else the
    tokenizer's; a --vocab-size below the tokenizer's is refused (its ids would index past the embedding)."""
    if vocab_size is None:
        return tokenizer_vocab
    if vocab_size < tokenizer_vocab:
        raise ValueError(f"--vocab-size {vocab_size} is smaller than {tokenizer}'s {tokenizer_vocab} entries: its ids "
                         f"would index past the embedding; use --vocab-size {tokenizer_vocab} or more, or drop it")
    return vocab_size


def padded_vocab_size(
    vocab_size: int, tp_size: int = 1, divisible_by: int = MEGATRON_VOCAB_DIVISIBLE_BY
) -> int:
    """Megatron's embedding size: ``vocab_size`` rounded up to a multiple of ``divisible_by * tp_size``."""
    if vocab_size < 1 or tp_size < 1 or divisible_by < 1:
        raise ValueError(
            f"need positive sizes, got vocab={vocab_size} tp={tp_size} divisible_by={divisible_by}"
        )
    multiple = divisible_by * tp_size
    return math.ceil(vocab_size / multiple) * multiple


# ---------------------------------------------------------------------------------------------------
# Ordered (optionally multi-process) encoding
# ---------------------------------------------------------------------------------------------------

_WORKER_TOKENIZER: Tokenizer | None = None
DEFAULT_CHUNK_DOCS = 64


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer  # pickled as its file's bytes (SentencePiece or tokenizers)


def _encode_chunk(texts: list[str]) -> list[list[int]]:
    return _WORKER_TOKENIZER.encode_batch(texts)


def _chunks(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encode_documents(
    texts: Iterable[str], tokenizer: Tokenizer, workers: int = 1, chunk_docs: int = DEFAULT_CHUNK_DOCS
) -> Iterator[list[int]]:
    """Token ids of each text, in input order. ``workers > 1`` encodes in spawned processes."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        for chunk in _chunks(texts, chunk_docs):
            yield from tokenizer.encode_batch(chunk)
        return
    # spawn, not fork: the caller may hold threads or a CUDA context; workers only need the tokenizer.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        for encoded in pool.imap(_encode_chunk, _chunks(texts, chunk_docs)):
            yield from encoded
