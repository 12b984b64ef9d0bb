"""agoq.data.corpus: default stdlib corpus (order, cap, manifest) and user input readers (errors)."""

import json
import platform

import pytest

from agoq.data.corpus import (
    DEFAULT_MAX_BYTES,
    check_input_paths,
    collect_stdlib_corpus,
    iter_input_documents,
    iter_jsonl_documents,
    iter_text_documents,
)

# A small real-stdlib cap: enough for the pydoc topics plus some files, read in well under a second.
SMALL_CAP_BYTES = 256 * 1024


@pytest.fixture
def fake_stdlib(tmp_path):
    """A miniature stdlib tree exercising every selection rule."""
    root = tmp_path / "Lib"
    (root / "pydoc_data").mkdir(parents=True)
    (root / "pydoc_data" / "topics.py").write_text(
        "# generated\ntopics = {'while': 'The while statement', 'assert': 'The assert statement'}\n"
    )
    (root / "pkg").mkdir()
    (root / "pkg" / "b.py").write_text('"""Module b."""\nx = 1\n')
    (root / "pkg" / "a.py").write_text('"""Module a."""\n')
    (root / "zz.py").write_text("# last\n")
    (root / "NOTES.txt").write_text("release notes\n")
    (root / "empty.py").write_text("")
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8
    for excluded in ("test", "site-packages", "pkg/tests", "__pycache__"):
        (root / excluded).mkdir(parents=True, exist_ok=True)
        (root / excluded / "skipped.py").write_text("skipped = True\n")
    return root


def test_corpus_order_and_exclusions(fake_stdlib):
    corpus = collect_stdlib_corpus(stdlib_dir=fake_stdlib)
    names = [doc.name for doc in corpus.documents]
    assert names == [
        "pydoc_topics:assert",
        "pydoc_topics:while",
        "stdlib:NOTES.txt",
        "stdlib:pkg/a.py",
        "stdlib:pkg/b.py",
        "stdlib:zz.py",
    ]
    assert corpus.manifest["num_skipped_not_utf8"] == 1
    assert corpus.manifest["num_documents"] == len(names)
    assert corpus.manifest["num_bytes"] == sum(len(d.text.encode()) for d in corpus.documents)


def test_corpus_cap_skips_documents_that_do_not_fit(fake_stdlib):
    full = collect_stdlib_corpus(stdlib_dir=fake_stdlib)
    sizes = [len(d.text.encode()) for d in full.documents]
    cap = sizes[0] + sizes[-1]  # room for the first and the last document only
    big_middle = [d for d, s in zip(full.documents[1:-1], sizes[1:-1], strict=True) if s > sizes[-1]]
    capped = collect_stdlib_corpus(cap, stdlib_dir=fake_stdlib)
    assert capped.manifest["num_bytes"] <= cap
    assert capped.documents[0] == full.documents[0]
    assert all(doc not in capped.documents for doc in big_middle)
    assert capped.manifest["num_skipped_over_cap"] == len(full.documents) - len(capped.documents)


def test_corpus_manifest_changes_with_content(fake_stdlib):
    before = collect_stdlib_corpus(stdlib_dir=fake_stdlib).manifest
    again = collect_stdlib_corpus(stdlib_dir=fake_stdlib).manifest
    (fake_stdlib / "pkg" / "a.py").write_text('"""Module a, edited."""\n')
    after = collect_stdlib_corpus(stdlib_dir=fake_stdlib).manifest
    assert before == again
    assert before["sha256"] != after["sha256"]


def test_corpus_real_stdlib_is_deterministic_prose():
    first = collect_stdlib_corpus(SMALL_CAP_BYTES)
    second = collect_stdlib_corpus(SMALL_CAP_BYTES)
    assert first == second
    manifest = first.manifest
    assert manifest["python_version"] == platform.python_version()
    assert 0 < manifest["num_bytes"] <= SMALL_CAP_BYTES
    # The language reference comes first: natural-language prose, not random tokens.
    assert first.documents[0].name.startswith("pydoc_topics:")
    assert "statement" in " ".join(doc.text for doc in first.documents[:20])
    json.dumps(manifest)  # the manifest is written to disk as JSON


def test_corpus_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        collect_stdlib_corpus(0)
    with pytest.raises(ValueError, match="does not exist"):
        collect_stdlib_corpus(DEFAULT_MAX_BYTES, stdlib_dir=tmp_path / "missing")


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_reads_documents_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path / "d.jsonl", '{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    docs = list(iter_jsonl_documents(path))
    assert [d.text for d in docs] == ["one", "two"]
    assert docs[1].name == f"{path}:3"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": "broken"\n', r"d\.jsonl:2: invalid JSON"),
        (
            '{"text": "ok"}\n{"body": "x", "id": 1}\n',
            r"d\.jsonl:2: key 'text' missing \(keys present: body, id\); pass --json-key",
        ),
        ('["a list"]\n', r"d\.jsonl:1: expected a JSON object"),
        ('{"text": 5}\n', r"d\.jsonl:1: 'text' must be a string"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    path = _write(tmp_path / "d.jsonl", content)
    with pytest.raises(ValueError, match=message):
        list(iter_jsonl_documents(path))


def test_jsonl_custom_key(tmp_path):
    path = _write(tmp_path / "d.jsonl", '{"body": "x"}\n')
    assert [d.text for d in iter_jsonl_documents(path, json_key="body")] == ["x"]


def test_txt_file_and_paragraph_modes(tmp_path):
    path = _write(tmp_path / "t.txt", "p1 line1\np1 line2\n\n\np2\n  \np3")
    assert [d.text for d in iter_text_documents(path, "file")] == [path.read_text()]
    paragraphs = list(iter_text_documents(path, "paragraph"))
    assert [d.text for d in paragraphs] == ["p1 line1\np1 line2\n", "p2\n", "p3"]
    assert [d.name for d in paragraphs] == [f"{path}:1", f"{path}:5", f"{path}:7"]
    with pytest.raises(ValueError, match="txt_mode"):
        list(iter_text_documents(path, "lines"))


def test_input_paths_are_checked(tmp_path):
    good = _write(tmp_path / "a.txt", "x")
    with pytest.raises(ValueError, match="does not exist"):
        check_input_paths([good, tmp_path / "missing.jsonl"])
    with pytest.raises(NotImplementedError, match="unsupported suffix '.csv'"):
        check_input_paths([_write(tmp_path / "a.csv", "")])
    with pytest.raises(ValueError, match="no input files"):
        check_input_paths([])


def test_input_documents_mix_formats_in_order(tmp_path):
    jsonl = _write(tmp_path / "a.jsonl", '{"text": "j1"}\n{"text": "  "}\n{"text": "j2"}\n')
    txt = _write(tmp_path / "b.txt", "t1\n\nt2\n")
    texts = [d.text for d in iter_input_documents([txt, jsonl], txt_mode="paragraph")]
    assert texts == ["t1\n", "t2\n", "j1", "j2"]  # whitespace-only documents are skipped


def test_parquet_rows_are_documents_in_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from agoq.data.corpus import PARQUET_BATCH_ROWS, iter_input_documents

    texts = [f"document number {i}" for i in range(PARQUET_BATCH_ROWS + 3)]  # crosses a batch boundary
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    docs = list(iter_input_documents([path]))
    assert [d.text for d in docs] == texts
    assert docs[-1].name == f"{path}:row {len(texts)}"
    with pytest.raises(ValueError, match="column 'body' missing"):
        list(iter_input_documents([path], json_key="body"))
