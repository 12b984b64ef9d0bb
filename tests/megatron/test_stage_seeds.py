"""Initial weights per pipeline stage: each pipeline rank seeds Megatron's RNG tracker and torch with seed + 100 x its
rank, as Megatron-LM's ``_set_random_seed`` does (agoq.megatron.runtime.stage_seed). With one seed on every rank, the
stages that hold neither the embedding nor anything drawn before their layers (every stage past the first) drew the
same numbers in the same order: at PP=3 on 3 gloo ranks, stages 1 and 2 started as exact copies of each other."""

from __future__ import annotations

import pytest
import torch

from agoq.testing.dist import spawn_ranks
from tests.megatron._tiny import tiny_shape

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

SEED = 1234


def _first_layer_weights(rank: int, world_size: int) -> dict:
    from agoq.megatron import runtime
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config

    shape, layout = tiny_shape(num_layers=world_size), ParallelLayout(tp=1, pp=world_size)
    runtime.init_model_parallel(layout, seed=SEED, device=torch.device("cpu"))
    torch_seed = torch.initial_seed()
    config = llama_transformer_config(shape, layout, params_dtype=torch.float32, use_cpu_initialization=True)
    (chunk,) = build_model_chunks(shape, config, agoq_layer_spec("sdpa"), None)
    layer = chunk.decoder.layers[0]
    weights = {name: p.detach().clone() for name, p in layer.named_parameters() if p.dim() == 2}
    return {"torch_seed": torch_seed, "weights": weights}


def test_each_pipeline_stage_draws_its_own_initial_weights():
    ranks = spawn_ranks(3, _first_layer_weights)
    from agoq.megatron.runtime import PIPELINE_RANK_SEED_STRIDE, stage_seed

    assert PIPELINE_RANK_SEED_STRIDE == 100  # Megatron-LM's offset: same seeds, same weights as its trainer
    assert [r["torch_seed"] for r in ranks] == [stage_seed(SEED, rank) for rank in range(3)] == [1234, 1334, 1434]
    names = ranks[1]["weights"].keys()
    assert len(names) >= 4 and names == ranks[2]["weights"].keys()  # qkv, proj, fc1, fc2 on every stage
    for name in names:
        first, second = ranks[1]["weights"][name], ranks[2]["weights"][name]
        assert first.std() > 0 and not torch.equal(first, second), name  # one seed everywhere: equal
        # the same init distribution (Megatron's init_method, std 0.02 or its depth-scaled variant) on both stages
        assert torch.allclose(first.std(), second.std(), rtol=0.2), name
