"""Write small Megatron ``.bin/.idx`` datasets from token lists, without megatron (tests of agoq.data.indexed)."""

from __future__ import annotations

import os
import struct

import numpy as np

from agoq.data.indexed import DTYPE_CODES, INDEX_MAGIC, INDEX_VERSION


def write_indexed_dataset(prefix: str | os.PathLike, docs: list[list[int]], dtype=np.uint16) -> str:
    """Megatron's layout, one sequence per document, written from the format description (not megatron's
    writer: tests/megatron/test_data.py checks that the two agree). Returns the prefix."""
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * np.dtype(dtype).itemsize])
    code = {v: k for k, v in DTYPE_CODES.items()}[dtype]
    with open(f"{prefix}.idx", "wb") as out:
        out.write(INDEX_MAGIC + struct.pack("<QBQQ", INDEX_VERSION, code, len(docs), len(docs) + 1))
        out.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + np.arange(len(docs) + 1).tobytes())
    np.concatenate([np.asarray(d, dtype=dtype) for d in docs]).tofile(f"{prefix}.bin")
    return os.fspath(prefix)
