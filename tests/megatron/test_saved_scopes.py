"""The activation policy on modules agoq did not build (agoq/megatron/saved_scopes.py), on Megatron's own local spec
(CPU, one gloo rank). Transformer Engine's spec is the GPU test's (tests/gpu/test_te_agoq_gpu.py); the scopes find
their modules by Megatron's submodule names, which both specs share.

Claims:
  * the forward is unchanged (losses bit for bit) and the gradients stay above the quantization's SQNR floor
    (the argument of test_activations.py: k saved tensors per backward path, 10 dB slack);
  * every layer's roles are stored, with the exact bytes of the format (planner arithmetic: ``storage_bytes``);
  * a bf16 policy adds no scope and trains bit-identically; removing the handles restores plain saves;
  * a policy that quantizes the attention tensors is refused naming the file, layer and role.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.megatron._tiny import TINY_SEQ, TINY_VOCAB, tiny_shape

pytestmark = pytest.mark.megatron

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policy"
MICRO_BATCH = 2
GRAD_FLOOR_SLACK_DB = 10.0
MIN_NUMEL = 1024  # the tiny model's activations are 64 tokens x >= 64; its norm statistics 64 values


def _plain_model(reference=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from agoq.megatron.model import ParallelLayout, build_model_chunks, llama_transformer_config

    shape = tiny_shape()
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.float32, use_cpu_initialization=True)
    (model,) = build_model_chunks(shape, config, get_gpt_layer_local_spec(normalization="RMSNorm"), None)
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    return model


def _loss_and_grads(model):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TINY_VOCAB, (MICRO_BATCH, TINY_SEQ + 1), generator=g)
    pos = torch.arange(TINY_SEQ).expand(MICRO_BATCH, -1)
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _apply(model, policy: str, min_numel):
    from agoq.megatron import saved_scopes
    from agoq.policy import ScheduleInfo, load_policy

    spec = load_policy(POLICIES / f"{policy}.yaml" if "/" not in policy else Path(policy))
    return saved_scopes.apply_saved_scopes([model], spec, ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1),
                                           min_numel=min_numel)


def _policy_file(tmp_path, fmt_name: str) -> str:
    """Every layer role in ``fmt_name`` but attention's tensors (which the scopes leave to the attention)."""
    path = tmp_path / f"{fmt_name}.yaml"
    path.write_text(f"version: 1\ndefault: {{activations: {fmt_name}}}\nrules:\n"
                    "  - when: {role: [attn.q, attn.k, attn.v, attn.out]}\n    set: {activations: bf16}\n")
    return str(path)


@pytest.mark.parametrize("fmt_name", ["int8_b128", "nf4_b64"])
def test_scopes_store_every_role_and_keep_the_forward(mcore_world1, fmt_name, tmp_path):
    from agoq.formats import parse_format
    from agoq.testing.numerics import gaussian_floor_db, sqnr_db

    ref = _plain_model()
    model = _plain_model(reference=ref)
    stats, handles = _apply(model, _policy_file(tmp_path, fmt_name), min_numel=MIN_NUMEL)
    loss_ref, grads_ref = _loss_and_grads(ref)
    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, loss_ref), "the forward changed"
    floor = gaussian_floor_db(parse_format(fmt_name)) - GRAD_FLOOR_SLACK_DB
    for name, g in grads_ref.items():
        assert sqnr_db(g, grads[name]) >= floor, f"{name}: gradient SQNR below {floor:.1f} dB"
    assert any(not math.isinf(sqnr_db(g, grads[n])) for n, g in grads_ref.items() if "decoder.layers" in n)
    shape, fmt = tiny_shape(), parse_format(fmt_name)
    tokens = MICRO_BATCH * TINY_SEQ
    hidden, q_width = shape.hidden_size, shape.hidden_size  # attention output width = heads x head dim = hidden
    expected = {"attn.qkv_input": fmt.storage_bytes(tokens * hidden),
                "attn.proj_input": fmt.storage_bytes(tokens * q_width),
                "mlp.fc1_input": fmt.storage_bytes(tokens * hidden),
                "mlp.swiglu_input": fmt.storage_bytes(tokens * 2 * shape.ffn_hidden_size),
                "mlp.fc2_input": fmt.storage_bytes(tokens * shape.ffn_hidden_size)}
    for layer in range(shape.num_layers):
        got = {role: b for (idx, role), b in stats.counter.packed.items() if idx == layer}
        # the pre-norms (torch's composite RMSNorm on the CPU) save their input and normalized values, each T x H
        norm = got.pop("norm.input", 0)
        assert norm > 0 and norm % fmt.storage_bytes(tokens * hidden) == 0, f"layer {layer}: norm bytes {norm}"
        assert got == expected, f"layer {layer}: stored {got}, expected {expected}"
    for handle in handles:
        handle.remove()
    before = stats.counter.total()
    _, grads_after = _loss_and_grads(model)
    assert stats.counter.total() == before, "removed scopes still quantize"
    _, grads_ref2 = _loss_and_grads(ref)
    assert all(torch.equal(grads_after[n], g) for n, g in grads_ref2.items())


def test_bf16_policy_adds_no_scope(mcore_world1):
    ref = _plain_model()
    model = _plain_model(reference=ref)
    stats, handles = _apply(model, "bf16", min_numel=MIN_NUMEL)
    assert stats.scopes == 0 and handles == []
    _, grads_ref = _loss_and_grads(ref)
    _, grads = _loss_and_grads(model)
    assert all(torch.equal(grads[n], g) for n, g in grads_ref.items())


def test_default_threshold_keeps_small_tensors_and_says_why(mcore_world1, tmp_path):
    model = _plain_model()
    # the default threshold: the tiny model's activations are all below it
    stats, _ = _apply(model, _policy_file(tmp_path, "int8_b128"), min_numel=1 << 16)
    _loss_and_grads(model)
    assert stats.counter.total() == 0
    assert stats.kept_bytes.get("small (statistics, buffers)", 0) > 0
    assert stats.kept_bytes.get("parameter", 0) > 0  # the linears' weights are saved and left alone


def test_quantized_attention_tensors_are_refused(mcore_world1, tmp_path):
    policy = tmp_path / "attn4.yaml"
    policy.write_text("version: 1\ndefault: {activations: int8_b128}\n")
    with pytest.raises(ValueError, match=r"attn4.yaml: layer 0 role attn.q resolves to int8_b128.*bf16"):
        _apply(_plain_model(), str(policy), MIN_NUMEL)
