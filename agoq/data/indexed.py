"""Checks of Megatron ``.bin/.idx`` datasets that need no torch or megatron: header, sizes, splits, token ids.

The ``.idx`` layout (megatron-core 0.19.2 ``indexed_dataset._IndexWriter``, little-endian):
``b"MMIDIDX\\x00\\x00"`` | version u64 = 1 | dtype code u8 | sequence count S u64 | document count D u64 |
sequence lengths i32[S] | sequence byte offsets into the .bin i64[S] | document indices i64[D]
(``D`` = documents + 1: the indices start at 0 and end at S). The ``.bin`` holds the token ids,
``sum(lengths) * itemsize`` bytes. Megatron asserts on a bad header and reads past a short file; these
checks name the file and the fix instead.

The split rule is Megatron's (``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix``,
``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``): document ``[round(lo * N), round(hi * N))``
of each split. A split with a weight but no tokens makes ``GPTDataset._get_num_epochs`` loop forever.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
# megatron.core.datasets.indexed_dataset.DType codes
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
SPLIT_NAMES = ("train", "valid", "test")
FULL_SCAN_BYTES = 1 << 30  # token-id check: read the whole .bin up to 1 GiB (~0.3 s), else sample windows
SAMPLE_WINDOWS = 256
SAMPLE_WINDOW_BYTES = 1 << 20
_FIX = "rebuild it with scripts/prepare_data.py"


@dataclass(frozen=True)
class IndexedData:
    """A checked ``.bin/.idx`` pair: the token dtype, per-sequence lengths and the document count."""

    prefix: str
    dtype: type[np.number]
    sequence_lengths: np.ndarray  # int32 [S], a view of the memory-mapped .idx
    document_indices: np.ndarray  # int64 [documents + 1]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def bin_path(self) -> str:
        return f"{self.prefix}.bin"


def read_index(prefix: str | os.PathLike) -> IndexedData:
    """Read and check ``prefix.idx`` against ``prefix.bin``; raise ValueError naming the file and the fix."""
    prefix = os.fspath(prefix)
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise ValueError(f"dataset file {path} not found; build it with scripts/prepare_data.py "
                             "(--data-path takes the prefix, without .bin/.idx)")
    idx_size = idx_path.stat().st_size
    with open(idx_path, "rb") as stream:
        head = stream.read(HEADER_BYTES)
    if not head.startswith(INDEX_MAGIC):
        what = "empty" if not head else f"starts with {head[:16]!r}, not Megatron's {INDEX_MAGIC!r}"
        raise ValueError(f"{idx_path}: not a Megatron .idx index ({what}); {_FIX}")
    if len(head) < HEADER_BYTES:
        raise ValueError(f"{idx_path}: truncated header ({idx_size} of {HEADER_BYTES} bytes); {_FIX}")
    version, code, num_seqs, num_docs = struct.unpack("<QBQQ", head[len(INDEX_MAGIC):])
    if version != INDEX_VERSION or code not in DTYPE_CODES:
        raise ValueError(f"{idx_path}: unsupported .idx (version {version}, dtype code {code}; allowed: version "
                         f"{INDEX_VERSION}, codes {sorted(DTYPE_CODES)}); {_FIX}")
    expected = HEADER_BYTES + 12 * num_seqs + 8 * num_docs
    if idx_size != expected:
        raise ValueError(f"{idx_path}: {idx_size} bytes, but its header ({num_seqs} sequences, {num_docs - 1} "
                         f"documents) needs {expected}: the file is truncated or corrupt; {_FIX}")
    if num_seqs == 0 or num_docs < 2:
        raise ValueError(f"{idx_path}: the dataset holds no documents; prepare it from non-empty inputs")
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=num_seqs, offset=HEADER_BYTES)
    pointers = np.frombuffer(mm, dtype=np.int64, count=num_seqs, offset=HEADER_BYTES + 4 * num_seqs)
    documents = np.frombuffer(mm, dtype=np.int64, count=num_docs, offset=HEADER_BYTES + 12 * num_seqs)
    if documents[0] != 0 or documents[-1] != num_seqs or np.any(np.diff(documents) < 0):
        raise ValueError(f"{idx_path}: document indices are not a rising run from 0 to {num_seqs}: corrupt; {_FIX}")
    itemsize = np.dtype(DTYPE_CODES[code]).itemsize
    if np.any(lengths < 0) or pointers[0] != 0 or np.any(np.diff(pointers) != lengths[:-1].astype(np.int64) * itemsize):
        raise ValueError(f"{idx_path}: sequence lengths disagree with the sequence offsets (the index was "
                         f"edited or is corrupt); {_FIX}")
    tokens = int(lengths.sum(dtype=np.int64))
    bin_size = bin_path.stat().st_size
    if bin_size != tokens * itemsize:
        raise ValueError(f"{bin_path}: {bin_size} bytes, but {idx_path} describes {tokens} tokens of "
                         f"{np.dtype(DTYPE_CODES[code]).name} ({tokens * itemsize} bytes): the .bin is truncated, "
                         f"empty or from another dataset; {_FIX}")
    return IndexedData(prefix, DTYPE_CODES[code], lengths, documents)


def max_token_id(data: IndexedData, *, full_scan_bytes: int = FULL_SCAN_BYTES) -> tuple[int, bool]:
    """(largest token id seen, whether every token was read): the whole .bin up to ``full_scan_bytes``,
    else ``SAMPLE_WINDOWS`` evenly spaced windows of ``SAMPLE_WINDOW_BYTES`` (first and last included)."""
    tokens = np.memmap(data.bin_path, mode="r", dtype=data.dtype)
    if tokens.nbytes <= full_scan_bytes:
        return int(tokens.max()), True
    window = max(1, SAMPLE_WINDOW_BYTES // tokens.itemsize)
    starts = np.linspace(0, len(tokens) - window, SAMPLE_WINDOWS).astype(np.int64)
    return max(int(tokens[s:s + window].max()) for s in starts), False


def check_token_ids(data: IndexedData, vocab_size: int, tokenizer_path: str | os.PathLike) -> None:
    """Raise when the data holds a token id the tokenizer does not have (data written with another one)."""
    if not np.issubdtype(data.dtype, np.integer):
        raise ValueError(f"{data.bin_path}: token ids stored as {np.dtype(data.dtype).name}, not integers; {_FIX}")
    top, everything = max_token_id(data)
    if top >= vocab_size:
        raise ValueError(
            f"{data.bin_path}: token id {top} {'' if everything else '(in a sample of the file) '}is outside "
            f"the vocabulary of {tokenizer_path} ({vocab_size} pieces, ids 0..{vocab_size - 1}): the data was "
            "written with another tokenizer. Pass the --tokenizer-model it was prepared with, or prepare it "
            "again with this one (scripts/prepare_data.py --tokenizer-model ...)"
        )


def tokenizer_record_path(prefix: str | os.PathLike) -> Path:
    """``<prefix>.tokenizer.json``: the tokenizer a dataset was written with (agoq's writer adds it)."""
    return Path(f"{os.fspath(prefix)}.tokenizer.json")


def tokenizer_record(vocab_size: int, sha256: str, path: str | os.PathLike | None) -> dict:
    return {"vocab_size": vocab_size, "sha256": sha256, "file": None if path is None else Path(path).name}


def check_tokenizer_record(prefix: str | os.PathLike, vocab_size: int, sha256: str,
                           tokenizer_path: str | os.PathLike) -> None:
    """Raise when ``prefix`` records another tokenizer than the one given (its ids would all fit a larger
    vocabulary, so the token-id check cannot see it). Data without a record (Megatron-LM's tools, older
    agoq) is not checked here."""
    record_path = tokenizer_record_path(prefix)
    if not record_path.is_file():
        return
    try:
        record = json.loads(record_path.read_text())
        saved_sha, saved_vocab = record["sha256"], int(record["vocab_size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{record_path}: unreadable tokenizer record ({exc}); delete it (the data is not "
                         "checked against the tokenizer then) or prepare the data again") from None
    if saved_sha != sha256:
        raise ValueError(
            f"{prefix} was prepared with another tokenizer ({saved_vocab} pieces, sha256 {saved_sha[:12]}..., "
            f"{record.get('file')}; recorded in {record_path}) than {tokenizer_path} ({vocab_size} pieces, sha256 "
            f"{sha256[:12]}...): its token ids mean other pieces. Pass the --tokenizer-model it was prepared with, "
            "or prepare it again with this one"
        )


def split_weights(split: str) -> list[float]:
    """Megatron's parse_and_normalize_split: "969,30,1" -> normalised train/valid/test weights."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    if not values or len(values) > len(SPLIT_NAMES) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative weights 'train,valid,test' with "
                         "a positive sum, e.g. 969,30,1")
    values += [0.0] * (len(SPLIT_NAMES) - len(values))
    weights = np.array(values, dtype=np.float64)
    return (weights / np.sum(weights)).tolist()  # megatron.core.datasets.utils.normalize, bit for bit


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int] | None]:
    """The [begin, end) documents of each split (None for a split of weight 0), as Megatron picks them."""
    bounds, ranges = [0.0], []
    for weight in split_weights(split):
        bounds.append(bounds[-1] + weight)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        ranges.append(None if hi <= lo else (int(round(lo * num_documents)), int(round(hi * num_documents))))
    return ranges


def check_split(data: IndexedData, split: str) -> None:
    """Raise when a split with a weight gets no tokens: megatron-core 0.19.2 builds every weighted split, used
    or not, and ``GPTDataset._get_num_epochs`` loops forever on an empty one. (A split shorter than one
    sample is fine: Megatron repeats it over epochs.)"""
    ranges = split_document_ranges(data.num_documents, split)
    for name, bounds in zip(SPLIT_NAMES, ranges, strict=True):
        if bounds is None:
            continue
        begin, end = bounds
        docs = data.document_indices[begin:end + 1]
        tokens = int(data.sequence_lengths[docs[0]:docs[-1]].sum(dtype=np.int64)) if end > begin else 0
        if tokens > 0:
            continue
        least = _documents_for_nonempty_splits(split, data.num_documents)
        more = f"about {least} documents or more (this data" if least else "more documents (this data"
        raise ValueError(
            f"--split {split}: the {name} split of {data.prefix} is empty (documents {begin}..{end} of "
            f"{data.num_documents}, {tokens} tokens). Fix: give the {name} split more weight (e.g. --split "
            f"90,5,5){_without_test(split) if name == 'test' else ''}, or use {more} has {data.num_documents})"
        )


def _without_test(split: str) -> str:
    """' or weight 0 (--split 969,31,0)': the test split's weight moved to validation."""
    values = re.findall(r"[.0-9]+", split)
    if len(values) != len(SPLIT_NAMES):
        return " or weight 0"
    return f" or weight 0 (--split {values[0]},{float(values[1]) + float(values[2]):g},0)"


def _documents_for_nonempty_splits(split: str, start: int, limit: int = 1 << 22) -> int | None:
    """The smallest document count above ``start`` that gives every weighted split a document."""
    count = start + 1
    while count <= limit:
        if all(r is None or r[1] > r[0] for r in split_document_ranges(count, split)):
            return count
        count = max(count + 1, int(count * 1.01))
    return None
