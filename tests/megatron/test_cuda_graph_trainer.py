"""The trainer's CUDA-graph plumbing on the CPU (issue 24 item 1): the graph fields reach TransformerConfig only
when graphs are on (eager configs unchanged), and a graph run on the CPU stops before any work, naming the flag.
The graphs themselves run on a GPU: tests/gpu/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.megatron


def test_graph_fields_reach_the_config_only_when_on():
    from agoq.megatron.model import ParallelLayout, llama_transformer_config
    from tests.megatron._tiny import tiny_shape

    shape, layout = tiny_shape(), ParallelLayout()
    kw = dict(params_dtype=torch.float32, use_cpu_initialization=True)
    eager = llama_transformer_config(shape, layout, **kw)
    off = llama_transformer_config(shape, layout, **kw, cuda_graph_impl="none", cuda_graph_warmup_steps=7)
    fields = [f.name for f in dataclasses.fields(eager)]
    assert [repr(getattr(eager, f)) for f in fields] == [repr(getattr(off, f)) for f in fields]  # (init partials: repr)
    assert eager.cuda_graph_impl == "none"
    graphed = llama_transformer_config(shape, layout, **kw, cuda_graph_impl="local", cuda_graph_warmup_steps=2)
    assert (graphed.cuda_graph_impl, graphed.cuda_graph_modules, graphed.cuda_graph_warmup_steps) == ("local", [], 2)


def test_graphs_on_the_cpu_stop_before_training():
    from agoq.testing.procs import TINY_CONFIG, run_pretrain

    proc = run_pretrain(1, ["--config", str(TINY_CONFIG), "--agoq-disable", "--enable-cuda-graph", "--train-iters",
                            "6"], check=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "captures CUDA graphs: it needs a GPU" in out, out[-3000:]
    assert "iteration      1/" not in out
