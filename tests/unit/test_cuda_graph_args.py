"""Megatron-LM's CUDA-graph flags in scripts/pretrain_llama.py (agoq.cli.graph_args; issue 24 item 1):
Megatron-LM's names and deprecations, and a refusal naming the reason and the fix for everything the trainer
cannot run with graphs, before torch loads."""

from __future__ import annotations

import typing

import pytest

from agoq.cli.graph_args import CUDA_GRAPH_IMPLS
from agoq.train.args import parse_args


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_defaults_are_eager():
    args = parse_args([])
    assert (args.cuda_graph_impl, args.cuda_graph_modules, args.cuda_graph_warmup_steps) == ("none", [], 3)
    assert not hasattr(args, "cuda_graph_scope_deprecated")


@pytest.mark.parametrize("argv", [["--cuda-graph-impl", "local"], ["--enable-cuda-graph"],
                                  ["--cuda-graph-impl", "local", "--cuda-graph-modules"],
                                  ["--cuda-graph-impl", "local", "--cuda-graph-modules", "full"],
                                  ["--enable-cuda-graph", "--cuda-graph-scope", "full"]])
def test_whole_layer_local_graphs(argv):
    args = parse_args(argv + ["--cuda-graph-warmup-steps", "2"])
    assert (args.cuda_graph_impl, args.cuda_graph_modules, args.cuda_graph_warmup_steps) == ("local", [], 2)


@pytest.mark.parametrize("argv, expected", [
    (["--enable-cuda-graph", "--cuda-graph-impl", "local"], "Do not use --enable-cuda-graph with --cuda-graph-impl"),
    (["--cuda-graph-impl", "transformer_engine"], "Transformer Engine's make_graphed_callables"),
    (["--cuda-graph-impl", "full_iteration"], "FullCudaGraphWrapper"),
    (["--te-rng-tracker"], "graph-safe RNG tracker"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"], "captures whole layers"),
    (["--cuda-graph-modules", "full"], "no effect without CUDA graphs"),
    (["--enable-cuda-graph", "--cuda-graph-scope", "full", "--cuda-graph-modules", "full"], "cannot be used together"),
    (["--enable-cuda-graph", "--cuda-graph-warmup-steps", "0"], "at least 1"),
    (["--enable-cuda-graph", "--recompute-granularity", "full"], "full recompute only with full_iteration"),
    (["--enable-cuda-graph", "--overlap-grad-reduce"], "--overlap-grad-reduce with --cuda-graph-impl local"),
])
def test_what_cannot_run_with_graphs_is_refused_by_name(argv, expected, capsys):
    assert expected in _error(capsys, argv)


def test_choices_match_megatron_and_agoq():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from agoq.megatron.graphs import IMPLS

    megatron = typing.get_args(TransformerConfig.__dataclass_fields__["cuda_graph_impl"].type)
    assert CUDA_GRAPH_IMPLS == IMPLS == megatron
