"""agoq.data.tokenizer: training, determinism, round trips, foreign models, padding, parallel encoding."""

import io
import pickle

import pytest
import sentencepiece as spm

from agoq.data.corpus import collect_stdlib_corpus
from agoq.data.tokenizer import (
    EOS_ID,
    PAD_ID,
    Tokenizer,
    TokenizerTrainConfig,
    encode_documents,
    padded_vocab_size,
    train_sentencepiece,
)

# 512 KiB of stdlib text and 512 pieces: trains in well under a second, still has real merges.
TINY_CAP_BYTES = 512 * 1024
TINY_VOCAB = 512
# Characters absent from code/prose (accents, CJK, emoji, controls) must survive via byte fallback.
AWKWARD_TEXT = "  leading spaces\n\n\ttabs\r\nnaïve café 漢字 🙂 \x00 trailing  "


@pytest.fixture(scope="module")
def tiny_texts():
    return [doc.text for doc in collect_stdlib_corpus(TINY_CAP_BYTES).documents]


@pytest.fixture(scope="module")
def tiny_model(tiny_texts, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny.model"
    return train_sentencepiece(tiny_texts, path, TokenizerTrainConfig(vocab_size=TINY_VOCAB))


def _pieces_and_scores(model_bytes):
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]


def test_tokenizer_special_ids_and_size(tiny_model):
    tok = Tokenizer.load(tiny_model)
    assert tok.vocab_size == TINY_VOCAB
    assert (tok.eod_id, tok.pad_id) == (EOS_ID, PAD_ID)
    assert tok.eod_id != tok.pad_id  # Megatron drops a pad id that collides with eod


def test_tokenizer_round_trip_whole_corpus(tiny_model, tiny_texts):
    tok = Tokenizer.load(tiny_model)
    encoded = tok.encode_batch(tiny_texts)
    assert [tok.decode(ids) for ids in encoded] == tiny_texts
    # Merges happened: fewer tokens than UTF-8 bytes (byte-level would be exactly equal).
    assert sum(map(len, encoded)) < sum(len(t.encode()) for t in tiny_texts)


def test_tokenizer_byte_fallback_encodes_anything(tiny_model):
    tok = Tokenizer.load(tiny_model)
    ids = tok.encode(AWKWARD_TEXT)
    assert tok.decode(ids) == AWKWARD_TEXT
    assert 0 not in ids  # no <unk>: every character is a piece or bytes


def test_tokenizer_training_is_deterministic(tiny_texts, tiny_model, tmp_path):
    again = train_sentencepiece(
        tiny_texts, tmp_path / "again.model", TokenizerTrainConfig(vocab_size=TINY_VOCAB)
    )
    assert again.read_bytes() == tiny_model.read_bytes()
    # The thread count is recorded in the model's trainer spec, so compare pieces and scores.
    one_thread = train_sentencepiece(
        tiny_texts, tmp_path / "t1.model", TokenizerTrainConfig(vocab_size=TINY_VOCAB, num_threads=1)
    )
    assert _pieces_and_scores(one_thread.read_bytes()) == _pieces_and_scores(tiny_model.read_bytes())


def test_tokenizer_training_depends_on_data(tiny_texts, tiny_model, tmp_path):
    other = train_sentencepiece(
        tiny_texts[::-1][: len(tiny_texts) // 2],
        tmp_path / "o.model",
        TokenizerTrainConfig(vocab_size=TINY_VOCAB),
    )
    assert _pieces_and_scores(other.read_bytes()) != _pieces_and_scores(tiny_model.read_bytes())


def _train_foreign_model(texts, **special_ids) -> bytes:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        **special_ids,
    )
    return buf.getvalue()


def test_tokenizer_loads_llama_style_model_without_pad(tiny_texts, tmp_path):
    # LLaMA's tokenizer.model: <unk>=0, <s>=1, </s>=2, no pad piece (pad_id=-1).
    path = tmp_path / "llama_like.model"
    path.write_bytes(_train_foreign_model(tiny_texts[:50], unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
    tok = Tokenizer.load(path)
    assert (tok.eod_id, tok.pad_id, tok.bos_id) == (2, -1, 1)
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"


def test_tokenizer_without_eos_refuses_eod(tiny_texts, tmp_path):
    path = tmp_path / "no_eos.model"
    path.write_bytes(_train_foreign_model(tiny_texts[:50], eos_id=-1))
    with pytest.raises(ValueError, match="no </s> piece"):
        _ = Tokenizer.load(path).eod_id


def test_tokenizer_load_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.load(tmp_path / "missing.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        Tokenizer.load(garbage)
    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")  # sentencepiece itself "loads" it as a model of 0 pieces (issue 21)
    with pytest.raises(ValueError, match=r"empty.model is empty; pass the SentencePiece \.model"):
        Tokenizer.load(empty)


def test_tokenizer_training_reraises_input_errors(tiny_texts, tmp_path):
    def texts():
        yield from tiny_texts[:5]
        raise ValueError("data.jsonl:7: invalid JSON")

    with pytest.raises(ValueError, match=r"^data\.jsonl:7: invalid JSON$"):
        train_sentencepiece(texts(), tmp_path / "t.model", TokenizerTrainConfig(vocab_size=TINY_VOCAB))
    assert not (tmp_path / "t.model").exists()


def test_tokenizer_config_validation():
    with pytest.raises(ValueError, match="below"):
        TokenizerTrainConfig(vocab_size=100)
    with pytest.raises(ValueError, match="model_type"):
        TokenizerTrainConfig(model_type="wordpiece")


def test_tokenizer_pickles_as_model_bytes(tiny_model):
    tok = Tokenizer.load(tiny_model)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.sha256 == tok.sha256
    assert clone.encode(AWKWARD_TEXT) == tok.encode(AWKWARD_TEXT)


def test_encode_documents_parallel_keeps_order(tiny_model, tiny_texts):
    tok = Tokenizer.load(tiny_model)
    texts = tiny_texts[:40]
    serial = list(encode_documents(texts, tok, workers=1, chunk_docs=7))
    assert serial == [tok.encode(t) for t in texts]
    assert list(encode_documents(texts, tok, workers=2, chunk_docs=3)) == serial
    with pytest.raises(ValueError, match="workers"):
        list(encode_documents(texts, tok, workers=0))


@pytest.mark.parametrize(
    ("vocab", "tp", "divisible_by", "expected"),
    [
        (32000, 1, 128, 32000),  # LLaMA-2: already a multiple of 128
        (32001, 1, 128, 32128),
        (4096, 2, 128, 4096),
        (4097, 2, 128, 4352),  # next multiple of 256
        (50257, 8, 128, 51200),  # GPT-2 vocab at TP=8: 1024 * 50
        (1, 1, 1, 1),
    ],
)
def test_padded_vocab_size(vocab, tp, divisible_by, expected):
    padded = padded_vocab_size(vocab, tp, divisible_by)
    assert padded == expected
    assert padded % (divisible_by * tp) == 0 and 0 <= padded - vocab < divisible_by * tp


def test_padded_vocab_size_rejects_nonpositive():
    with pytest.raises(ValueError, match="positive"):
        padded_vocab_size(0, 1)
