"""agoq.data.indexed: a bad .bin/.idx, a split without documents and token ids beyond the vocabulary stop with
the file, the counts and the fix, before any model is built (issue 21). Megatron agreement of the split rule and
of the file layout: tests/megatron/test_data.py."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from agoq.data import indexed
from agoq.testing.indexed import write_indexed_dataset as write_dataset


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    return write_dataset(tmp_path / "d", [list(rng.integers(0, 100, size=50)) for _ in range(40)])


def test_a_good_dataset_reads(data):
    got = indexed.read_index(data)
    assert got.num_documents == 40 and got.dtype is np.uint16 and int(got.sequence_lengths.sum()) == 2000
    assert indexed.max_token_id(got) == (99, True)
    indexed.check_token_ids(got, 100, "tok.model")
    indexed.check_split(got, "90,5,5")


def test_missing_text_empty_and_truncated_files_name_the_file(data, tmp_path):
    with pytest.raises(ValueError, match=r"nope.idx not found; build it with scripts/prepare_data.py"):
        indexed.read_index(tmp_path / "nope")
    idx, binf = tmp_path / "d.idx", tmp_path / "d.bin"
    good_idx = idx.read_bytes()
    idx.write_text("this is text\n")
    with pytest.raises(ValueError, match=r"d.idx: not a Megatron .idx index \(starts with b'this is text"):
        indexed.read_index(data)
    idx.write_bytes(b"")
    with pytest.raises(ValueError, match=r"d.idx: not a Megatron .idx index \(empty\)"):
        indexed.read_index(data)
    idx.write_bytes(good_idx[:-9])
    with pytest.raises(ValueError, match=r"d.idx: \d+ bytes, but its header .* needs \d+: the file is truncated"):
        indexed.read_index(data)
    idx.write_bytes(good_idx)
    tokens = binf.read_bytes()
    for broken in (tokens[:-2], b""):
        binf.write_bytes(broken)
        with pytest.raises(ValueError, match=r"d.bin: \d+ bytes, but .*d.idx describes 2000 tokens of uint16"):
            indexed.read_index(data)
    binf.write_bytes(tokens)
    indexed.read_index(data)


def test_overwritten_sequence_lengths_are_refused(data, tmp_path):
    idx = tmp_path / "d.idx"
    raw = bytearray(idx.read_bytes())
    raw[indexed.HEADER_BYTES + 4 * 3:indexed.HEADER_BYTES + 4 * 4] = struct.pack("<i", 7)  # document 3: 50 -> 7
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sequence lengths disagree with the sequence offsets"):
        indexed.read_index(data)


def test_token_ids_beyond_the_vocabulary(data, tmp_path):
    got = indexed.read_index(data)
    with pytest.raises(ValueError, match=r"token id 99 is outside the vocabulary of small.model \(64 pieces"):
        indexed.check_token_ids(got, 64, "small.model")
    # above the full-scan size the check samples windows; the first and last are always read
    big = indexed.read_index(write_dataset(tmp_path / "big", [[1] * 10] * 9 + [[1] * 9 + [500]]))
    assert indexed.max_token_id(big, full_scan_bytes=0) == (500, False)


@pytest.mark.parametrize(
    "num_documents,split,expected",
    [
        (400, "969,30,1", [(0, 388), (388, 400), (400, 400)]),  # the test split rounds to nothing
        (600, "969,30,1", [(0, 581), (581, 599), (599, 600)]),
        (58, "90,5,5", [(0, 52), (52, 55), (55, 58)]),
        (10, "1,0,0", [(0, 10), None, None]),
        (10, "8,2", [(0, 8), (8, 10), None]),
    ],
)
def test_split_document_ranges_follow_megatron(num_documents, split, expected):
    assert indexed.split_document_ranges(num_documents, split) == expected


def test_an_empty_split_names_split_counts_and_fix(tmp_path):
    small = indexed.read_index(write_dataset(tmp_path / "s", [[5] * 300] * 400))
    with pytest.raises(ValueError) as err:
        indexed.check_split(small, "969,30,1")
    assert str(err.value) == (
        f"--split 969,30,1: the test split of {tmp_path / 's'} is empty (documents 400..400 of 400, 0 tokens). "
        "Fix: give the test split more weight (e.g. --split 90,5,5) or weight 0 (--split 969,31,0), or use about "
        "501 documents or more (this data has 400)"
    )
    indexed.check_split(small, "969,31,0")  # no test split: fine
    indexed.check_split(small, "399,1,0")  # one document (300 tokens): Megatron repeats it over epochs
    with pytest.raises(ValueError, match=r"the valid split .* is empty \(documents 400..400 of 400, 0 tokens\)"):
        indexed.check_split(small, "1000,1,0")
    with pytest.raises(ValueError, match="--split 'x'"):
        indexed.split_weights("x")


def test_a_tokenizer_record_names_another_tokenizer(data, tmp_path):
    """Ids written with a smaller tokenizer all fit a larger one: only the record agoq's writer keeps next to
    the data (<prefix>.tokenizer.json) tells them apart."""
    indexed.check_tokenizer_record(data, 4096, "b" * 64, "big.model")  # no record (Megatron-LM's tools): no check
    record = indexed.tokenizer_record(512, "a" * 64, "/data/small.model")
    indexed.tokenizer_record_path(data).write_text(json.dumps(record))
    indexed.check_tokenizer_record(data, 512, "a" * 64, "small.model")
    with pytest.raises(ValueError) as err:
        indexed.check_tokenizer_record(data, 4096, "b" * 64, "big.model")
    assert str(err.value) == (
        f"{data} was prepared with another tokenizer (512 pieces, sha256 aaaaaaaaaaaa..., small.model; recorded in "
        f"{data}.tokenizer.json) than big.model (4096 pieces, sha256 bbbbbbbbbbbb...): its token ids mean other "
        "pieces. Pass the --tokenizer-model it was prepared with, or prepare it again with this one"
    )
    indexed.tokenizer_record_path(data).write_text("{")
    with pytest.raises(ValueError, match=r"d.tokenizer.json: unreadable tokenizer record"):
        indexed.check_tokenizer_record(data, 512, "a" * 64, "small.model")
