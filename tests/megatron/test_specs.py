"""agoq's spec provider (agoq.megatron.specs) and resolve-first per-layer specs (agoq.megatron.layer_plan) on real
megatron-core (CPU, one gloo rank)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from tests.megatron._tiny import tiny_shape

pytestmark = pytest.mark.megatron

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policy"


def _slots(sub) -> dict:
    """Every slot of a TransformerLayerSubmodules, nested specs and the MLP builder flattened, as comparable values."""
    out = {}
    for f in dataclasses.fields(sub):
        value = getattr(sub, f.name)
        if f.name == "self_attention":
            out["self_attention.module"] = value.module
            out["self_attention.params"] = value.params
            for g in dataclasses.fields(value.submodules):
                out[f"self_attention.{g.name}"] = getattr(value.submodules, g.name)
        elif f.name == "mlp":
            assert isinstance(value, functools.partial) and set(value.keywords) == {"submodules"}
            out["mlp.builder"] = value.func
            for g in dataclasses.fields(value.keywords["submodules"]):
                out[f"mlp.{g.name}"] = getattr(value.keywords["submodules"], g.name)
        else:
            out[f.name] = value
    return out


def test_provider_specs_mirror_megatron_local_spec():
    """Built from agoq's provider, the disabled spec equals megatron-core's local RMSNorm spec slot by slot (bda
    functions, mask type, checkpoint key map included); agoq's spec differs only in the module classes, each a
    subclass of Megatron's in that slot."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    from agoq.megatron.attention import SDPACoreAttention
    from agoq.megatron.specs import AgoqSpecProvider, layer_submodules

    megatron = _slots(get_gpt_layer_local_submodules(normalization="RMSNorm"))
    assert _slots(layer_submodules(AgoqSpecProvider("megatron", agoq_modules=False))) == megatron
    plain_sdpa = _slots(layer_submodules(AgoqSpecProvider("sdpa", agoq_modules=False)))
    assert {k for k in megatron if plain_sdpa[k] != megatron[k]} == {"self_attention.core_attention"}
    assert plain_sdpa["self_attention.core_attention"] is SDPACoreAttention
    agoq = _slots(layer_submodules(AgoqSpecProvider("megatron")))
    differ = {k for k in megatron if agoq[k] != megatron[k]}
    assert differ == {"input_layernorm", "pre_mlp_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj",
                      "mlp.builder", "mlp.linear_fc1", "mlp.linear_fc2"}
    for key in differ - {"mlp.builder", "input_layernorm", "pre_mlp_layernorm"}:
        assert issubclass(agoq[key], megatron[key]) and agoq[key].__module__.startswith("agoq."), key
    assert issubclass(agoq["mlp.builder"].__self__, megatron["mlp.builder"].__self__)
    assert agoq["sharded_state_dict_keys_map"] == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                                   "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def test_provider_refuses_what_agoq_does_not_build():
    from megatron.core.models.backends import BackendSpecProvider

    from agoq.megatron.layers import AgoqColumnParallelLinear, AgoqRMSNorm, AgoqRowParallelLinear
    from agoq.megatron.specs import AgoqSpecProvider

    provider = AgoqSpecProvider()
    assert BackendSpecProvider in type(provider).__mro__  # a Protocol: no isinstance
    assert (provider.column_parallel_linear(), provider.row_parallel_linear(), provider.layer_norm(rms_norm=True)) == (
        AgoqColumnParallelLinear, AgoqRowParallelLinear, AgoqRMSNorm)
    assert provider.fuse_layernorm_and_linear() is False and provider.column_parallel_layer_norm_linear() is None
    with pytest.raises(NotImplementedError, match="RMSNorm"):
        provider.layer_norm(rms_norm=False)
    with pytest.raises(NotImplementedError, match="mixture of experts"):
        provider.grouped_mlp_modules(True)
    with pytest.raises(ValueError, match="--attention-backend 'flash'"):
        AgoqSpecProvider("flash")


def _config(num_layers=3):
    from agoq.megatron.model import ParallelLayout, llama_transformer_config

    return llama_transformer_config(tiny_shape(num_layers=num_layers), ParallelLayout(), params_dtype=torch.float32,
                                    use_cpu_initialization=True)


def test_layers_read_their_rows_from_per_layer_specs(mcore_world1, monkeypatch):
    """The plan resolves a chunk once (one layer-offset computation per chunk, none per layer) into one spec per
    layer with that layer's row; each built layer holds exactly that row, and a layer built from the template spec
    (Megatron-LM's --spec path) gets the same row from the same plan."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from agoq.megatron import layer_plan
    from agoq.megatron.model import agoq_layer_spec, build_model_chunks
    from agoq.megatron.seqpar import block_spec
    from agoq.policy import FP8Spec, ScheduleInfo

    calls = []
    offset = layer_plan.get_transformer_layer_offset
    monkeypatch.setattr(layer_plan, "get_transformer_layer_offset", lambda *a: calls.append(a) or offset(*a))
    config = _config()
    spec = agoq_layer_spec("sdpa", policy=POLICIES / "agoq.yaml", schedule=ScheduleInfo(1, None, 1),
                           compute=FP8Spec(smooth_swiglu="per-token"))
    plan = spec.params["agoq_plan"]
    block = block_spec(spec, config, None)
    assert isinstance(block, TransformerBlockSubmodules) and len(block.layer_specs) == 3 and len(calls) == 1
    rows = [s.params["agoq_layer"] for s in block.layer_specs]
    assert [r.position.layer_idx for r in rows] == [0, 1, 2]
    assert all("agoq_plan" not in s.params for s in block.layer_specs)
    assert rows[1].storage is plan.layers[1] and rows[1].smooth == "per_token" and rows[1].counter is plan.counter
    (model,) = build_model_chunks(tiny_shape(num_layers=3), config, spec, None)
    assert len(calls) == 1  # the chunk's rows were resolved once, by block_spec above
    assert [layer.agoq_options for layer in model.decoder.layers] == rows
    assert all(a is b for a, b in zip((layer.agoq_options for layer in model.decoder.layers), rows, strict=True))
    single = build_module(spec, config=config, layer_number=2)
    assert single.agoq_options is rows[1] and single.layer_number == 2


def test_checkpoint_keys_equal_megatron_local_spec(mcore_world1):
    """agoq's layers save every tensor under the key Megatron's local spec uses (the norms under the fused norm +
    linear names, by the spec's sharded_state_dict_keys_map), with agoq on and off: checkpoints load across both."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from agoq.megatron.model import agoq_layer_spec, build_model_chunks
    from agoq.policy import ScheduleInfo

    def keys(model):
        out = {}
        for name, value in model.sharded_state_dict().items():
            if hasattr(value, "key"):
                out[name] = (value.key, tuple(getattr(value, "global_shape", ())))
        return out

    shape, config = tiny_shape(num_layers=2), _config(num_layers=2)
    megatron = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                        position_embedding_type="rope")
    expected = keys(megatron)
    norm_key = expected["decoder.layers.0.input_layernorm.weight"][0]
    assert norm_key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    for spec in (agoq_layer_spec("sdpa"),
                 agoq_layer_spec("sdpa", policy=POLICIES / "agoq.yaml", schedule=ScheduleInfo(1, None, 1))):
        (model,) = build_model_chunks(shape, config, spec, None)
        assert keys(model) == expected
        assert list(model.state_dict()) == list(megatron.state_dict())  # same names, same order
