"""agoq's transformer layer replayed the way Megatron's local CUDA graphs replay it (issue 24 item 1), on the CPU.

Megatron's graphs need CUDA; what they do to the layer's Python can be followed on the CPU. The first iteration
runs eagerly, then Megatron warms the layer up on zero inputs and captures one forward and one
``torch.autograd.grad`` backward (megatron/core/transformer/cuda_graphs.py: ``create_fwd_graph`` /
``create_bwd_graph``); later micro-batches replay the recorded kernels at the same addresses and run no Python.
The stand-in for capture and replay is ``make_fx(..., tracing_mode="real")``: it records the aten ops of one
forward + backward with the layer's parameters as constants that are the parameters themselves, and running the
record replays exactly those ops (host decisions frozen, as in a graph). Low-bit saved activations (the default
policy: NF4 saves, norm and SwiGLU recompute hand-offs) with and without Smooth-SwiGLU must give every
micro-batch's output, input gradient and parameter gradients bit for bit as eager calls do, over 4 steps of 3
micro-batches with weight updates in between. FP8 needs a GPU (its graph mode: tests/unit/test_fp8_graph_phases.py;
the real graphs: tests/gpu/test_cuda_graphs_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

STEPS, MICRO_BATCHES = 4, 3
CASES = {"default policy": (None, None), "default policy + smooth per-token": (None, "per-token"),
         "default policy + smooth per-channel": (None, "per-channel"), "bf16 policy + smooth per-token":
         ("bf16", "per-token")}


def _train(layer, graphs: bool, data) -> list[list[torch.Tensor]]:
    params = list(layer.parameters())

    def fwd_bwd(x, g):
        out, _ = layer(x, attention_mask=None)
        return (out.detach(), *torch.autograd.grad(out, (x, *params), g))

    outs, replay = [], None
    for batches in data:
        total = [torch.zeros_like(p) for p in params]
        for x, g in batches:
            x = x.clone().requires_grad_()
            if replay is None:
                result = fwd_bwd(x, g)
            else:
                with torch.no_grad():  # a graph replay has no autograd around it
                    result = replay(x, g)
            outs.append([t.clone() for t in result])
            for t, d in zip(total, result[2:], strict=True):
                t += d
        if graphs and replay is None:  # create_cudagraphs: warm-up on zero inputs, then the capture
            fwd_bwd(torch.zeros_like(x).requires_grad_(), torch.zeros_like(g))
            replay = make_replay(fwd_bwd, x, g)
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                p.sub_(1e-2 * t)
    return outs


def make_replay(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="real")(*args)


def _rank(rank: int, world: int) -> dict:
    from megatron.core.transformer.spec_utils import build_module

    from agoq.megatron import runtime
    from agoq.megatron.activations import storage_of
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, llama_transformer_config
    from agoq.policy import FP8Spec
    from agoq.policy.stages import ScheduleInfo
    from agoq.train.args import DEFAULT_POLICY
    from tests.megatron._tiny import tiny_shape

    shape, layout = tiny_shape(), ParallelLayout(tp=1, pp=1)
    runtime.init_model_parallel(layout, seed=1234, device=torch.device("cpu"))
    config = llama_transformer_config(shape, layout, params_dtype=torch.float32, use_cpu_initialization=True)
    schedule = ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=MICRO_BATCHES)
    gen = torch.Generator().manual_seed(1)
    data = [[(torch.randn(shape.seq_length, 2, shape.hidden_size, generator=gen) * (1 + s),
              torch.randn(shape.seq_length, 2, shape.hidden_size, generator=gen)) for _ in range(MICRO_BATCHES)]
            for s in range(STEPS)]
    out = {}
    for name, (policy, smooth) in CASES.items():
        policy = DEFAULT_POLICY.parent / "bf16.yaml" if policy else DEFAULT_POLICY
        runs, counts = {}, {}
        for graphs in (False, True):
            torch.manual_seed(0)
            spec = agoq_layer_spec("sdpa", policy, schedule, compute=FP8Spec(smooth_swiglu=smooth) if smooth else None)
            layer = build_module(spec, config=config, layer_number=1)
            runs[graphs] = _train(layer, graphs, data)
            counts[graphs] = sum(storage_of(spec).counter.tensors.values())
        equal = [all(torch.equal(a, b) for a, b in zip(pa, pb, strict=True))
                 for pa, pb in zip(runs[False], runs[True], strict=True)]
        out[name] = {"equal": equal, "saved_tensors": counts}
    return out


def test_agoq_layer_replays_bit_identically_to_eager():
    from agoq.testing.dist import spawn_ranks

    [out] = spawn_ranks(1, _rank, "gloo", timeout_s=600)
    for name, got in out.items():
        assert len(got["equal"]) == STEPS * MICRO_BATCHES and all(got["equal"]), (name, got)
    # quantized saves really ran: the counter sees every eager call, the warm-up and the recording, never a replay
    per_call = out["default policy"]["saved_tensors"][False] // (STEPS * MICRO_BATCHES)
    assert per_call > 0
    assert out["default policy"]["saved_tensors"][True] == per_call * (MICRO_BATCHES + 2)
    assert out["bf16 policy + smooth per-token"]["saved_tensors"] == {False: 0, True: 0}
