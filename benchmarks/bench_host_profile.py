"""Host time per saved-activation function, per thread, inside whole training steps (GPU; CPU smoke).

At small micro-batches the step is bound by the CPU enqueuing kernels (docs/benchmarks/activations.md),
so the question is which host-side function of agoq's path costs what, in the real model, on the thread
it runs on (forward: the main thread; backward: the autograd engine's device thread, which cProfile
does not see and where launches and allocations cost more). This wraps the functions below with a
timer (inclusive wall time, ~1 us per call of its own), runs the ~1B LLaMA at seq 4096 for a few
steps per policy, and prints / writes calls and microseconds per step and call::

    python benchmarks/bench_host_profile.py --policies bf16 agoq --mbs 1 --json host_profile.json
    python benchmarks/bench_host_profile.py --smoke          # tiny model on CPU: checks the script runs

Timed: Megatron's linear autograd function (forward / backward, the reference point both policies
share), agoq's quantize / dequantize / fused SwiGLU launchers, the launch paths (FastKernel,
LaunchSite), the RMSNorm / SwiGLU saving paths and the hooks that replace saved tensors, the stash's
recompute, the byte counter and ``torch.empty``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_MAIN = threading.main_thread().ident


class Timers:
    """Inclusive wall time per (name, thread kind) of wrapped functions, while ``on``."""

    def __init__(self):
        self.on = False
        self.stats: dict = collections.defaultdict(lambda: [0, 0.0])

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = self.stats[(name, "main" if threading.get_ident() == _MAIN else "backward")]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        return timed

    def patch(self, owner, attr: str, name: str, static: bool = False) -> None:
        fn = self.wrap(name, getattr(owner, attr))
        setattr(owner, attr, staticmethod(fn) if static else fn)


def install_timers(timers: Timers) -> None:
    """Wrap the host path's functions (module attributes are looked up per call, so this reaches them)."""
    from megatron.core.tensor_parallel import layers as mlayers

    from agoq.kernels import fastlaunch, quant, swiglu_quant
    from agoq.megatron import layers as alayers
    from agoq.ops import saved_act, saved_norm, saved_swiglu

    linear = mlayers.LinearWithGradAccumulationAndAsyncCommunication
    timers.patch(linear, "forward", "megatron_linear.forward", static=True)
    timers.patch(linear, "backward", "megatron_linear.backward", static=True)
    timers.patch(fastlaunch.FastKernel, "__call__", "FastKernel.__call__")
    timers.patch(fastlaunch.LaunchSite, "__call__", "LaunchSite.__call__")
    timers.patch(quant, "quantize", "quantize")
    timers.patch(quant, "dequantize", "dequantize")
    for name in ("swiglu_quantize", "dequant_swiglu_fwd", "dequant_swiglu_bwd"):
        timers.patch(swiglu_quant, name, name)
    for name in ("forward", "backward"):
        timers.patch(saved_norm._RMSNormSavingInput, name, f"rmsnorm_function.{name}", static=True)
        timers.patch(saved_swiglu._SwiGLUSavingInput, name, f"swiglu_function.{name}", static=True)
    from megatron.core.models.common.embeddings import rope_utils

    from agoq.ops import rope

    timers.patch(rope_utils, "_apply_rotary_pos_emb_bshd", "megatron_unfused_rope")  # the forward's ops
    for name in ("forward", "backward"):
        timers.patch(rope._RoPE, name, f"agoq_rope_node.{name}", static=True)
    timers.patch(saved_act, "unpack_saved", "unpack_saved")
    timers.patch(saved_act.RecomputeStash, "recomputed_output", "stash.recomputed_output")
    timers.patch(saved_act.SavedBytesCounter, "add", "counter.add")
    timers.patch(saved_act.quantized_saves, "__enter__", "linear_save_scope.enter")  # the linears' default path
    timers.patch(torch, "empty", "torch.empty")
    # the one-node linears (the defaults for QKV / fc1, fc2, the out-projection) and the layer's own entry points
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from agoq.megatron import mlp as amlp
    from agoq.ops import norm_linear, quant_linear, swiglu_linear

    for name in ("forward", "backward"):
        timers.patch(norm_linear._RMSNormLinear, name, f"norm_linear_node.{name}", static=True)
        timers.patch(swiglu_linear._SwiGLULinear, name, f"swiglu_linear_node.{name}", static=True)
        timers.patch(quant_linear._QuantizedInputLinear, name, f"quantized_linear_node.{name}", static=True)
    timers.patch(alayers.AgoqRMSNorm, "forward", "AgoqRMSNorm.forward")
    timers.patch(alayers._AgoqLinearMixin, "_forward_impl", "agoq_linear._forward_impl")
    timers.patch(amlp.AgoqMLP, "forward", "AgoqMLP.forward")
    timers.patch(mlayers.ColumnParallelLinear, "forward", "ColumnParallelLinear.forward")
    timers.patch(mlayers.RowParallelLinear, "forward", "RowParallelLinear.forward")
    # per layer, inclusive, both policies (the plain spec and agoq's layer share these)
    timers.patch(TransformerLayer, "_forward_attention", "layer._forward_attention")
    timers.patch(TransformerLayer, "_forward_mlp", "layer._forward_mlp")


def profile_policy(timers: Timers, shape_kw: dict, policy: str, mbs: int, steps: int, device, reference):
    import bench_memory

    name, _, variant = policy.partition("@")  # bench_memory's variants (rope, twonode, ...)
    save_paths, _ = bench_memory._variant(variant)
    model, _ = bench_memory._model(shape_kw, name, device, reference, save_paths,
                                   rope_fusion=bench_memory.uses_rope(variant),
                                   qkv_rope=not bench_memory.uses_split_rope(variant))
    tokens, labels, pos = bench_memory._batch(shape_kw, mbs, device)

    forward_s = []

    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        forward_s.append(time.perf_counter() - start)
        loss.backward()
        return time.perf_counter() - start

    for _ in range(2):
        step()
    bench_memory._sync(device)
    timers.stats.clear()
    forward_s.clear()
    timers.on = True
    hosts = []
    try:
        for _ in range(steps):
            hosts.append(step())
            bench_memory._sync(device)
    finally:
        timers.on = False
    rows = [{"function": name, "thread": thread, "calls_per_step": calls / steps,
             "us_per_call": round(total / calls * 1e6, 1), "ms_per_step": round(total / steps * 1e3, 3)}
            for (name, thread), (calls, total) in sorted(timers.stats.items(), key=lambda kv: -kv[1][1])]
    return {"policy": policy, "mbs": mbs, "steps": steps,
            "host_fwd_bwd_ms_median": round(statistics.median(hosts) * 1e3, 2),
            "host_fwd_ms_median": round(statistics.median(forward_s) * 1e3, 2), "functions": rows}, model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", default=["bf16", "agoq"])
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (times are not meaningful)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import bench_memory

    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    handle = install(AgoqConfig(device="cpu" if device.type == "cpu" else "auto"))
    runtime.init_distributed(device, runtime.SINGLE_PROCESS)  # one process: run it with python, not torchrun
    runtime.init_model_parallel(ParallelLayout(), seed=1234, device=device)
    shape_kw, steps = (bench_memory.TINY, 2) if args.smoke else (bench_memory.LLAMA_1B, args.steps)
    timers = Timers()
    install_timers(timers)
    results, reference = [], None
    try:
        for policy in args.policies:
            result, model = profile_policy(timers, shape_kw, policy, args.mbs, steps, device, reference)
            reference = reference or model
            results.append(result)
            print(f"== {policy} (mbs {args.mbs}): host fwd+bwd median {result['host_fwd_bwd_ms_median']} ms, "
                  f"forward {result['host_fwd_ms_median']} ms (instrumented)")
            for row in result["functions"]:
                print(f"  {row['function']:30s} {row['thread']:8s} calls/step {row['calls_per_step']:6.1f}  "
                      f"us/call {row['us_per_call']:7.1f}  ms/step {row['ms_per_step']:7.3f}")
    finally:
        runtime.shutdown()
        handle.uninstall()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda"
                                               else "cpu (smoke)", "torch": torch.__version__,
                                               "shape": shape_kw, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
