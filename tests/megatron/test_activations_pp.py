"""PP=2 (and PP=2 x VPP=2) on 2 gloo ranks: every stage's layers get the formats the policy's auto
rule gives its pipeline rank, keyed by global layer index; bf16 policy bit-identical to the plain
spec through the real 1F1B schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policy"
NUM_MICROBATCHES, MICRO_BATCH = 4, 2


def _rank(rank: int, world_size: int, vpp) -> dict:
    from megatron.core import parallel_state

    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.activations import storage_of
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.policy import ScheduleInfo
    from tests.megatron._tiny import tiny_shape

    handle = install(AgoqConfig(device="cpu"))
    try:
        layout = ParallelLayout(tp=1, pp=2, vpp=vpp)
        runtime.init_model_parallel(layout, seed=1234, device=torch.device("cpu"))
        shape = tiny_shape(num_layers=4)
        config = llama_transformer_config(shape, layout, params_dtype=torch.float32, use_cpu_initialization=True)
        schedule = ScheduleInfo(pp_size=2, vp_size=vpp, num_microbatches=NUM_MICROBATCHES)
        out, reference = {}, None
        for policy in (None, "bf16", "agoq"):
            spec = agoq_layer_spec("sdpa", policy=None if policy is None else POLICIES / f"{policy}.yaml",
                                   schedule=schedule)
            chunks = build_model_chunks(shape, config, spec, vpp)
            if reference is None:
                reference = chunks
            else:  # same weights for every variant (parameter names are unchanged by agoq's spec)
                for chunk, ref in zip(chunks, reference, strict=True):
                    chunk.load_state_dict(ref.state_dict())
            storage = storage_of(spec)
            formats = {} if storage is None else {
                idx: {r: s.describe() for r, s in layer.roles.items()} for idx, layer in storage.layers.items()}
            out[policy] = {"formats": formats, "grads": _one_step(chunks, shape)}
        parallel_state.destroy_model_parallel()
        return out
    finally:
        handle.uninstall()


def _one_step(chunks, shape) -> dict:
    """One 1F1B (or interleaved) forward/backward with the real schedule; per-parameter grads."""
    from tests.megatron._pipeline import one_global_batch

    one_global_batch(chunks, shape, NUM_MICROBATCHES, MICRO_BATCH)
    return {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def _expected(vpp):
    from agoq.policy import ScheduleInfo, auto_names, load_policy

    names = auto_names(load_policy(POLICIES / "agoq.yaml"), ScheduleInfo(2, vpp, NUM_MICROBATCHES))
    return names  # per pipeline rank


@pytest.mark.parametrize("vpp", [None, 2])
def test_pp2_stages_get_their_auto_formats_and_bf16_is_neutral(vpp):
    from agoq.testing.dist import spawn_ranks

    # spawn, not fork: a parent that already ran in-process megatron (mcore_world1) segfaults forked children
    per_rank = spawn_ranks(2, _rank, args=(vpp,))
    names = _expected(vpp)
    # layer placement (megatron-core 0.19.2): no VPP: rank 0 {0,1}, rank 1 {2,3}; VPP=2: rank 0 {0,2}, rank 1 {1,3}
    placement = {None: ({0, 1}, {2, 3}), 2: ({0, 2}, {1, 3})}[vpp]
    for rank, result in enumerate(per_rank):
        formats = result["agoq"]["formats"]
        assert set(formats) == placement[rank], (rank, sorted(formats))
        want = names[rank]
        stored = "bf16" if want == "bf16" else want
        for idx, roles in formats.items():
            assert roles["norm.input"] == stored and roles["mlp.swiglu_input"] == stored, (rank, idx, roles)
            assert roles["attn.q"] == "bf16"
        bf16, plain = result["bf16"]["grads"], result[None]["grads"]
        assert bf16.keys() == plain.keys()
        for name in plain:
            assert torch.equal(bf16[name], plain[name]), (rank, name)
    assert names[0] != names[1]  # the two stages really differ (rank 0 holds more micro-batches)
