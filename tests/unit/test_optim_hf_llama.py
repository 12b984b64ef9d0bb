"""agoq.optim.AdamW / Lion / SGD as drop-in torch.optim optimizers on a Hugging Face ``transformers``
LlamaForCausalLM (small, random, bf16, CPU; the user guide's loop): the state bytes per parameter are the formats'
(FlashOptim's 5.125 B/param for AdamW's matrices: bf16 param 2 + int8 master remainder 1 + two 8-bit moments with an
fp16 scale per 32 elements 2 x 1.0625), and a run resumed through ``state_dict`` / ``load_state_dict`` (via
torch.save) continues bit-identically to the uninterrupted run."""

from __future__ import annotations

import io

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the [hf] extra: pip install 'agoq[hf]'")

from agoq.optim import SGD, AdamW, Lion  # noqa: E402
from agoq.optim.base import DEFAULT_SMALL_NUMEL  # noqa: E402

VOCAB, SEQ, BATCH = 256, 16, 2
# bytes per element of the big tensors (ndim 2, >= DEFAULT_SMALL_NUMEL elements): param + master + states
LARGE_BYTES = {AdamW: 2 + 1 + 2 * (1 + 2 / 32), Lion: 2 + 1 + (1 + 2 / 32), SGD: 2 + 1 + (1 + 2 / 32)}
# the small ones (RMSNorm gains): fp32 states and a split32 master (agoq.optim.base.SMALL_TENSOR_RULE)
SMALL_BYTES = {AdamW: 2 + 2 + 8, Lion: 2 + 2 + 4, SGD: 2 + 2 + 4}
KWARGS = {AdamW: dict(lr=1e-3, weight_decay=0.1), Lion: dict(lr=1e-4, weight_decay=0.1),
          SGD: dict(lr=1e-2, momentum=0.9)}


def _model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(n)]


def _train(model, opt, batches) -> list[float]:
    losses = []
    for ids in batches:  # the user guide's plain loop, docs/user-guide.md
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls", [AdamW, Lion, SGD])
def test_state_bytes_per_parameter_are_the_formats(cls):
    model = _model()
    opt = cls(model.parameters(), **KWARGS[cls])
    assert isinstance(opt, torch.optim.Optimizer)
    _train(model, opt, _batches(1))
    large = [p for p in model.parameters() if p.dim() >= 2 and p.numel() >= DEFAULT_SMALL_NUMEL]
    small = [p for p in model.parameters() if not (p.dim() >= 2 and p.numel() >= DEFAULT_SMALL_NUMEL)]
    assert large and small and all(p.numel() % 32 == 0 for p in large)
    held = opt.state_bytes()
    total = sum(held.values())
    expected = sum(p.numel() for p in large) * LARGE_BYTES[cls] + sum(p.numel() for p in small) * SMALL_BYTES[cls]
    assert total == expected, (held, expected)
    n_large = sum(p.numel() for p in large)
    assert LARGE_BYTES[AdamW] == 5.125  # FlashAdamW's bytes per parameter (docs/numerics.md), asserted above exactly
    assert held["master"] == n_large * 1 + sum(p.numel() for p in small) * 2


@pytest.mark.parametrize("cls", [AdamW, Lion, SGD])
def test_resume_through_state_dict_continues_bit_identically(cls):
    batches = _batches(5)
    model = _model()
    opt = cls(model.parameters(), **KWARGS[cls])
    _train(model, opt, batches[:2])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)
    straight = _train(model, opt, batches[2:])

    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed_model = _model(seed=123)  # other weights: everything must come from the checkpoint
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt = cls(resumed_model.parameters(), **KWARGS[cls])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed = _train(resumed_model, resumed_opt, batches[2:])

    assert resumed == straight  # the losses, bit for bit
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        for key, value in opt.state[p].items():
            other = resumed_opt.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    assert all(int(resumed_opt.state[q]["step"]) == 5 for q in resumed_model.parameters())
    assert straight[0] != _train(_model(), cls(_model().parameters(), **KWARGS[cls]), batches[2:3])[0]  # it trained
