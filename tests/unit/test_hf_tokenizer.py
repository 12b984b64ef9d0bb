"""HF ``tokenizers`` files (tokenizer.json) as agoq tokenizers (issue 22 item 3), with a byte-level BPE trained
here by the ``tokenizers`` library (LLaMA-3's format: byte-level BPE, special tokens as added tokens)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from agoq.data.tokenizer import HFTokenizer, Tokenizer, encode_documents, is_hf_tokenizer_file, padded_vocab_size
from agoq.testing.hf import stdlib_texts, train_bpe_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    return train_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", VOCAB)


def test_load_dispatches_on_the_file_and_reads_ids_from_it(tok_path):
    tok = Tokenizer.load(tok_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == VOCAB  # added (special) tokens included: LLaMA-3's file gives 128,256
    assert (tok.bos_id, tok.eod_id, tok.pad_id) == (0, 1, -1)  # <|begin_of_text|>, <|end_of_text|>, none
    assert padded_vocab_size(tok.vocab_size) == 384


def test_encode_decode_round_trip_without_template(tok_path):
    tok = Tokenizer.load(tok_path)
    text = "def f(x):\n\treturn  x  # ünïcode ✓\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.bos_id not in ids and tok.eod_id not in ids  # documents get no BOS; prepare_data appends EOD
    assert tok.encode_batch([text, "a"]) == [ids, tok.encode("a")]
    assert tok.id_to_piece(tok.eod_id) == "<|end_of_text|>"


def test_pickles_and_encodes_in_worker_processes(tok_path):
    tok = Tokenizer.load(tok_path)
    clone = pickle.loads(pickle.dumps(tok))
    assert (clone.sha256, clone.eod_id, clone.vocab_size) == (tok.sha256, tok.eod_id, tok.vocab_size)
    texts = stdlib_texts()
    assert list(encode_documents(texts, tok, workers=2, chunk_docs=1)) == [tok.encode(t) for t in texts]


def test_tokenizer_config_names_the_special_tokens(tok_path, tmp_path):
    """As transformers ships them: tokenizer_config.json next to tokenizer.json wins over the name list."""
    (tmp_path / "tokenizer.json").write_bytes(tok_path.read_bytes())
    config = {"bos_token": {"content": "<|end_of_text|>"}, "eos_token": "<|begin_of_text|>",
              "pad_token": "<|end_of_text|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eod_id, tok.pad_id) == (1, 0, 1)


def test_a_file_without_an_end_of_document_token_is_refused_when_asked(tok_path, tmp_path):
    data = json.loads(tok_path.read_text())
    for token in data["added_tokens"]:
        token["content"] = token["content"].replace("text", "txt")  # names no known EOS
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    tok = Tokenizer.load(path)
    with pytest.raises(ValueError, match="names no end-of-document token.*eos_token"):
        _ = tok.eod_id


def test_only_real_tokenizers_json_files_dispatch(tok_path, tmp_path):
    assert is_hf_tokenizer_file(tok_path.read_bytes())
    # agoq's own <prefix>.tokenizer.json data record is not a tokenizer
    assert not is_hf_tokenizer_file(json.dumps({"vocab_size": 3, "sha256": "x", "file": "t.model"}).encode())
    assert not is_hf_tokenizer_file(b"\x0a\x0b binary sentencepiece")
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "nonsense"}, "added_tokens": []}')
    with pytest.raises(ValueError, match="not a loadable Hugging Face tokenizers file"):
        Tokenizer.load(broken)
