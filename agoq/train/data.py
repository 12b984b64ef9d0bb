"""Pretraining data on megatron-core: indexed datasets, the embedded default dataset, batch iterators.

* :func:`build_indexed_dataset` tokenises documents into Megatron's ``.bin/.idx`` format
  (``IndexedDatasetBuilder``), one sequence per document with ``eod`` appended (the layout of
  Megatron-LM's ``tools/preprocess_data.py``, which the wheel does not ship).
* :func:`ensure_default_dataset` builds, once per cache key, the default dataset: the standard-library
  corpus (:mod:`agoq.data.corpus`) with a SentencePiece tokenizer trained on it.
* :func:`build_data_iterators` wraps ``GPTDataset`` (via ``BlendedMegatronDatasetBuilder``) in a
  deterministic, resumable sampler with Megatron's ``MegatronPretrainingSampler`` semantics.

Megatron's dataset classes are reached through agoq.megatron.datasets.

Batch dicts (per micro-batch, b = micro_batch_size, s = seq_length):
``tokens`` [b, s] int64, ``labels`` [b, s] int64, ``loss_mask`` [b, s] float32,
``position_ids`` [b, s] int64, ``attention_mask`` None (causal attention is implied).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from agoq.data.corpus import DEFAULT_MAX_BYTES, collect_stdlib_corpus
from agoq.data.indexed import (
    check_split,
    check_token_ids,
    check_tokenizer_record,
    read_index,
    tokenizer_record,
    tokenizer_record_path,
)
from agoq.data.sampler import PretrainingSampler, iterate_batches
from agoq.data.tokenizer import Tokenizer, TokenizerTrainConfig, encode_documents, train_sentencepiece
from agoq.megatron.datasets import bin_path, gpt_datasets, idx_path, indexed_writer, token_dtype

logger = logging.getLogger(__name__)

# Bumped when the on-disk layout of the default dataset changes, so old caches are not reused.
DEFAULT_DATASET_FORMAT_VERSION = 1
DEFAULT_DATASET_NAME = "stdlib"
DOCUMENT_PREFIX_NAME = "text_document"  # Megatron's preprocess_data.py suffix for document-level data
TOKENIZER_FILE_NAME = "tokenizer.model"
MANIFEST_FILE_NAME = "manifest.json"
DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's example split
DEFAULT_SEED = 1234


# ---------------------------------------------------------------------------------------------------
# .bin/.idx writing
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexedDatasetStats:
    """What :func:`build_indexed_dataset` wrote."""

    num_documents: int
    num_tokens: int
    """Tokens written, EOD tokens included."""
    num_text_bytes: int
    """UTF-8 bytes of the input text."""
    num_skipped_empty: int
    seconds: float


def build_indexed_dataset(
    texts: Iterable[str],
    tokenizer: Tokenizer,
    out_prefix: str | os.PathLike,
    *,
    workers: int = 1,
    progress: Callable[[int, int, int], None] | None = None,
    progress_every: int = 1000,
) -> IndexedDatasetStats:
    """Tokenise ``texts`` (one document each) into ``out_prefix.bin`` / ``out_prefix.idx``.

    Each document is one sequence: its token ids followed by ``tokenizer.eod_id``. Documents that
    encode to no tokens are skipped. Files are written under temporary names and renamed at the end,
    so a crash never leaves a half-written dataset behind. ``progress(documents, tokens, bytes)``
    is called every ``progress_every`` documents.
    """
    out_prefix = str(out_prefix)
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f"{out_prefix}.tmp{os.getpid()}"
    eod_id = tokenizer.eod_id
    start = time.perf_counter()
    counts = {"bytes": 0}

    def counted(items: Iterable[str]) -> Iterator[str]:
        for text in items:
            counts["bytes"] += len(text.encode("utf-8"))
            yield text

    num_docs = num_tokens = num_empty = 0
    builder = indexed_writer(tmp_prefix, tokenizer.vocab_size)
    try:
        for ids in encode_documents(counted(texts), tokenizer, workers=workers):
            if not ids:
                num_empty += 1
                continue
            ids.append(eod_id)
            builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
            num_docs += 1
            num_tokens += len(ids)
            if progress is not None and num_docs % progress_every == 0:
                progress(num_docs, num_tokens, counts["bytes"])
        builder.finalize(idx_path(tmp_prefix))
        if num_docs == 0:
            raise ValueError(f"no non-empty documents to write to {out_prefix}; check the inputs")
        record = tokenizer_record(tokenizer.vocab_size, tokenizer.sha256, tokenizer.path)
        tokenizer_record_path(tmp_prefix).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(bin_path(tmp_prefix), bin_path(out_prefix))
        os.replace(idx_path(tmp_prefix), idx_path(out_prefix))
        os.replace(tokenizer_record_path(tmp_prefix), tokenizer_record_path(out_prefix))
    finally:
        builder.data_file.close()
        for path in (bin_path(tmp_prefix), idx_path(tmp_prefix), tokenizer_record_path(tmp_prefix)):
            Path(path).unlink(missing_ok=True)
    return IndexedDatasetStats(num_docs, num_tokens, counts["bytes"], num_empty, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------
# The embedded default dataset
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetPaths:
    """A ready dataset: ``prefix`` (.bin/.idx without suffix), its tokenizer and its manifest."""

    prefix: Path
    tokenizer_model: Path
    manifest: Path


def default_cache_dir() -> Path:
    """``~/.cache/agoq/data``. Scripts let ``$AGOQ_CACHE`` override it (library code reads no env)."""
    return Path.home() / ".cache" / "agoq" / "data"


def _default_dataset_key(corpus_manifest: dict, tokenizer_config: TokenizerTrainConfig) -> str:
    key_material = {
        "format": DEFAULT_DATASET_FORMAT_VERSION,
        "corpus_sha256": corpus_manifest["sha256"],
        "corpus_format_version": corpus_manifest["corpus_format_version"],
        "max_bytes": corpus_manifest["max_bytes"],
        "tokenizer": {k: v for k, v in asdict(tokenizer_config).items() if k != "num_threads"},
    }
    return hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:16]


def _paths_in(directory: Path) -> DatasetPaths:
    return DatasetPaths(
        directory / DOCUMENT_PREFIX_NAME, directory / TOKENIZER_FILE_NAME, directory / MANIFEST_FILE_NAME
    )


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    """An exclusive ``flock`` (same host; on shared filesystems use the rank-0-builds pattern)."""
    import fcntl

    with open(lock_path, "a+") as stream:
        fcntl.flock(stream.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(stream.fileno(), fcntl.LOCK_UN)


def ensure_default_dataset(
    cache_dir: str | os.PathLike,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    tokenizer_config: TokenizerTrainConfig | None = None,
    stdlib_dir: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> DatasetPaths:
    """Return the default dataset, building it into ``cache_dir`` first if needed.

    ``progress`` (e.g. a rank-0 print) is told which dataset is used, and when one is built, that the build
    starts and what it produced.

    The directory ``cache_dir/stdlib-<key>`` is keyed on the corpus content hash, ``max_bytes`` and
    the tokenizer options. It is built in a temporary directory and renamed into place, under a
    file lock, so concurrent callers on one host build it once and never see a partial dataset.
    In a distributed job call it on global rank 0 first, then barrier, then on the other ranks.
    """
    tokenizer_config = tokenizer_config or TokenizerTrainConfig()
    cache_dir = Path(cache_dir)
    corpus = collect_stdlib_corpus(max_bytes, Path(stdlib_dir) if stdlib_dir is not None else None)
    key = _default_dataset_key(corpus.manifest, tokenizer_config)
    final_dir = cache_dir / f"{DEFAULT_DATASET_NAME}-{key}"
    say = progress or (lambda _text: None)
    if (final_dir / MANIFEST_FILE_NAME).is_file():
        say(f"data: built-in corpus and tokenizer (cached): {final_dir}")
        return _paths_in(final_dir)
    say(f"data: building the built-in corpus ({len(corpus.documents)} stdlib documents) and its SentencePiece "
        f"tokenizer into {final_dir} (once; later runs reuse it) ...")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{final_dir.name}.lock"):
        if (final_dir / MANIFEST_FILE_NAME).is_file():  # another process built it meanwhile
            say(f"data: built-in corpus ready (built by another process): {final_dir}")
            return _paths_in(final_dir)
        tmp_dir = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".tmp-{final_dir.name}-"))
        try:
            say(_build_default_into(tmp_dir, corpus, tokenizer_config, key))
            try:
                os.rename(tmp_dir, final_dir)
            except OSError:  # lost a race the lock could not see (e.g. another host on NFS)
                if not (final_dir / MANIFEST_FILE_NAME).is_file():
                    raise
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("default dataset ready at %s", final_dir)
    return _paths_in(final_dir)


def ensure_default_dataset_distributed(cache_dir: str | os.PathLike, **kwargs) -> DatasetPaths:
    """:func:`ensure_default_dataset` for a job: global rank 0 builds, barrier, then the other ranks.

    The others then hit rank 0's cache (shared filesystem) or build the same dataset themselves
    under the lock (node-local cache). Raises if a rank ended up with a different dataset key (e.g.
    another Python build on another node): use one shared cache or identical Python installs.
    Without an initialised process group it is :func:`ensure_default_dataset`. ``progress`` is told on
    global rank 0 only.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return ensure_default_dataset(cache_dir, **kwargs)
    progress = kwargs.pop("progress", None)
    paths = ensure_default_dataset(cache_dir, progress=progress, **kwargs) if dist.get_rank() == 0 else None
    dist.barrier()
    if paths is None:
        paths = ensure_default_dataset(cache_dir, **kwargs)
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, paths.prefix.parent.name)
    if len(set(keys)) != 1:
        raise ValueError(
            f"ranks built different default datasets {sorted(set(keys))}: their Python stdlib differs; "
            "pass one shared --data-cache-dir on a file system every node sees, or use the same Python install on "
            "every node"
        )
    return paths


def _build_default_into(directory: Path, corpus, tokenizer_config: TokenizerTrainConfig, key: str) -> str:
    """Build into ``directory``; a one-line summary of what was built."""
    paths = _paths_in(directory)
    start = time.perf_counter()
    texts = [doc.text for doc in corpus.documents]
    train_sentencepiece(texts, paths.tokenizer_model, tokenizer_config)
    tokenizer_seconds = time.perf_counter() - start
    tokenizer = Tokenizer.load(paths.tokenizer_model)
    stats = build_indexed_dataset(texts, tokenizer, paths.prefix)
    manifest = {
        "name": DEFAULT_DATASET_NAME,
        "key": key,
        "format_version": DEFAULT_DATASET_FORMAT_VERSION,
        "corpus": corpus.manifest,
        "tokenizer": {
            **asdict(tokenizer_config),
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id,
            "pad_id": tokenizer.pad_id,
            "train_seconds": round(tokenizer_seconds, 3),
        },
        "dataset": {
            **asdict(stats),
            "seconds": round(stats.seconds, 3),
            "token_dtype": token_dtype(tokenizer.vocab_size).__name__,
        },
    }
    logger.info(
        "built default dataset: %d documents, %d tokens (tokenizer %.1fs, encode %.1fs)",
        stats.num_documents,
        stats.num_tokens,
        tokenizer_seconds,
        stats.seconds,
    )
    (paths.manifest).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return (f"data: built-in corpus ready: {stats.num_documents} documents, {stats.num_tokens} tokens, vocabulary "
            f"{tokenizer.vocab_size} (tokenizer {tokenizer_seconds:.1f} s, encoding {stats.seconds:.1f} s)")


# ---------------------------------------------------------------------------------------------------
# GPTDataset and the resumable sampler
# ---------------------------------------------------------------------------------------------------

BlendSpec = str | os.PathLike | Sequence[str | os.PathLike] | Sequence[tuple[float, str | os.PathLike]]


def normalize_blend(blend: BlendSpec) -> tuple[list[str], list[float] | None]:
    """A prefix, a list of prefixes (weighted by size) or ``[(weight, prefix), ...]`` → Megatron's blend."""
    if isinstance(blend, str | os.PathLike):
        return [os.fspath(blend)], None
    items = list(blend)
    if not items:
        raise ValueError("empty blend; give a dataset prefix or [(weight, prefix), ...]")
    if all(isinstance(item, tuple) and len(item) == 2 for item in items):
        weights = [float(w) for w, _ in items]
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {weights}")
        return [os.fspath(p) for _, p in items], weights
    if all(isinstance(item, str | os.PathLike) for item in items):
        return [os.fspath(p) for p in items], None
    raise ValueError(f"blend must be a prefix, a list of prefixes or [(weight, prefix), ...]; got {blend!r}")


def check_dataset_files(prefixes: Sequence[str], *, split: str, tokenizer: Tokenizer) -> None:
    """Headers, sizes, split sizes and token ids of every prefix (agoq.data.indexed); raise ValueError naming
    the file, the counts and the fix. A split without documents would hang GPTDataset forever."""
    for prefix in prefixes:
        data = read_index(prefix)
        check_split(data, split)
        where = tokenizer.path or "<in-memory tokenizer>"
        check_token_ids(data, tokenizer.vocab_size, where)
        check_tokenizer_record(prefix, tokenizer.vocab_size, tokenizer.sha256, where)


def build_gpt_datasets(
    blend: BlendSpec,
    tokenizer: Tokenizer,
    num_samples: Sequence[int | None],
    *,
    seq_length: int,
    seed: int = DEFAULT_SEED,
    split: str = DEFAULT_SPLIT,
    cache_dir: str | os.PathLike,
    is_built_on_rank: Callable[[], bool] | None = None,
    mmap_bin_files: bool = True,
    eod_mask_loss: bool = False,
) -> list:
    """``[train, valid, test]`` GPTDatasets (None for empty splits or ranks that do not build).

    ``num_samples`` is the number of samples per split (train_iters * global_batch_size, ...).
    Index files are cached under ``cache_dir``. Must be called on every rank when
    torch.distributed is initialised: rank 0 builds the indices first (``is_built_on_rank`` must be
    True there), then the others load them.
    """
    prefixes, weights = normalize_blend(blend)
    for prefix in prefixes:  # the cheap checks; token ids: check_dataset_files, once per job
        check_split(read_index(prefix), split)
    return gpt_datasets(prefixes, weights, tokenizer, num_samples, seq_length=seq_length, seed=seed, split=split,
                        cache_dir=cache_dir, is_built_on_rank=is_built_on_rank, mmap_bin_files=mmap_bin_files,
                        eod_mask_loss=eod_mask_loss)


def _num_eval_points(train_iters: int, eval_interval: int | None) -> int:
    # Megatron's get_train_valid_test_num_samples: one evaluation every eval_interval plus one at the end.
    return train_iters // eval_interval + 1 if eval_interval else 1


def build_data_iterators(
    blend: BlendSpec,
    tokenizer: Tokenizer,
    *,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    train_iters: int,
    eval_iters: int = 0,
    eval_interval: int | None = None,
    seed: int = DEFAULT_SEED,
    split: str = DEFAULT_SPLIT,
    consumed_samples: int = 0,
    consumed_valid_samples: int = 0,
    cache_dir: str | os.PathLike,
    is_built_on_rank: Callable[[], bool] | None = None,
    mmap_bin_files: bool = True,
) -> tuple[Iterator[dict] | None, Iterator[dict] | None, Iterator[dict] | None]:
    """``(train_iter, valid_iter, test_iter)`` of this data-parallel rank's micro-batches.

    Every iterator yields ``global_batch_size // (micro_batch_size * dp_size)`` micro-batches per
    training iteration. The train iterator starts at ``consumed_samples`` (resume), the valid one at
    ``consumed_valid_samples`` and keeps going across evaluations (as Megatron does). Iterators are
    None when ``eval_iters == 0`` (valid/test) or when this rank does not build datasets.
    """
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a multiple of micro_batch_size * "
            f"dp_size = {micro_batch_size} * {dp_size}"
        )
    if train_iters < 1 or eval_iters < 0:
        raise ValueError(f"need train_iters >= 1 and eval_iters >= 0, got {train_iters}, {eval_iters}")
    num_samples = [
        train_iters * global_batch_size,
        _num_eval_points(train_iters, eval_interval) * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    ]
    datasets = build_gpt_datasets(
        blend,
        tokenizer,
        num_samples,
        seq_length=seq_length,
        seed=seed,
        split=split,
        cache_dir=cache_dir,
        is_built_on_rank=is_built_on_rank,
        mmap_bin_files=mmap_bin_files,
    )
    consumed = [consumed_samples, consumed_valid_samples, 0]
    iterators = []
    for dataset, wanted, start in zip(datasets, num_samples, consumed, strict=True):
        if dataset is None or wanted == 0:
            iterators.append(None)
            continue
        sampler = PretrainingSampler(len(dataset), start, micro_batch_size, dp_rank, dp_size)
        iterators.append(iterate_batches(dataset, sampler))
    return tuple(iterators)
