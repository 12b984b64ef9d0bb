"""Text corpora: the embedded default corpus (Python's own standard library) and user files.

The default corpus is real text that exists on every machine with a Python install, so a training run
needs no download and no ``--data-path`` to see natural language. It is read in a fixed order:

1. ``pydoc_data/topics.py``: the language reference as prose, one document per topic (sorted keys);
2. ``.txt`` / ``.rst`` files shipped in the standard library (licence, idlelib notes, ...);
3. ``.py`` sources of the standard library (docstrings and comments are English prose).

Within each group files are sorted by their POSIX path relative to the stdlib directory. Test
packages, ``site-packages`` and caches are skipped. Documents are added while they fit under
``max_bytes`` (UTF-8 bytes); a document that does not fit is skipped and the scan goes on, so the
result is a deterministic function of the file set and the cap. The manifest records the Python
version, the counts and a sha256 of the content, so caches keyed on it change when the source does.

User inputs (``scripts/prepare_data.py``): ``.jsonl`` files (one JSON object per line, text under
``json_key``) and ``.txt`` files (one document per file, or per blank-line-separated paragraph).
Errors name the file and line and say how to fix the input.

No torch, no megatron, no environment reads.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# 8 MiB: the stdlib sources (without tests) are ~13 MiB on CPython 3.12; 8 MiB gives ~2.7M tokens with a
# 4096-piece BPE, trains the tokenizer in ~1.5 s and encodes in ~1 s on a 2-core CPU (measured 2026-05).
DEFAULT_MAX_BYTES = 8 * 2**20
# Bumped whenever the selection or ordering rules change, so caches keyed on the manifest rebuild.
CORPUS_FORMAT_VERSION = 1
# Directory names never descended into: tests are large and repetitive; site-packages is not stdlib.
EXCLUDED_DIR_NAMES = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
DOC_SUFFIXES = (".txt", ".rst")
CODE_SUFFIXES = (".py",)
PYDOC_TOPICS_RELPATH = "pydoc_data/topics.py"
TXT_MODES = ("file", "paragraph")
SUPPORTED_INPUT_SUFFIXES = (".jsonl", ".txt", ".parquet")
PARQUET_BATCH_ROWS = 1024  # rows per record batch read from a parquet file (bounded memory)


@dataclass(frozen=True)
class Document:
    """One training document: ``name`` says where it came from (for errors and manifests)."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """A list of documents plus the manifest that identifies them."""

    documents: tuple[Document, ...]
    manifest: dict


def default_stdlib_dir() -> Path:
    """The running interpreter's pure-Python standard library directory (no environment reads)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read_pydoc_topics(path: Path) -> list[Document]:
    """Topics of the language reference, parsed (not imported) from ``pydoc_data/topics.py``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            topics = ast.literal_eval(node.value)
            return [Document(f"pydoc_topics:{key}", topics[key]) for key in sorted(topics)]
    raise ValueError(f"{path} has no 'topics = {{...}}' assignment; pass stdlib_dir=<a CPython Lib dir>")


def _walk_sorted(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIR_NAMES]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(suffixes))
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def _iter_stdlib_candidates(stdlib_dir: Path) -> Iterator[Document | None]:
    """Every candidate document in corpus order; ``None`` marks a file that is not valid UTF-8."""
    topics_path = stdlib_dir / PYDOC_TOPICS_RELPATH
    if topics_path.is_file():
        yield from _read_pydoc_topics(topics_path)
    for suffixes in (DOC_SUFFIXES, CODE_SUFFIXES):
        for path in _walk_sorted(stdlib_dir, suffixes):
            rel = path.relative_to(stdlib_dir).as_posix()
            if rel == PYDOC_TOPICS_RELPATH:
                continue
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                yield None
                continue
            yield Document(f"stdlib:{rel}", text)


def _content_sha256(documents: Iterable[Document]) -> str:
    digest = hashlib.sha256()
    for doc in documents:
        for part in (doc.name, doc.text):
            data = part.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.hexdigest()


def collect_stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, stdlib_dir: Path | None = None) -> Corpus:
    """The default corpus: standard-library text up to ``max_bytes`` UTF-8 bytes (see module doc)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}; the default is {DEFAULT_MAX_BYTES}")
    stdlib_dir = Path(stdlib_dir) if stdlib_dir is not None else default_stdlib_dir()
    if not stdlib_dir.is_dir():
        raise ValueError(f"stdlib directory {stdlib_dir} does not exist; pass stdlib_dir=<python Lib dir>")
    documents: list[Document] = []
    num_bytes = num_skipped_too_big = num_skipped_not_utf8 = 0
    for doc in _iter_stdlib_candidates(stdlib_dir):
        if doc is None:
            num_skipped_not_utf8 += 1
            continue
        size = len(doc.text.encode("utf-8"))
        if size == 0 or not doc.text.strip():
            continue
        if num_bytes + size > max_bytes:
            num_skipped_too_big += 1
            continue
        documents.append(doc)
        num_bytes += size
    if not documents:
        raise ValueError(f"no text found under {stdlib_dir} within max_bytes={max_bytes}")
    manifest = {
        "source": "python-stdlib",
        "corpus_format_version": CORPUS_FORMAT_VERSION,
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_dir": str(stdlib_dir),
        "max_bytes": max_bytes,
        "num_documents": len(documents),
        "num_bytes": num_bytes,
        "num_skipped_over_cap": num_skipped_too_big,
        "num_skipped_not_utf8": num_skipped_not_utf8,
        "sha256": _content_sha256(documents),
    }
    return Corpus(tuple(documents), manifest)


# ---------------------------------------------------------------------------------------------------
# User inputs
# ---------------------------------------------------------------------------------------------------


def iter_jsonl_documents(path: Path, json_key: str = "text") -> Iterator[Document]:
    """One document per non-empty line of a JSON-lines file; the text is ``obj[json_key]``."""
    with open(path, encoding="utf-8") as stream:
        for line_no, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}: invalid JSON ({err.msg} at column {err.colno}); "
                    "each line must be one JSON object"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
            if json_key not in obj:
                keys = ", ".join(sorted(obj)) or "none"
                raise ValueError(
                    f"{where}: key {json_key!r} missing (keys present: {keys}); pass --json-key <key>"
                )
            text = obj[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{where}: {json_key!r} must be a string, got {type(text).__name__}")
            yield Document(where, text)


def iter_parquet_documents(path: Path, text_column: str = "text") -> Iterator[Document]:
    """One document per row of a parquet file; the text is the string column ``text_column``.

    Reads in record batches (bounded memory). Needs ``pyarrow`` (``pip install 'agoq[parquet]'``).
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading parquet needs pyarrow: pip install pyarrow (or agoq[parquet])") from None
    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if text_column not in names:
        raise ValueError(f"{path}: column {text_column!r} missing (columns: {', '.join(names)}); pass --json-key <col>")
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_column]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is not None and not isinstance(text, str):
                raise ValueError(
                    f"{path}: row {row}: column {text_column!r} must hold strings, got {type(text).__name__}"
                )
            yield Document(f"{path}:row {row}", text or "")


def iter_text_documents(path: Path, txt_mode: str = "file") -> Iterator[Document]:
    """A ``.txt`` file as one document (``file``) or one per blank-line-separated paragraph."""
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {txt_mode!r}")
    text = Path(path).read_text(encoding="utf-8")
    if txt_mode == "file":
        yield Document(str(path), text)
        return
    line_no, paragraph, start = 0, [], 1
    for line_no, line in enumerate(text.splitlines(keepends=True), start=1):
        if line.strip():
            if not paragraph:
                start = line_no
            paragraph.append(line)
        elif paragraph:
            yield Document(f"{path}:{start}", "".join(paragraph))
            paragraph = []
    if paragraph:
        yield Document(f"{path}:{start}", "".join(paragraph))


def check_input_paths(paths: Iterable[Path]) -> list[Path]:
    """Validate input files up front, so a bad path fails before any work is done."""
    checked = []
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"input file {path} does not exist (or is not a file)")
        if path.suffix not in SUPPORTED_INPUT_SUFFIXES:
            raise NotImplementedError(
                f"input {path}: unsupported suffix {path.suffix!r}; use one of {SUPPORTED_INPUT_SUFFIXES}"
            )
        checked.append(path)
    if not checked:
        raise ValueError("no input files given")
    return checked


def iter_input_documents(
    paths: Iterable[Path], json_key: str = "text", txt_mode: str = "file", skip_empty: bool = True
) -> Iterator[Document]:
    """Documents of every input file in the order given (``.jsonl``, ``.parquet`` and ``.txt``)."""
    for path in check_input_paths(paths):
        if path.suffix == ".jsonl":
            docs = iter_jsonl_documents(path, json_key)
        elif path.suffix == ".parquet":
            docs = iter_parquet_documents(path, json_key)
        else:
            docs = iter_text_documents(path, txt_mode)
        for doc in docs:
            if skip_empty and not doc.text.strip():
                continue
            yield doc
