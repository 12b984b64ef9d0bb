"""agoq under Megatron's CUDA graphs: what may combine, what is refused, and why.

Megatron's per-layer graphs (``TransformerConfig.cuda_graph_impl="local"``: ``CudaGraphManager``,
megatron/core/transformer/cuda_graphs.py) run the first training iteration eagerly while recording each layer's
calls, then, at the end of that iteration's forward-backward (``create_cudagraphs()``, called by the pipeline
schedules), warm every layer up eagerly ``cuda_graph_warmup_steps`` times on zero-filled static inputs and capture
its forward and its backward (``torch.autograd.grad``) into two graphs; every later call replays them. So agoq's
Python runs three times per layer and runner (record, warm-up, capture) and never again: whatever it decides on the
host must be fixed per call site, and whatever it keeps from call to call must live in device tensors at fixed
addresses. Without Transformer Engine only ``local`` exists (``transformer_engine`` needs TE's
``make_graphed_callables``; ``full_iteration`` needs a training loop that wraps the whole forward-backward in
``FullCudaGraphWrapper``, which agoq's trainer does not), with Megatron's graph-safe
``CudaRNGStatesTracker(use_cudagraphable_rng=True)`` (TE's tracker is the other option: the trainer seeds with
the former when graphs are on, as Megatron-LM's ``initialize`` does).

Per feature (docs/numerics.md, "CUDA graphs"):
* low-bit saved activations and the recompute hand-offs: the pack / unpack hooks, the quantize / dequantize /
  recompute kernels and the hand-off from a norm (SwiGLU) to the next linear run in Python during capture, in a
  fixed order within one layer; the codes are graph-pool tensors held by the autograd graph exactly like the
  tensors Megatron's own linears save. No host sync, no RNG (round to nearest). The byte counter
  (``SavedBytesCounter``) counts record, warm-up and capture only: a diagnostic, not used by training.
* FP8 linears and Smooth-SwiGLU: delayed scaling keeps its amax history by swapping the meta tensor per cast
  (host state) and the weight cache decides on the host whether to re-cast; both have a graph mode
  (agoq.ops.fp8_scaling, agoq.ops.fp8_weight_cache: in-place history updates at fixed addresses, the weight cast
  inside every micro-batch's graph with the history recorded once per weight generation through a device-side
  counter, warm-up passes that record nothing), set per layer by :class:`~agoq.megatron.transformer_layer.
  AgoqTransformerLayer` from :func:`graph_phase`. Eager runs never enter it.
* 8-bit gradients (store mode) and gradient release: fundamentally incompatible with per-layer graphs. The graphed
  backward adds each weight gradient into ``param.main_grad`` inside the graph and hands autograd no parameter
  gradient, so no per-parameter backward hook runs: the 8-bit store accumulates in that hook, release steps the
  optimizer in it (and has no ``main_grad``). Reduce mode (float ``main_grad``, 8-bit communication after the
  backward) may combine but has not been validated.
agoq's optimizer runs outside every captured region and is not affected.

Validation: a feature whose graph path is built but has not yet passed tests/gpu/test_cuda_graphs_gpu.py (and
tests/e2e/test_cuda_graphs_multigpu.py for PP=2) on a GPU is UNVALIDATED and refused like an incompatible one,
naming itself, until its name is added to :data:`VALIDATED` (with the run's evidence in the docs). The GPU test
lifts the refusal for its own runs only, through :func:`allow_unvalidated` (a context manager for tests and the
benchmark driver agoq.testing.unvalidated_cuda_graphs; no flag, no environment variable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.cuda_graphs import is_graph_warmup

from agoq.config import flag_for

__all__ = ["FEATURES", "VALIDATED", "allow_unvalidated", "captured_graphs", "check_cuda_graphs", "graph_phase",
           "graphs_on", "layer_features", "needs_rope_per_microbatch", "rope_per_microbatch",
           "set_fp8_graph_phase"]

NO_GRAPHS = "none"  # TransformerConfig.cuda_graph_impl when CUDA graphs are off (megatron-core 0.19.2)
LOCAL = "local"  # Megatron's own per-layer graphs: the only implementation without Transformer Engine
IMPLS = ("none", "local", "transformer_engine", "full_iteration")  # TransformerConfig.cuda_graph_impl's values

UNVALIDATED = "unvalidated"  # the graph path is built and CPU-tested, not yet run on a GPU: refused
INCOMPATIBLE = "incompatible"  # cannot work under Megatron's per-layer graphs: always refused
_SWITCHES = "Drop --cuda-graph-impl / --enable-cuda-graph"


@dataclass(frozen=True)
class Feature:
    label: str  # how messages name it
    off: str  # how to turn it off (a flag or a policy)
    status: str  # UNVALIDATED or INCOMPATIBLE (validated ones are listed in VALIDATED)
    why: str  # what happens under a graph (the refusal's reason)


_CAPTURE_SAFE = ("its graph path is built and CPU-tested (agoq/megatron/graphs.py) but has not passed "
                 "tests/gpu/test_cuda_graphs_gpu.py on a GPU yet")
_HOOKS = ("Megatron's graphed backward adds each weight gradient into param.main_grad inside the graph and gives "
          "autograd no parameter gradient, so no per-parameter backward hook runs")

_FP8, _SMOOTH = flag_for("fp8.recipe"), flag_for("fp8.smooth_swiglu")
_GRADS, _RELEASE = flag_for("grads.format"), flag_for("optimizer.gradient_release")
FEATURES: dict[str, Feature] = {
    "activations": Feature("agoq's low-bit saved activations (quantized saves, norm / SwiGLU recompute)",
                           f"use a bf16 activation policy ({flag_for('policy.path')} configs/policy/bf16.yaml) or "
                           f"{flag_for('enabled')}", UNVALIDATED, _CAPTURE_SAFE),
    "fp8_current": Feature("agoq's FP8 linears with current scaling", f"{_FP8} off", UNVALIDATED, _CAPTURE_SAFE),
    "fp8_delayed": Feature("agoq's FP8 linears with delayed scaling", f"{_FP8} off", UNVALIDATED, _CAPTURE_SAFE),
    "fp8_rowwise": Feature("agoq's FP8 linears with row-wise scaling", f"{_FP8} off", UNVALIDATED, _CAPTURE_SAFE),
    "smooth_per_token": Feature("per-token Smooth-SwiGLU", f"{_SMOOTH} off", UNVALIDATED, _CAPTURE_SAFE),
    "smooth_per_channel": Feature("per-channel Smooth-SwiGLU", f"{_SMOOTH} off", UNVALIDATED, _CAPTURE_SAFE),
    "grads_store": Feature(f"agoq's 8-bit gradient store ({_GRADS}, store mode)", f"drop {_GRADS}",
                           INCOMPATIBLE, _HOOKS + " (the 8-bit store accumulates in DDP's hook)"),
    "grads_reduce": Feature(f"agoq's 8-bit gradient reduction ({_GRADS}, reduce mode)", f"drop {_GRADS}",
                            UNVALIDATED, "its float main_grad would take the graph's accumulation, but it has not "
                            "been run under graphs (data parallelism on GPUs)"),
    "gradient_release": Feature(f"agoq's gradient release ({_RELEASE})", f"drop {_RELEASE}",
                                INCOMPATIBLE, _HOOKS + " (release steps each parameter in that hook and keeps no "
                                "main_grad)"),
}

VALIDATED: frozenset[str] = frozenset({"activations", "fp8_current", "fp8_delayed", "fp8_rowwise", "smooth_per_token",
                                       "smooth_per_channel"})
"""Features that passed the GPU validation (tests/gpu/test_cuda_graphs_gpu.py, PP=2: tests/e2e/
test_cuda_graphs_multigpu.py) and run under ``cuda_graph_impl="local"``; add a name only with the run's evidence in
docs/benchmarks/log.md ("CUDA graphs: GPU validation"). All six: every case bit-identical to eager over 10 iterations
on one H100, and (activations, FP8 delayed, per-token Smooth-SwiGLU) over 8 at PP=2 on two H100s, 2026-11-27 (agoq code
of deae7fe; PP=2 with the rotary fix of 93150a8). "activations" again with the norm + linear node
(agoq.ops.norm_linear, the default since): both files passed on H100s on 2026-11-27 11:08 and 11:38 UTC (agoq
10f4182 and a later commit with the same layer code)."""

_ALLOWED: ContextVar[frozenset[str]] = ContextVar("agoq_unvalidated_cuda_graphs", default=frozenset())


@contextlib.contextmanager
def allow_unvalidated(*features: str) -> Iterator[None]:
    """Inside this block, build UNVALIDATED ``features`` (all of them when none is named) under CUDA graphs
    anyway. For the GPU validation test and its benchmark driver only (agoq.testing.unvalidated_cuda_graphs);
    INCOMPATIBLE features stay refused."""
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"allow_unvalidated: unknown features {unknown}; known: {sorted(FEATURES)}")
    names = features or tuple(n for n, f in FEATURES.items() if f.status == UNVALIDATED)
    token = _ALLOWED.set(_ALLOWED.get() | frozenset(names))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def graphs_on(config) -> bool:
    """Whether ``config`` (a TransformerConfig) turns Megatron's CUDA graphs on."""
    return getattr(config, "cuda_graph_impl", NO_GRAPHS) != NO_GRAPHS


def check_cuda_graphs(config, features: Iterable[str]) -> None:
    """Raise NotImplementedError, naming the feature, the reason and the flag to drop, if ``config`` turns CUDA
    graphs on while one of ``features`` (keys of :data:`FEATURES`) is in use and cannot run under them."""
    features = list(dict.fromkeys(features))
    if not features or not graphs_on(config):
        return
    impl = config.cuda_graph_impl
    where = f"Megatron's CUDA graphs (TransformerConfig.cuda_graph_impl={impl!r}, set by --cuda-graph-impl or " \
            "--enable-cuda-graph)"
    first = FEATURES[features[0]]
    if impl != LOCAL:
        raise NotImplementedError(
            f"{first.label} under {where}: agoq's graph support is for cuda_graph_impl='local' (Megatron's own "
            "per-layer graphs) only; 'transformer_engine' captures through Transformer Engine and 'full_iteration' "
            f"captures the whole forward-backward, neither is built for agoq (agoq/megatron/graphs.py). "
            f"{_SWITCHES}, use --cuda-graph-impl local, or {first.off}")
    allowed = _ALLOWED.get()
    for name in features:
        feature = FEATURES[name]
        if name in VALIDATED or (feature.status == UNVALIDATED and name in allowed):
            continue
        if feature.status == INCOMPATIBLE:
            raise NotImplementedError(f"{feature.label} cannot run under {where}: {feature.why}. {_SWITCHES}, "
                                      f"or {feature.off}")
        raise NotImplementedError(f"{feature.label} is not yet supported under {where}: {feature.why}. "
                                  f"{_SWITCHES}, or {feature.off}")


def layer_features(options) -> list[str]:
    """The FEATURES keys an agoq layer uses (``options``: its ``agoq.megatron.layer_plan.LayerOptions``)."""
    from agoq.plan.storage import QUANTIZED

    out = []
    storage = options.storage
    if storage is not None and any(r.how == QUANTIZED for r in storage.roles.values()):
        out.append("activations")
    if options.fp8 is not None:
        out.append("fp8_rowwise" if options.fp8.granularity == "row" else f"fp8_{options.fp8.scaling}")
    if options.smooth is not None:
        out.append(f"smooth_{options.smooth}")
    return out


def graph_phase() -> str | None:
    """Where Megatron's graph creation is for the code running now: "capture" (inside ``torch.cuda.graph``),
    "warmup" (the eager passes before a capture, megatron.core.transformer.cuda_graphs.is_graph_warmup), or None
    (an ordinary eager call: the recording iteration, or graphs off)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "capture"
    return "warmup" if is_graph_warmup() else None


# agoq.megatron.layers._AgoqLinearMixin keeps its delayed-scaling state and its weight caches as plain attributes,
# made on the linear's first FP8 call (the recording iteration, before any warm-up or capture)
_FP8_STATE = "_agoq_fp8_state"
_FP8_CACHES = ("_agoq_fp8_wcache", "_agoq_fp8_smooth_wcache")


def set_fp8_graph_phase(linears: Iterable[torch.nn.Module], phase: str | None) -> None:
    """Put the FP8 ``linears``' delayed-scaling state (agoq.ops.fp8_scaling.FP8ScalingState.graph_phase) and weight
    caches (agoq.ops.fp8_weight_cache.FP8WeightCache.graph_phase, with the state whose weight slot a captured
    cast records once per weight generation) into ``phase`` (:func:`graph_phase`) for the forward about to run and
    its backward."""
    for linear in linears:
        state = linear.__dict__.get(_FP8_STATE)
        if state is not None:
            state.graph_phase = phase
        for name in _FP8_CACHES:
            cache = linear.__dict__.get(name)
            if cache is not None:
                cache.graph_phase, cache.gate_state = phase, state


def needs_rope_per_microbatch(config) -> bool:
    """Whether the trainer must give every micro-batch its own rotary table (:func:`rope_per_microbatch`): local
    graphs with pipeline parallelism."""
    return getattr(config, "cuda_graph_impl", NO_GRAPHS) == LOCAL and config.pipeline_model_parallel_size > 1


def rope_per_microbatch() -> None:
    """Drop megatron-core's cached rotary table so the next forward builds its own (call before each micro-batch).

    Why: with pipeline parallelism Megatron's local graphs make one runner per layer and micro-batch
    (``_CudaGraphRunner``; ``reuse_cudagraphs`` only at PP=1), and a tensor that several runners take as input gets
    one graph-pool buffer, released once all of them are captured. ``RotaryEmbedding.forward`` is ``lru_cache``d, so
    one rotary table feeds every layer of every micro-batch; the 1F1B schedule records a backward after one or two
    micro-batches' forwards, and graph creation stops at ``assert fwd_buffer_reuse_ref_count == 0`` (megatron-core
    0.19.2, cuda_graphs.py; the baseline without agoq too, measured on 2 x H100 2026-11-27). A table per
    micro-batch is used up within its micro-batch. Cost: the table's few small kernels once per micro-batch."""
    RotaryEmbedding.forward.cache_clear()


def captured_graphs(model_chunks) -> dict[str, int]:
    """How many of this rank's graph runners (one per graphed layer, and with pipeline parallelism per micro-batch in
    flight: megatron.core.transformer.cuda_graphs.CudaGraphManager.cudagraph_runners) hold a captured forward and
    backward graph. After the first training iteration every runner should; the trainer reports it."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager

    runners = [r for chunk in model_chunks for m in chunk.modules() if isinstance(m, CudaGraphManager)
               for r in m.cudagraph_runners]
    captured = sum(getattr(r, "fwd_graph", None) is not None and getattr(r, "bwd_graph", None) is not None
                   for r in runners)
    return {"runners": len(runners), "captured": captured}
