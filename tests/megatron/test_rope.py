"""agoq's fused RoPE in Megatron's fused-RoPE slot (agoq.megatron.rope): the values and gradients of Megatron's
unfused RoPE bit for bit, alone (agoq.ops.rope: the reference on CPU, the Triton kernel on CUDA) and inside a GPT
model (losses and every parameter gradient equal); the slot is recorded for undo; unsupported calls are refused."""

from __future__ import annotations

import pytest
import torch

from tests.megatron._tiny import tiny_shape

pytestmark = pytest.mark.megatron


def _freqs(seq: int, dim: int, percent: float = 1.0) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=percent, rotary_base=10000, use_cpu_initialization=True)
    return rope(seq)  # [s, 1, 1, rotary dim], fp32, as GPTModel computes it


def _bits(x):
    return x.view({torch.float32: torch.int32}.get(x.dtype, torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("s", "b", "n", "d", "percent"), [(9, 2, 3, 16, 1.0), (5, 1, 4, 24, 0.5)])
def test_apply_rope_matches_megatron_unfused_bits(mcore_world1, dtype, s, b, n, d, percent):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from agoq.ops.rope import apply_rope

    device = mcore_world1
    gen = torch.Generator().manual_seed(s * d)
    qkv = (torch.randn(s, b, n + 2, d, generator=gen) * 3).to(dtype).to(device)
    qkv.view(-1)[::7] = -0.0  # signed zeros reach the gradient's sign rule
    grad = (torch.randn(s, b, n, d, generator=gen) * 2).to(dtype).to(device)
    grad.view(-1)[::5] = -0.0
    freqs = _freqs(s, d, percent).to(device)
    outs = {}
    for name, fn in (("megatron", _apply_rotary_pos_emb_bshd), ("agoq", apply_rope)):
        leaf = qkv.clone().requires_grad_(True)
        t = leaf[:, :, 1 : n + 1]  # a strided view, as the query inside the fused QKV output
        out = fn(t, freqs)
        out.backward(grad)
        outs[name] = (out.detach(), leaf.grad[:, :, 1 : n + 1])
    for ours, theirs in zip(outs["agoq"], outs["megatron"], strict=True):
        assert ours.shape == theirs.shape and torch.equal(_bits(ours.contiguous()), _bits(theirs.contiguous()))


def _model(rope_fusion: bool, dtype, policy, device, reference=None, shape=None):
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.policy import ScheduleInfo

    shape = shape or tiny_shape()
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=dtype, use_cpu_initialization=True,
                                      rope_fusion=rope_fusion)
    assert config.apply_rope_fusion is rope_fusion
    spec = agoq_layer_spec("sdpa", policy=policy, schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1))
    (model,) = build_model_chunks(shape, config, spec, None)
    model = model.to(device)
    if dtype == torch.bfloat16:
        model = Float16Module(config, model)
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    from agoq.megatron.activations import storage_of

    model.agoq_storage = storage_of(spec)  # what each layer stores (the planner's LayerStorage per layer)
    return model


def _loss_and_grads(model, device, shape=None):
    shape = shape or tiny_shape()
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length + 1), generator=gen).to(device)
    pos = torch.arange(shape.seq_length, device=device).expand(2, -1)
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_with_agoq_rope_trains_bit_identically_and_undoes(mcore_world1, dtype, monkeypatch):
    """GPTModel with apply_rope_fusion through agoq's slot = the unfused model (loss, every gradient), under agoq's
    default activation policy; the slot is a recorded runtime change and undo empties it."""
    from pathlib import Path

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from agoq.megatron import install
    from agoq.megatron.rope import (
        qkv_rope_fusion_provider,
        rope_fusion_provider,
    )

    assert rope_fusion_provider() == "none" == qkv_rope_fusion_provider()  # no Transformer Engine here
    assert not hasattr(attention, "apply_fused_qkv_rotary_pos_emb")
    from agoq.ops.rope import apply_qkv_rope, apply_rope

    calls, qkv_calls = [], []
    monkeypatch.setattr("agoq.megatron.rope.apply_rope", lambda *a: calls.append(1) or apply_rope(*a))
    monkeypatch.setattr("agoq.megatron.rope.apply_qkv_rope", lambda *a: qkv_calls.append(1) or apply_qkv_rope(*a))
    policy = Path(__file__).resolve().parents[2] / "configs" / "policy" / "agoq.yaml"
    try:
        _check_model_with_agoq_rope(policy, dtype, mcore_world1, calls, qkv_calls)
    finally:
        install.undo_runtime_changes()  # the slots stay empty for the tests after this one, pass or fail
    assert rope_fusion_provider() == "none" and rope_utils.fused_apply_rotary_pos_emb_thd is None
    assert qkv_rope_fusion_provider() == "none" and not attention.HAVE_FUSED_QKV_ROPE
    assert not hasattr(attention, "apply_fused_qkv_rotary_pos_emb")  # undefined again, as without TE


def _check_model_with_agoq_rope(policy, dtype, device, calls, qkv_calls):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from agoq.megatron import install
    from agoq.megatron.rope import agoq_fused_apply_rotary_pos_emb, agoq_fused_qkv_rotary_pos_emb

    plain = _model(False, dtype, policy, device)
    fused = _model(True, dtype, policy, device, reference=plain)
    assert rope_utils.fused_apply_rotary_pos_emb is agoq_fused_apply_rotary_pos_emb
    assert attention.apply_fused_qkv_rotary_pos_emb is agoq_fused_qkv_rotary_pos_emb and attention.HAVE_FUSED_QKV_ROPE
    loss_p, grads_p = _loss_and_grads(plain, device)
    assert not calls and not qkv_calls
    loss_f, grads_f = _loss_and_grads(fused, device)
    # self-attention hands its unsplit QKV output to the QKV slot, once per layer; the per-tensor slot is not used
    assert len(qkv_calls) == tiny_shape().num_layers and not calls
    assert torch.equal(loss_f, loss_p)
    assert grads_f.keys() == grads_p.keys()
    for name, g in grads_p.items():
        assert torch.equal(grads_f[name], g), name
    if dtype == torch.bfloat16:  # the planner models bf16 training (BF16_BYTES per saved element)
        _check_saved_bytes_as_planned(plain, fused, device)
    assert any(c.target.endswith("rope_utils.fused_apply_rotary_pos_emb") for c in install.runtime_changes())
    with pytest.raises(ValueError, match="packed sequences.*--rope-fusion off"):  # thd: refused by name
        rope_utils.fused_apply_rotary_pos_emb_thd(torch.zeros(4, 2, 8), None, _freqs(4, 8))
    assert any(c.target.endswith("attention.apply_fused_qkv_rotary_pos_emb") for c in install.runtime_changes())


def test_per_tensor_rope_slot_alone_matches_the_unfused_model(mcore_world1, monkeypatch):
    """With only the per-tensor slot (the QKV slot off: Megatron's split path, fused_single_qkv_rope False) the model
    equals the unfused one too (what a Transformer Engine install without its QKV RoPE runs)."""
    import dataclasses
    from pathlib import Path

    from agoq.megatron import install
    from agoq.ops.rope import apply_rope

    calls = []
    monkeypatch.setattr("agoq.megatron.rope.apply_rope", lambda *a: calls.append(1) or apply_rope(*a))
    policy = Path(__file__).resolve().parents[2] / "configs" / "policy" / "agoq.yaml"
    try:
        plain = _model(False, torch.bfloat16, policy, mcore_world1)
        fused = _model(True, torch.bfloat16, policy, mcore_world1, reference=plain)
        for module in fused.modules():
            if getattr(module, "config", None) is not None and module.config.fused_single_qkv_rope:
                module.config = dataclasses.replace(module.config, fused_single_qkv_rope=False)
        loss_p, grads_p = _loss_and_grads(plain, mcore_world1)
        assert not calls
        loss_f, grads_f = _loss_and_grads(fused, mcore_world1)
        assert len(calls) == 2 * tiny_shape().num_layers  # the per-tensor slot ran, for query and key
        assert torch.equal(loss_f, loss_p)
        for name, g in grads_p.items():
            assert torch.equal(grads_f[name], g), name
    finally:
        install.undo_runtime_changes()


def test_set_module_attr_adds_an_absent_global_only_when_asked_and_undo_removes_it():
    """The QKV slot is undefined without Transformer Engine: set_module_attr(allow_absent=True) adds it and undo
    removes it again; without allow_absent a missing name (a renamed Megatron global) raises."""
    import types

    from agoq.megatron import install

    module = types.ModuleType("fake_megatron_module")
    with pytest.raises(AttributeError, match="no 'slot' to replace"):
        install.set_module_attr(module, "slot", 1, seam="test")
    install.set_module_attr(module, "slot", 1, seam="test", allow_absent=True)
    assert module.slot == 1
    install.undo_runtime_changes()
    assert not hasattr(module, "slot")


def test_agoq_rope_refuses_what_it_does_not_implement(mcore_world1):
    from agoq.megatron.rope import agoq_fused_apply_rotary_pos_emb, agoq_fused_qkv_rotary_pos_emb

    freqs8 = _freqs(4, 8)
    with pytest.raises(ValueError, match="extra arguments.*--rope-fusion off"):
        agoq_fused_qkv_rotary_pos_emb(torch.zeros(4, 1, 2, 32), freqs8, freqs8, [16, 8, 8], interleaved=True)
    with pytest.raises(ValueError, match="one frequency tensor"):
        agoq_fused_qkv_rotary_pos_emb(torch.zeros(4, 1, 2, 32), freqs8, freqs8.clone(), [16, 8, 8])

    t = torch.zeros(4, 1, 2, 8)
    freqs = _freqs(4, 8)
    with pytest.raises(ValueError, match="rotate-half.*--rope-fusion off"):
        agoq_fused_apply_rotary_pos_emb(t, freqs, interleaved=True)
    with pytest.raises(ValueError, match="inference paths"):
        agoq_fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=True)
    with pytest.raises(ValueError, match="mRoPE"):
        agoq_fused_apply_rotary_pos_emb(t, freqs.expand(4, 2, 1, 8))
    with pytest.raises(ValueError, match="require grad"):
        agoq_fused_apply_rotary_pos_emb(t, freqs.clone().requires_grad_(True))


def _check_saved_bytes_as_planned(plain, fused, device):
    """Megatron's saves per layer (metered) drop by what the planner models for the fused RoPE: the bf16 cos and
    sin that the unfused RoPE keeps for q and for k (agoq.plan.storage.megatron_bytes, rope_fused)."""
    from agoq.megatron.activations import SavedTensorMeter
    from agoq.plan.storage import LayerDims, megatron_bytes

    metered = []
    for model in (plain, fused):
        with SavedTensorMeter([model]) as meter:
            _loss_and_grads(model, device)
        metered.append({k: v for k, v in meter.bytes_by_layer.items() if k is not None})
    shape = tiny_shape()
    dims = LayerDims(seq=shape.seq_length, micro_batch=2, hidden=shape.hidden_size, ffn=shape.ffn_hidden_size,
                     heads=shape.num_attention_heads, groups=shape.num_query_groups, tp=1)
    assert metered[0].keys() == metered[1].keys() == fused.agoq_storage.layers.keys()
    for layer, unfused_bytes in metered[0].items():
        storage = fused.agoq_storage.layers[layer]
        modelled = (sum(megatron_bytes(storage, dims).values())
                    - sum(megatron_bytes(storage, dims, rope_fused=True).values()))
        assert modelled > 0
        assert unfused_bytes - metered[1][layer] == modelled, (layer, unfused_bytes, metered[1][layer], modelled)


def test_qkv_split_stays_megatrons_where_a_rank_holds_part_of_a_query_group():
    """fused_single_qkv_rope only where every tensor-parallel rank holds whole query groups: with fewer groups than
    ranks Megatron picks the rank's query heads on its split path only (agoq.megatron.model.qkv_rope_fusable)."""
    import dataclasses

    from agoq.megatron.model import ParallelLayout, qkv_rope_fusable

    shape = tiny_shape()
    assert qkv_rope_fusable(True, shape, ParallelLayout())
    assert not qkv_rope_fusable(False, shape, ParallelLayout())
    few = dataclasses.replace(shape, num_query_groups=1, num_attention_heads=4)
    assert qkv_rope_fusable(True, few, ParallelLayout(tp=1))
    assert not qkv_rope_fusable(True, few, ParallelLayout(tp=2))
    assert qkv_rope_fusable(True, dataclasses.replace(few, num_query_groups=2), ParallelLayout(tp=2))


# --------------------------------------------------------------------------- LLaMA-3 scaled RoPE ----
# Scaling changes the inverse frequencies only (agoq.ref.rope.ref_llama3_inv_freq); Megatron's RotaryEmbedding
# (rope_scaling=True) computes them and hands its frequency tensor to the fused slot like any other.

@pytest.mark.parametrize(("dim", "base", "factor"), [(16, 500000, 32.0), (128, 500000, 8.0), (64, 10000, 8.0)])
def test_llama3_scaled_frequencies_equal_megatrons_and_transformers_bits(dim, base, factor):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from agoq.ref.rope import LLAMA3_ROPE_FIXED, ref_inv_freq, ref_llama3_inv_freq

    plain = ref_inv_freq(dim, base)
    ours = ref_llama3_inv_freq(plain, factor, **LLAMA3_ROPE_FIXED)
    megatron = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, rotary_base=base, rope_scaling=True,
                               rope_scaling_factor=factor, use_cpu_initialization=True)
    assert torch.equal(plain, RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, rotary_base=base,
                                              use_cpu_initialization=True).inv_freq)
    assert torch.equal(_bits(ours), _bits(megatron.inv_freq))
    # every band is exercised: kept (short wavelengths), divided by the factor (long), blended (between)
    wavelength = 2 * torch.pi / plain
    kept, divided = wavelength < 8192 / 4, wavelength > 8192
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    assert torch.equal(ours[kept], plain[kept]) and torch.equal(ours[divided], plain[divided] / factor)
    blended = ours[~kept & ~divided]
    assert ((blended < plain[~kept & ~divided]) & (blended > plain[~kept & ~divided] / factor)).all()
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, max_position_embeddings=131072,
                                      rope_theta=float(base),
                                      rope_scaling={"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE_FIXED})
    assert torch.equal(_bits(ours), _bits(ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]))


def test_scaled_rope_reaches_the_fused_slot_and_trains_as_unfused(mcore_world1, monkeypatch):
    """A GPTModel of a scaled-RoPE LlamaShape (--use-rope-scaling, factor 32, base 500000, head dim 16): its
    RotaryEmbedding holds the scaled frequencies, the fused QKV slot (agoq's op) receives exactly those, and loss
    and every gradient equal the unfused model's, bit for bit; tying shares one weight."""
    from agoq.megatron import install
    from agoq.ops.rope import apply_qkv_rope
    from agoq.ref.rope import LLAMA3_ROPE_FIXED, ref_inv_freq, ref_llama3_inv_freq

    shape = tiny_shape(rotary_base=500000, rope_scaling=True, rope_scaling_factor=32.0,
                       share_embeddings_and_output_weights=True)
    scaled = ref_llama3_inv_freq(ref_inv_freq(16, 500000), 32.0, **LLAMA3_ROPE_FIXED)
    seen = []
    monkeypatch.setattr("agoq.megatron.rope.apply_qkv_rope",
                        lambda mixed, fq, fk, split: seen.append(fq) or apply_qkv_rope(mixed, fq, fk, split))
    try:
        plain = _model(False, torch.float32, None, mcore_world1, shape=shape)
        fused = _model(True, torch.float32, None, mcore_world1, reference=plain, shape=shape)
        assert torch.equal(plain.rotary_pos_emb.inv_freq, scaled) and torch.equal(fused.rotary_pos_emb.inv_freq, scaled)
        assert plain.output_layer.weight is None and "output_layer.weight" not in plain.state_dict()
        assert sum(p.numel() for p in plain.parameters()) == shape.num_parameters()
        loss_p, grads_p = _loss_and_grads(plain, mcore_world1, shape)
        loss_f, grads_f = _loss_and_grads(fused, mcore_world1, shape)
    finally:
        install.undo_runtime_changes()
    assert len(seen) == shape.num_layers
    positions = torch.arange(shape.seq_length, dtype=torch.float32)
    want = torch.outer(positions, scaled)
    assert torch.equal(seen[0].reshape(shape.seq_length, -1), torch.cat([want, want], dim=-1))
    assert torch.equal(loss_f, loss_p) and grads_f.keys() == grads_p.keys()
    assert all(torch.equal(grads_f[k], g) for k, g in grads_p.items())


def test_rope_scaling_bands_are_checked_against_megatrons(monkeypatch):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from agoq.megatron.model import check_rope_scaling_bands

    check_rope_scaling_bands()  # megatron-core 0.19.2: low 1, high 4, original 8192

    def other(self, freqs, factor=8, low_freq_factor=1, high_freq_factor=2, original_max_position_embeddings=8192):
        return freqs

    monkeypatch.setattr(RotaryEmbedding, "_apply_scaling", other)
    with pytest.raises(RuntimeError, match="'high_freq_factor': 2.*agoq expects.*'high_freq_factor': 4.0"):
        check_rope_scaling_bands()


def test_megatron_lm_door_passes_the_rope_scaling_factor(mcore_world1):
    """The model provider of the Megatron-LM door (--use-rope-scaling --rope-scaling-factor 32): the factor reaches
    RotaryEmbedding (it used to be dropped: Megatron's default 8 always)."""
    from agoq.config import AgoqConfig
    from agoq.megatron.megatron_lm import GPTModelOptions, build_gpt_model
    from agoq.megatron.model import ParallelLayout, llama_transformer_config
    from agoq.ref.rope import LLAMA3_ROPE_FIXED, ref_inv_freq, ref_llama3_inv_freq

    shape = tiny_shape(rotary_base=500000)
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.float32, use_cpu_initialization=True)
    options = GPTModelOptions(vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length, rotary_base=500000,
                              rope_scaling=True, rope_scaling_factor=32.0)
    model = build_gpt_model(AgoqConfig(enabled=False, device="cpu"), options, config, pre_process=True,
                            post_process=True)
    want = ref_llama3_inv_freq(ref_inv_freq(16, 500000), 32.0, **LLAMA3_ROPE_FIXED)
    assert torch.equal(model.rotary_pos_emb.inv_freq, want)
