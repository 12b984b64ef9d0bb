"""Never silent (agoq/megatron/built_check.py): the check both trainers make after the model, its DDP and the optimizer
are built. On real megatron-core (CPU, one gloo rank), tiny models built the way agoq builds them and the way
Megatron builds them without agoq: what the flags ask for and was not built is named, piece by piece; what was built
as asked passes. End to end through megatron.training: tests/megatron/test_megatron_lm_door.py."""

from __future__ import annotations

import pytest
import torch

from tests.megatron._tiny import tiny_shape

pytestmark = pytest.mark.megatron

FULL = ["--agoq-grads", "int8_b256", "--agoq-optimizer", "adamw"]


def _args(flags):
    from agoq.train.args import parse_args

    return parse_args(flags)


def _build(args, *, attention: str, policy, grads: str | None, agoq_optimizer: bool, device):
    """(model chunks, optimizer) of the tiny model: ``policy`` None builds Megatron's local spec (no agoq layers)."""
    from megatron.core.optimizer import get_megatron_optimizer

    from agoq.config.sections import GradsConfig
    from agoq.megatron.grads.ddp import wrap_ddp_agoq
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.megatron.optim.optimizer import build_agoq_optimizer
    from agoq.policy import ScheduleInfo, load_policy
    from agoq.train.megatron_setup import ddp_config, megatron_optimizer_config

    shape = tiny_shape()
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.float32, use_cpu_initialization=True)
    spec = agoq_layer_spec(attention, policy=None if policy is None else load_policy(policy),
                           schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1))
    model = wrap_ddp_agoq(build_model_chunks(shape, config, spec, None), config, ddp_config(args, torch.float32),
                          device, None if grads is None else GradsConfig(format=grads, transport="nccl"))
    opt_config = megatron_optimizer_config(args, torch.float32)
    optimizer = build_agoq_optimizer(args.agoq_config, opt_config, model) if agoq_optimizer else \
        get_megatron_optimizer(opt_config, model)
    return model, optimizer


def _expect(attention="sdpa"):
    from agoq.megatron.built_check import Expectation
    from agoq.policy import ScheduleInfo

    return Expectation(attention, ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1), how_to_fix="FIX HERE")


DEFAULT_POLICY = "configs/policy/agoq.yaml"


def test_what_agoq_builds_passes(mcore_world1):
    from agoq.megatron.built_check import built_problems, check_built

    args = _args(FULL)
    model, optimizer = _build(args, attention="sdpa", policy=DEFAULT_POLICY, grads="int8_b256", agoq_optimizer=True,
                              device=mcore_world1)
    assert built_problems(args.agoq_config, model, optimizer, _expect()) == []
    check_built(args.agoq_config, model, optimizer, _expect())  # raises nothing


def test_megatrons_own_model_ddp_and_optimizer_are_each_named(mcore_world1):
    """What the old Megatron-LM hooks gave on the config-container path: Megatron's layers, DDP and optimizer where
    agoq's were asked for."""
    from agoq.megatron.built_check import BuiltMismatch, check_built

    args = _args(FULL)
    model, optimizer = _build(args, attention="megatron", policy=None, grads=None, agoq_optimizer=False,
                              device=mcore_world1)
    with pytest.raises(BuiltMismatch) as info:
        check_built(args.agoq_config, model, optimizer, _expect(), rank=0)
    text = str(info.value)
    for words in ("(rank 0)", "stopping before the first step",
                  "layers 1-2 are megatron.core.transformer.transformer_layer.TransformerLayer, not agoq's "
                  "AgoqTransformerLayer",
                  "core attention is megatron.core.transformer.dot_product_attention.DotProductAttention",
                  "not agoq's 8-bit gradient DDP", "--agoq-grads int8_b256",
                  "not agoq's adamw", "Megatron's optimizer factory", "FIX HERE"):
        assert words in text, (words, text)
    assert info.value.local


def test_a_layer_built_with_another_policy_is_named(mcore_world1):
    from agoq.megatron.built_check import built_problems

    args = _args([])  # the default policy, Megatron's gradients and optimizer
    model, optimizer = _build(args, attention="sdpa", policy="configs/policy/int4.yaml", grads=None,
                              agoq_optimizer=False, device=mcore_world1)
    problems = built_problems(args.agoq_config, model, optimizer, _expect())
    assert len(problems) == 2 and all("the policy asks" in p for p in problems), problems
    assert problems[0].startswith("layer 1: stores "), problems


def test_agoq_pieces_that_were_not_asked_for_are_named_and_disabled_asks_nothing(mcore_world1):
    from agoq.megatron.built_check import built_problems

    model, optimizer = _build(_args(FULL), attention="sdpa", policy=DEFAULT_POLICY, grads="int8_b256",
                              agoq_optimizer=True, device=mcore_world1)
    problems = built_problems(_args([]).agoq_config, model, optimizer, _expect())  # agoq's layers only
    assert any("agoq's 8-bit gradient DDP, but no --agoq-grads" in p for p in problems), problems
    assert any("but --agoq-optimizer is torch" in p for p in problems), problems
    assert built_problems(_args(["--agoq-disable"]).agoq_config, model, optimizer, _expect()) == []


def test_every_rank_stops_when_one_rank_fails(mcore_world1):
    from agoq.megatron.built_check import BuiltMismatch, check_built

    args = _args([])
    model, optimizer = _build(args, attention="sdpa", policy=DEFAULT_POLICY, grads=None, agoq_optimizer=False,
                              device=mcore_world1)
    check_built(args.agoq_config, model, optimizer, _expect(), agree=lambda failed: failed)
    with pytest.raises(BuiltMismatch, match="another rank built something else") as info:
        check_built(args.agoq_config, model, optimizer, _expect(), agree=lambda failed: True)
    assert not info.value.local
