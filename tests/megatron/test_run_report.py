"""What scripts/pretrain_llama.py says about a run (agoq.train.pretrain / memory_report), in-process: the
stop signal by name, the closing line after a resume, the memory header's optimizer and gradient format
(issue 21, "docs contradict the code")."""

from __future__ import annotations

import signal

import pytest

from agoq.config import AgoqConfig
from agoq.plan.memory import Layout
from agoq.train.memory_report import gradient_name, optimizer_name, recipe_from_config
from agoq.train.pretrain import done_line, signal_name

pytestmark = pytest.mark.megatron


def test_stop_signal_is_named():
    assert signal_name(signal.SIGUSR1) == "save-and-exit signal (SIGUSR1)"
    assert signal_name(signal.SIGTERM) == "save-and-exit signal (SIGTERM)"
    assert signal_name(signal.SIGINT) == "save-and-exit signal (SIGINT)"
    assert "10" not in signal_name(signal.SIGUSR1)


def test_done_line_counts_this_run_and_the_total():
    assert done_line(0, 30, 30, 12.34) == "done: 30 iterations in 12.3 s"
    # resumed at 20 of 30: this run did 10 (the old line said "done: 30 iterations")
    assert done_line(20, 30, 30, 5.0) == "done: 10 iterations in 5.0 s (resumed at iteration 20; now at 30 of 30)"
    assert done_line(0, 1, 30, 1.0) == "done: 1 iteration in 1.0 s (at 1 of 30)"  # stopped early (signal / exit)


def _config(**kw) -> AgoqConfig:
    base = dict(agoq_optimizer="torch", agoq_grads=None, agoq_grads_mode="store", agoq_moments="flash",
                agoq_master="split24", agoq_disable=True)
    return AgoqConfig.from_flags({**base, **kw})


@pytest.mark.parametrize("kw, optimizer, grads", [
    ({}, "Megatron's Adam", "fp32 gradients (Megatron's buffer"),
    (dict(agoq_optimizer="adamw", agoq_grads="int8_b256"), "agoq AdamW (cint8_b32,cuint8_b32 states, master split24)",
     "int8_b256 gradients (8-bit store"),
    (dict(agoq_optimizer="lion", agoq_master="split32", agoq_grads="int8_b256", agoq_grads_mode="reduce"),
     "agoq Lion (cint8_b32 states, master split32)", "fp32 gradients (int8_b256 reduction only"),
])
def test_memory_header_names_the_optimizer_and_gradients_in_use(kw, optimizer, grads):
    config = _config(**kw)
    recipe = recipe_from_config(config)
    assert optimizer_name(config, recipe, dp=1, distributed_optimizer=False).startswith(optimizer)
    assert gradient_name(config, recipe, Layout()).startswith(grads)


def test_memory_prediction_says_graph_memory_is_not_modelled():
    """Megatron's CUDA graphs hold their own pool (docs/benchmarks/activations.md): the start-up prediction says so
    when graphs are on, and only then."""
    from agoq.train.memory_report import GRAPHS_NOTE, predicted_report
    from tests.megatron._tiny import tiny_shape

    eager = predicted_report(_config(), tiny_shape(), Layout(), None)
    graphed = predicted_report(_config(), tiny_shape(), Layout(), None, cuda_graphs=True)
    assert GRAPHS_NOTE not in eager and graphed == eager + "\n" + GRAPHS_NOTE
    assert "--cuda-graph-impl local" in GRAPHS_NOTE and "not model" in GRAPHS_NOTE
