"""agoq.train.data and scripts/prepare_data.py on real megatron-core datasets (CPU)."""

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.megatron

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler  # noqa: E402

from agoq.data.corpus import collect_stdlib_corpus  # noqa: E402
from agoq.data.sampler import PretrainingSampler  # noqa: E402
from agoq.data.tokenizer import Tokenizer, TokenizerTrainConfig, train_sentencepiece  # noqa: E402
from agoq.train.data import (  # noqa: E402
    build_data_iterators,
    build_gpt_datasets,
    build_indexed_dataset,
    check_dataset_files,
    ensure_default_dataset,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# 256 KiB of stdlib text = the first 58 documents (pydoc topics) on CPython 3.12: ~100k tokens.
TINY_CAP_BYTES = 256 * 1024
TINY_VOCAB = 512
SEQ_LENGTH = 32
SPLIT = "90,5,5"  # coarse enough that the ~58-document corpus has documents in every split


def _load_script(name):
    spec = importlib.util.spec_from_file_location(f"agoq_script_{name}", REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare_data = _load_script("prepare_data")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A jsonl of stdlib documents, a tokenizer trained on them, and the prepared dataset."""
    root = tmp_path_factory.mktemp("data")
    texts = [doc.text for doc in collect_stdlib_corpus(TINY_CAP_BYTES).documents]
    jsonl = root / "docs.jsonl"
    # A whitespace-only document in the middle: skipped, so it does not shift the others.
    lines = [json.dumps({"text": t}) for t in texts[:10]] + ['{"text": "   "}']
    lines += [json.dumps({"text": t}) for t in texts[10:]]
    jsonl.write_text("\n".join(lines) + "\n")
    model = train_sentencepiece(texts, root / "tok.model", TokenizerTrainConfig(vocab_size=TINY_VOCAB))
    prefix = root / "tiny"
    rc = prepare_data.main(
        ["--input", str(jsonl), "--tokenizer-model", str(model), "--output-prefix", str(prefix)]
    )
    assert rc == 0
    return {
        "root": root,
        "texts": texts,
        "jsonl": jsonl,
        "tokenizer": Tokenizer.load(model),
        "prefix": prefix,
    }


def test_prepare_data_round_trip(tiny):
    tok, texts = tiny["tokenizer"], tiny["texts"]
    ds = IndexedDataset(str(tiny["prefix"]))
    assert len(ds) == len(texts)
    assert ds.index.dtype == np.uint16  # vocab 512 < 65500
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(texts) + 1))
    for i, text in enumerate(texts):
        seq = ds[i].tolist()
        assert seq == tok.encode(text) + [tok.eod_id]
        assert tok.eod_id not in seq[:-1]  # EOD only at document boundaries


def test_prepare_data_workers_give_identical_files(tiny):
    prefix2 = tiny["root"] / "tiny_w2"
    argv = [
        "--input",
        str(tiny["jsonl"]),
        "--tokenizer-model",
        str(tiny["tokenizer"].path),
        "--output-prefix",
        str(prefix2),
        "--workers",
        "2",
    ]
    assert prepare_data.main(argv) == 0
    for suffix in (".bin", ".idx"):
        assert Path(f"{prefix2}{suffix}").read_bytes() == Path(f"{tiny['prefix']}{suffix}").read_bytes()


def test_prepare_data_trains_tokenizer_and_summarises(tiny, tmp_path, capsys):
    txt = tmp_path / "book.txt"
    txt.write_text("\n\n".join(tiny["texts"][:20]))
    prefix = tmp_path / "book"
    argv = [
        "--input",
        str(txt),
        "--txt-mode",
        "paragraph",
        "--vocab-size",
        "400",
        "--output-prefix",
        str(prefix),
    ]
    assert prepare_data.main(argv) == 0
    summary = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    tok = Tokenizer.load(summary["tokenizer_model"])
    assert Path(summary["tokenizer_model"]) == Path(f"{prefix}.tokenizer.model") and tok.vocab_size == 400
    ds = IndexedDataset(str(prefix))
    assert int(summary["documents"]) == len(ds)
    assert int(summary["tokens"]) == int(ds.sequence_lengths.sum())
    assert "".join(tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))).count("\n") > 0
    # its ids (< 400) all fit the fixture's 512-piece tokenizer: the tokenizer record tells them apart
    assert json.loads(Path(f"{prefix}.tokenizer.json").read_text())["sha256"] == tok.sha256
    check_dataset_files([str(prefix)], split="90,5,5", tokenizer=tok)
    with pytest.raises(ValueError, match=r"was prepared with another tokenizer \(400 pieces.* than .*tok.model \(512"):
        check_dataset_files([str(prefix)], split="90,5,5", tokenizer=tiny["tokenizer"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": "broken"\n', "bad.jsonl:2: invalid JSON"),
        (
            '{"text": "ok"}\n{"body": "x"}\n',
            "bad.jsonl:2: key 'text' missing (keys present: body); pass --json-key",
        ),
    ],
)
@pytest.mark.parametrize("train_tokenizer", [False, True], ids=["given-tokenizer", "trains-tokenizer"])
def test_prepare_data_reports_input_errors(tiny, tmp_path, capsys, content, message, train_tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    tokenizer_args = (
        ["--vocab-size", "400"] if train_tokenizer else ["--tokenizer-model", str(tiny["tokenizer"].path)]
    )
    argv = ["--input", str(bad), *tokenizer_args, "--output-prefix", str(tmp_path / "out")]
    assert prepare_data.main(argv) == 1
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no partial .bin/.idx left


def test_prepare_data_runs_as_a_script(tmp_path):
    missing = tmp_path / "missing.jsonl"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "prepare_data.py"),
        "--input",
        str(missing),
        "--vocab-size",
        "400",
        "--output-prefix",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert f"input file {missing} does not exist" in proc.stderr


def test_default_dataset_is_built_once_and_cached(tmp_path):
    kwargs = {"max_bytes": TINY_CAP_BYTES, "tokenizer_config": TokenizerTrainConfig(vocab_size=TINY_VOCAB)}
    with ThreadPoolExecutor(2) as pool:  # two racing builders: the file lock makes one build
        paths_a, paths_b = pool.map(lambda _: ensure_default_dataset(tmp_path, **kwargs), range(2))
    assert paths_a == paths_b
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [paths_a.prefix.parent.name]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    bin_mtime = Path(f"{paths_a.prefix}.bin").stat().st_mtime_ns
    assert ensure_default_dataset(tmp_path, **kwargs) == paths_a
    assert Path(f"{paths_a.prefix}.bin").stat().st_mtime_ns == bin_mtime  # reused, not rebuilt

    manifest = json.loads(paths_a.manifest.read_text())
    corpus = collect_stdlib_corpus(TINY_CAP_BYTES)
    assert manifest["corpus"] == corpus.manifest
    ds = IndexedDataset(str(paths_a.prefix))
    assert manifest["dataset"]["num_tokens"] == int(ds.sequence_lengths.sum())
    assert manifest["dataset"]["num_documents"] == len(ds) == len(corpus.documents)
    assert manifest["tokenizer"]["sha256"] == Tokenizer.load(paths_a.tokenizer_model).sha256

    smaller = ensure_default_dataset(
        tmp_path, max_bytes=TINY_CAP_BYTES // 2, tokenizer_config=TokenizerTrainConfig(vocab_size=TINY_VOCAB)
    )
    assert smaller.prefix.parent != paths_a.prefix.parent  # the cap is part of the cache key


def _iterators(tiny, cache_dir, **overrides):
    kwargs = dict(
        seq_length=SEQ_LENGTH,
        micro_batch_size=2,
        global_batch_size=8,
        dp_rank=0,
        dp_size=2,
        train_iters=6,
        eval_iters=1,
        split=SPLIT,
        cache_dir=cache_dir,
    )
    kwargs.update(overrides)
    return build_data_iterators(tiny["prefix"], tiny["tokenizer"], **kwargs)


def test_iterator_batches_are_shifted_causal_samples(tiny, tmp_path):
    train, valid, test = _iterators(tiny, tmp_path)
    batch = next(train)
    assert batch["attention_mask"] is None
    for key, dtype in (
        ("tokens", torch.int64),
        ("labels", torch.int64),
        ("loss_mask", torch.float32),
        ("position_ids", torch.int64),
    ):
        assert batch[key].shape == (2, SEQ_LENGTH) and batch[key].dtype == dtype
    torch.testing.assert_close(batch["labels"][:, :-1], batch["tokens"][:, 1:], rtol=0, atol=0)
    assert torch.equal(batch["position_ids"], torch.arange(SEQ_LENGTH).expand(2, -1))
    assert torch.equal(batch["loss_mask"], torch.ones(2, SEQ_LENGTH))  # no padding in training samples
    assert next(valid)["tokens"].shape == next(test)["tokens"].shape == (2, SEQ_LENGTH)
    no_eval = _iterators(tiny, tmp_path, eval_iters=0)
    assert no_eval[1] is None and no_eval[2] is None


def test_iterator_resumes_from_consumed_samples(tiny, tmp_path):
    num_micro = 8 // (2 * 2)  # global / (micro * dp)
    full = [b["tokens"] for b in _iterators(tiny, tmp_path)[0]]
    assert len(full) >= 6 * num_micro
    resumed = [b["tokens"] for b in _iterators(tiny, tmp_path, consumed_samples=2 * 8)[0]]
    assert len(resumed) == len(full) - 2 * num_micro
    for a, b in zip(full[2 * num_micro :], resumed, strict=True):
        assert torch.equal(a, b)


def test_iterator_rank_slices_partition_the_global_batch(tiny, tmp_path):
    ranks = [list(_iterators(tiny, tmp_path, dp_rank=r)[0]) for r in range(2)]
    single = list(_iterators(tiny, tmp_path, dp_size=1, micro_batch_size=4)[0])
    assert len(ranks[0]) == len(ranks[1]) == len(single)
    for b0, b1, whole in zip(ranks[0], ranks[1], single, strict=True):
        assert torch.equal(torch.cat([b0["tokens"], b1["tokens"]]), whole["tokens"])
        assert not torch.equal(b0["tokens"], b1["tokens"])


@pytest.mark.parametrize(
    ("total", "consumed", "mbs", "dp"), [(37, 0, 2, 2), (37, 9, 2, 2), (64, 16, 4, 4), (10, 3, 1, 1)]
)
def test_sampler_matches_megatron(total, consumed, mbs, dp):
    for rank in range(dp):
        ours = list(PretrainingSampler(total, consumed, mbs, rank, dp))
        theirs = list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp))
        assert ours == theirs and ours


def test_weighted_blend_follows_weights(tiny, tmp_path):
    other = tmp_path / "other"
    build_indexed_dataset(tiny["texts"][::-1], tiny["tokenizer"], other)
    weights = [0.25, 0.75]
    blend = [(weights[0], str(tiny["prefix"])), (weights[1], str(other))]
    train, _, _ = build_gpt_datasets(
        blend, tiny["tokenizer"], [400, 0, 0], seq_length=SEQ_LENGTH, split=SPLIT, cache_dir=tmp_path
    )
    assert len(train) == 400
    fractions = np.bincount(train.dataset_index, minlength=2) / len(train)
    # Megatron's blending is greedy by deficit: each share is within one sample of weight * size.
    np.testing.assert_allclose(fractions, weights, atol=1.0 / len(train))


def test_dataset_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="not found; build it with scripts/prepare_data.py"):
        _iterators({**tiny, "prefix": tmp_path / "missing"}, tmp_path)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        _iterators(tiny, tmp_path, global_batch_size=6)
    with pytest.raises(ValueError, match="blend weights"):
        build_gpt_datasets(
            [(0.0, str(tiny["prefix"]))], tiny["tokenizer"], [8, 0, 0], seq_length=8, cache_dir=tmp_path
        )


@pytest.mark.parametrize("split", ["969,30,1", "90,5,5", "8,2", "1,0,0", "98,2,0", "0.7,0.2,0.1"])
@pytest.mark.parametrize("num_documents", [1, 7, 58, 400, 501, 1003])
def test_split_ranges_are_megatrons(split, num_documents):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from agoq.data.indexed import split_document_ranges

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    theirs = [None if b is None else (int(round(b[0] * num_documents)), int(round(b[1] * num_documents)))
              for b in matrix]  # BlendedMegatronDatasetBuilder._build_megatron_dataset_splits
    assert split_document_ranges(num_documents, split) == theirs


def test_megatron_written_files_pass_the_header_check(tiny):
    from agoq.data.indexed import max_token_id, read_index

    ours, theirs = read_index(tiny["prefix"]), IndexedDataset(str(tiny["prefix"]))
    assert ours.num_documents == len(theirs) and ours.dtype == theirs.index.dtype
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    assert max_token_id(ours)[0] == max(int(theirs[i].max()) for i in range(len(theirs)))


_DEFAULT_SPLIT_CHILD = """
import sys
from agoq.data.tokenizer import Tokenizer
from agoq.train.data import build_data_iterators
try:
    build_data_iterators(sys.argv[1], Tokenizer.load(sys.argv[2]), seq_length=32, micro_batch_size=2,
                         global_batch_size=4, dp_rank=0, dp_size=1, train_iters=2, cache_dir=sys.argv[3])
except ValueError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_split_without_documents_stops_instead_of_hanging(tiny, tmp_path):
    """58 documents with the default --split 969,30,1: the test split gets none, and megatron-core's
    GPTDataset._get_num_epochs loops forever on it (issue 21). A child process with a deadline, so a
    regression fails here instead of hanging CI."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _DEFAULT_SPLIT_CHILD, str(tiny["prefix"]), str(tiny["tokenizer"].path),
             str(tmp_path / "indices")],
            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("building GPTDatasets with an empty test split hung (killed after 120 s)")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (f"--split 969,30,1: the test split of {tiny['prefix']} is empty (documents 58..58 of 58, 0 "
            "tokens). Fix: give the test split more weight (e.g. --split 90,5,5) or weight 0 (--split 969,31,0)"
            ) in proc.stdout
