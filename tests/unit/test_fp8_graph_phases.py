"""FP8 delayed scaling and the FP8 weight cache under CUDA graphs (agoq.ops.fp8_scaling / fp8_weight_cache,
``graph_phase``; issue 24 item 1), on the CPU with the reference casts and torch's CPU ``_scaled_mm``.

A CUDA graph replays the kernels of its capture at the same addresses and runs no Python. The CPU stand-in for
that: ``make_fx(..., tracing_mode="real")`` records the aten ops one call performs, with the tensors it did not
make (the scaling state, the weight, the cache's counters) as constants that are the very same tensor objects,
and running the recorded graph replays exactly those ops on them; the Python (the history swap, the cache's
host-side key) is frozen at the recording, as in a capture. Megatron's graph creation is followed step by step:
the first iteration eager, then a warm-up pass on zero inputs, the capture, and replays for every later
micro-batch, with weight updates and ``fp8_weights_changed`` between steps as the trainer does.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from agoq.ops.fp8_linear import FP8LinearFunction, fp8_cast_ops
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache, fp8_weights_changed
from agoq.testing.fp8 import CPU_SCALED_MM_SKIP_REASON, cpu_scaled_mm_available

MICRO_BATCHES, STEPS = 3, 4
OPS = fp8_cast_ops(torch.device("cpu"))


needs_cpu_scaled_mm = pytest.mark.skipif(not cpu_scaled_mm_available(), reason=CPU_SCALED_MM_SKIP_REASON)


def _tensors(n: int, seed: int, shape=(64, 96)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen) * (1 + i)).bfloat16() for i in range(n)]


def test_capture_casts_equal_eager_and_update_the_meta_in_place():
    xs = _tensors(6, seed=1)
    eager, graph = FP8ScalingState(FP8Recipe(scaling="delayed")), FP8ScalingState(FP8Recipe(scaling="delayed"))
    for state in (eager, graph):
        state.cast_meta("x", xs[0], OPS, True, True)  # the recording pass: eager, bootstraps the history
    graph.graph_phase = "capture"
    meta = graph.meta("x")
    for x in xs[1:]:
        a, b = eager.cast_meta("x", x, OPS, True, True), graph.cast_meta("x", x, OPS, True, True)
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)
        assert graph.meta("x") is meta  # one tensor for the whole run: a replay reads and writes it
        assert b[2] is not meta and b[2].data_ptr() != meta.data_ptr()  # the backward keeps a copy
    assert torch.equal(eager.meta("x"), graph.meta("x"))


def test_warmup_casts_with_the_current_scale_and_records_nothing():
    xs = _tensors(3, seed=2)
    state = FP8ScalingState(FP8Recipe(scaling="delayed"))
    state.cast_meta("g", xs[0], OPS, True, False)
    before, updates = state.meta("g").clone(), dict(state.num_updates)
    twin = copy.deepcopy(state)
    state.graph_phase = "warmup"
    out, _, used, inv = state.cast_meta("g", torch.zeros_like(xs[1]), OPS, True, False)  # Megatron's zero inputs
    assert not out.float().any() and torch.equal(used, before)
    out, _, _, inv = state.cast_meta("g", xs[1], OPS, True, False)
    expected = twin.cast_meta("g", xs[1], OPS, True, False)
    assert torch.equal(out, expected[0]) and torch.equal(inv, expected[3])
    assert torch.equal(state.meta("g"), before) and state.num_updates == updates


def test_capture_without_history_or_preparation_raises():
    state = FP8ScalingState(FP8Recipe(scaling="delayed"))
    state.graph_phase = "capture"
    with pytest.raises(RuntimeError, match="no amax history"):
        state.cast_meta("w", _tensors(1, seed=3)[0], OPS, True, False)
    state.graph_phase = None
    state.cast_meta("w", _tensors(1, seed=3)[0], OPS, True, False)
    state.graph_phase = "capture"
    with state.gated("w", torch.tensor(True)), pytest.raises(RuntimeError, match="prepare_gate"):
        state.cast_meta("w", _tensors(1, seed=3)[0], OPS, True, False)
    cache = FP8WeightCache()
    cache.graph_phase, cache.gate_state = "capture", state
    with pytest.raises(RuntimeError, match="warm-up"):
        cache.get(torch.ones(16, 16), FP8Recipe(scaling="delayed"), lambda w: w)


def test_eager_cache_is_untouched_by_the_graph_fields():
    cache = FP8WeightCache()
    assert cache.graph_phase is None and cache.gate_state is None
    w, made, recipe = torch.randn(16, 32), [], FP8Recipe()
    assert cache.get(w, recipe, lambda t: made.append(1) or len(made)) == 1
    assert cache.get(w, recipe, lambda t: made.append(1) or len(made)) == 1 and cache._seen is None


def _train(recipe: FP8Recipe, graphs: bool) -> tuple[list, FP8ScalingState | None]:
    """STEPS steps of MICRO_BATCHES micro-batches of one FP8 linear (forward, dgrad, wgrad) with a weight update
    after each step; ``graphs``: Megatron's graph life cycle from the end of the first step's forward-backward."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 96, generator=gen) / math.sqrt(96)).bfloat16().requires_grad_()
    data = [[(torch.randn(64, 96, generator=gen).bfloat16() * (1 + s), torch.randn(64, 48, generator=gen).bfloat16())
             for _ in range(MICRO_BATCHES)] for s in range(STEPS)]
    state = FP8ScalingState(recipe) if recipe.scaling == "delayed" else None
    cache = FP8WeightCache()

    def phase(name):  # what agoq.megatron.graphs.set_fp8_graph_phase does for a layer's linears
        if state is not None:
            state.graph_phase = name
        cache.graph_phase, cache.gate_state = name, state

    def fwd_bwd(x, g):
        y = FP8LinearFunction.apply(x, w, state, recipe, None, None, True, cache)
        dx, dw = torch.autograd.grad(y, (x, w), g)
        return y.detach(), dx, dw

    outs, replay = [], None
    for step in range(STEPS):
        fp8_weights_changed()  # StepRunner.run
        total = torch.zeros(w.shape)
        for x, g in data[step]:
            x = x.clone().requires_grad_()
            if replay is None:
                y, dx, dw = fwd_bwd(x, g)
            else:
                with torch.no_grad():  # a graph replay has no autograd around it
                    y, dx, dw = replay(x, g)
            outs.append((y, dx, dw))
            total += dw.float()
        if graphs and replay is None:  # megatron.core.transformer.cuda_graphs.create_cudagraphs
            phase("warmup")
            fwd_bwd(torch.zeros_like(x).requires_grad_(), torch.zeros_like(g))
            phase("capture")
            persistent = [t for t in (*(state._buffers.values() if state else ()), cache._seen,
                                      *(state._gate_last.values() if state else ())) if t is not None]
            saved = [t.clone() for t in persistent]
            replay = make_fx(fwd_bwd, tracing_mode="real")(x, g)
            for t, v in zip(persistent, saved, strict=True):  # a capture runs nothing; the recording ran once
                t.copy_(v)
        with torch.no_grad():
            w.sub_((1e-2 * total).bfloat16())
        fp8_weights_changed()  # the optimizer step hook
    return outs, state


@needs_cpu_scaled_mm
@pytest.mark.parametrize("recipe", [FP8Recipe(scaling="delayed", fast_accum_forward=False),
                                    FP8Recipe(fast_accum_forward=False),
                                    FP8Recipe(granularity="row", fast_accum_forward=False)],
                         ids=["delayed", "current", "rowwise"])
def test_replayed_fp8_linear_equals_eager_over_steps_and_micro_batches(recipe):
    """Every micro-batch's output, dgrad and wgrad bit for bit; with delayed scaling also the three histories
    (the weight's recorded once per step, as the eager cache does, though every replay casts the weight)."""
    eager, eager_state = _train(recipe, graphs=False)
    graph, graph_state = _train(recipe, graphs=True)
    for i, (a, b) in enumerate(zip(eager, graph, strict=True)):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), f"micro-batch {i} differs"
    if eager_state is not None:
        for slot in ("x", "w", "g"):
            assert torch.equal(eager_state.meta(slot), graph_state.meta(slot)), slot
        assert int((eager_state.amax_history("w") != 0).sum()) == STEPS  # one recording per weight generation
