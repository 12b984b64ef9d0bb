"""Activation memory and step time of agoq policies vs the bf16 policy (same SDPA attention), PP=1.

GPU (the issue's benchmark, ~1B LLaMA, seq 4096)::

    python benchmarks/bench_memory.py --policies bf16 agoq int8 --steps 6 --json out.json
    # host cost at small micro-batches, with the old launch path / SwiGLU as an in-process A/B (< 5 min):
    python benchmarks/bench_memory.py --policies bf16 agoq agoq@legacy --mbs 1 2 4 --steps 8 --json out.json

``<policy>@<variant>[+<variant>]`` switches parts of the saved-activation host path for an A/B in one
process: ``twonode`` (the
norm's and SwiGLU's autograd functions handing a stash to Megatron's linear, and the linears that store their own
input quantized inside a hook scope, instead of agoq's one-node linears: agoq.ops.norm_linear, swiglu_linear,
quant_linear), ``noswiglunode`` / ``noquantnode`` (only the SwiGLU + fc2 node / the quantized-input linear node
off), ``rope`` (agoq's fused RoPE in Megatron's slot, agoq.megatron.rope: the trainer's default where agoq is on, on
CUDA; without it the rows run Megatron's unfused RoPE, as the bf16 baseline does), and
``legacy``, which runs the policy with agoq's direct Triton launches, launch sites, fused SwiGLU kernels and the
one-node linears switched off (benchmarks/bench_launch.py's ``legacy_launch`` and ``legacy_save_paths``): close to
the code before the host-cost work (its glue trimming stays, and the norm / linears hooking private autograd
attributes, ``atennorm`` / ``nodehooks`` of older result files, measured within noise and were deleted), timed in
the same process, so the comparison does not depend on the leased host's speed. Step times: ``--rounds``
interleaved rounds per micro-batch size (the ratios the docs quote, ``step_time_ratio_interleaved``). Peaks:
``peak_bytes`` is absolute and includes every model kept resident for the rounds; ``peak_above_resident_bytes`` is
what the step adds.

CPU smoke (tiny model; byte counts are exact, times and peaks are not meaningful)::

    python benchmarks/bench_memory.py --smoke

Per policy: bytes held for backward after one forward (Megatron's saves metered + agoq's counter),
CUDA peak allocated memory of a training step, median step time (forward + backward + SGD), and
the planner's per-layer prediction. Ratios are vs the bf16 policy. PP=2 on two GPUs: run
scripts/pretrain_llama.py with --agoq-policy (not covered here yet).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_launch.legacy_launch

LLAMA_1B = dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=5632,
                seq_length=4096, vocab_size=32000)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            seq_length=32, vocab_size=128)


def _model(shape_kw, policy, device, reference=None, save_paths=None, rope_fusion=False, qkv_rope=True):
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.activations import storage_of
    from agoq.megatron.model import (
        LlamaShape,
        ParallelLayout,
        agoq_layer_spec,
        build_model_chunks,
        llama_transformer_config,
    )
    from agoq.policy import ScheduleInfo

    shape = LlamaShape(**shape_kw)
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.bfloat16,
                                      use_cpu_initialization=device.type == "cpu", rope_fusion=rope_fusion)
    if rope_fusion and not qkv_rope:  # agoq's RoPE per tensor on Megatron's split path (variant "splitrope")
        config = dataclasses.replace(config, fused_single_qkv_rope=False)
    spec = agoq_layer_spec("sdpa", policy=REPO / "configs" / "policy" / f"{policy}.yaml",
                           schedule=ScheduleInfo(1, None, 1), save_paths=save_paths)
    (model,) = build_model_chunks(shape, config, spec, None)
    model = Float16Module(config, model.to(device))
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    return model, storage_of(spec)


def _batch(shape_kw, mbs, device):
    tokens = torch.randint(0, shape_kw["vocab_size"], (mbs, shape_kw["seq_length"] + 1), device=device)
    pos = torch.arange(shape_kw["seq_length"], device=device).expand(mbs, -1)
    return tokens[:, :-1], tokens[:, 1:], pos


def measure(shape_kw, policy, mbs, steps, device, reference=None) -> tuple[dict, object]:
    """One row; ``policy`` may end in ``@<variant>[+<variant>...]`` (see the module docstring)."""
    policy, _, variant = policy.partition("@")
    save_paths, launch = _variant(variant)
    with launch:
        return _measure(shape_kw, policy, variant, save_paths, mbs, steps, device, reference)


def _measure(shape_kw, policy, variant, save_paths, mbs, steps, device, reference) -> tuple[dict, object]:
    from agoq.megatron.activations import SavedTensorMeter
    from agoq.plan.storage import LayerDims, agoq_bytes, megatron_bytes

    rope = uses_rope(variant)
    model, storage = _model(shape_kw, policy, device, reference, save_paths, rope_fusion=rope,
                            qkv_rope=not uses_split_rope(variant))
    name = f"{policy}@{variant}" if variant else policy
    tokens, labels, pos = _batch(shape_kw, mbs, device)
    with SavedTensorMeter([model]) as meter:
        loss = model(tokens, pos, None, labels=labels).float().mean()
    held_layers = sum(v for k, v in meter.bytes_by_layer.items() if k is not None) + storage.counter.total()
    loss.backward()
    dims = LayerDims(seq=shape_kw["seq_length"], micro_batch=mbs, hidden=shape_kw["hidden_size"],
                     ffn=shape_kw["ffn_hidden_size"], heads=shape_kw["num_attention_heads"],
                     groups=shape_kw["num_query_groups"])
    predicted = sum(sum(agoq_bytes(s, dims).values()) + sum(megatron_bytes(s, dims, rope_fused=rope).values())
                    for s in storage.layers.values())
    times, host_times = [], []
    resident = None
    if device.type == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()  # every model kept for the interleaved rounds, no grads
        torch.cuda.reset_peak_memory_stats()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    for _ in range(steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(tokens, pos, None, labels=labels).float().mean().backward()
        host_times.append(time.perf_counter() - start)  # enqueue time: ~step time means host-bound
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-5 * p.grad
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0 if device.type == "cuda" else None
    profile = _profile_step(model, tokens, pos, labels, device) if PROFILE_TOP else None
    trace = _trace_step(model, tokens, pos, labels, device, f"{name}_mbs{mbs}") if TRACE_DIR else None
    return {"profile_top": profile, "trace": trace,
            "policy": name, "mbs": mbs, "held_layer_bytes": held_layers,
            "head_bytes": meter.bytes_by_layer.get(None, 0),
            "planner_layer_bytes": predicted, "peak_bytes": peak,
            "peak_above_resident_bytes": None if peak is None else peak - resident,
            "step_s_median": statistics.median(times[1:] or times),
            "fwd_bwd_host_s_median": statistics.median(host_times[1:] or host_times),
            "allocator_retries": retries}, model


def interleaved_times(group: dict, shape_kw, mbs: int, device, rounds: int, steps: int) -> None:
    """Median step and host time of every policy's model over ``rounds`` interleaved rounds (each round runs
    ``steps`` steps of each policy in turn, the first discarded); written into each row as
    ``step_s_interleaved`` / ``host_s_interleaved``. The leased hosts' speed drifts by +-10 % within
    minutes (docs/benchmarks/activations.md), which back-to-back blocks of steps turn into bias."""
    tokens, labels, pos = _batch(shape_kw, mbs, device)
    times: dict = {policy: ([], []) for policy in group}
    for _ in range(rounds):
        for policy, (_, model) in group.items():
            _, _, variant = policy.partition("@")
            with _variant(variant)[1]:  # the model was built with the variant's save paths
                for i in range(steps):
                    _sync(device)
                    start = time.perf_counter()
                    model.zero_grad(set_to_none=True)
                    model(tokens, pos, None, labels=labels).float().mean().backward()
                    host = time.perf_counter() - start
                    _sync(device)
                    if i:
                        times[policy][0].append(time.perf_counter() - start)
                        times[policy][1].append(host)
    for policy, (row, _) in group.items():
        row["step_s_interleaved"] = statistics.median(times[policy][0])
        row["host_s_interleaved"] = statistics.median(times[policy][1])
        row["interleaved_rounds"] = rounds


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _variant_choices() -> dict:
    """Variant name -> (SavePaths overrides, uses the legacy launch path): the A/B of the saved-activation
    host path (options passed into the layer spec, no product switch flipped)."""
    no_nodes = {"fuse_norm_linear": False, "fuse_swiglu_linear": False, "quantized_linear_node": False}
    return {"legacy": ({"fuse_swiglu": False, **no_nodes}, True),  # benchmarks/bench_launch.py
            # norm / SwiGLU functions + stash + Megatron's linear; the quantized-input linears in a hook scope
            "twonode": (no_nodes, False),
            "noquantnode": ({"quantized_linear_node": False}, False),  # only the out-projection's node off
            "noswiglunode": ({"fuse_swiglu_linear": False}, False),  # only SwiGLU -> fc2's node off
            "rope": ({}, False),  # agoq's fused RoPE with the QKV split (the default; a model config option: uses_rope)
            "splitrope": ({}, False)}  # agoq's RoPE per query / key on Megatron's split path (uses_split_rope)


def uses_split_rope(spec: str) -> bool:
    """Whether the variant ``a+b+...`` runs agoq's RoPE per tensor after Megatron's QKV split (fused_single_qkv_rope
    off), the path before the fused QKV split + RoPE."""
    return "splitrope" in spec.split("+")


def uses_rope(spec: str) -> bool:
    """Whether the variant ``a+b+...`` turns agoq's fused RoPE on (llama_transformer_config(rope_fusion=True));
    ``splitrope`` does too."""
    return uses_split_rope(spec) or "rope" in spec.split("+")


def _variant(spec: str):
    """(SavePaths, launch-path context) for ``a+b+...`` (empty: the defaults); unknown names raise with the list."""
    from bench_launch import legacy_launch

    from agoq.ops.saved_act import SavePaths

    overrides, legacy = {}, False
    known = _variant_choices()
    for name in filter(None, spec.split("+")):
        if name not in known:
            raise ValueError(f"unknown policy variant {name!r} in {spec!r}: use <policy>[@{'|'.join(known)}[+...]]")
        overrides.update(known[name][0])
        legacy = legacy or known[name][1]
    return SavePaths(**overrides), legacy_launch() if legacy else contextlib.nullcontext()


TRACE_DIR: Path | None = None  # set by --trace DIR: one torch.profiler trace per row, plus its summary


def _trace_step(model, tokens, pos, labels, device, name: str) -> dict:
    """Profile one forward+backward with CPU (every thread: the autograd engine's too) and CUDA activity;
    write the chrome trace to TRACE_DIR and return where the host time goes (ops by self CPU time) and
    how busy the GPU was over the step."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        model(tokens, pos, None, labels=labels).float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
    raw = TRACE_DIR / f"trace_{name}.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        dst.write(src.read())
    raw.unlink()
    events = prof.key_averages()
    by_self_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and "CUDA" in str(e.device_type)]
    spans = sorted((k.time_range.start, k.time_range.end) for k in kernels)
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # union of kernel intervals (us)
        if e > end:
            busy += e - max(s, end)
            end = e
    return {"self_cpu_top": [{"name": e.key[:120], "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1)}
                             for e in by_self_cpu[:60]],
            "self_cpu_us_total": round(sum(e.self_cpu_time_total for e in events), 1),
            "gpu_busy_us": round(busy, 1), "gpu_span_us": round(spans[-1][1] - spans[0][0], 1) if spans else 0.0,
            "kernels": len(spans)}


PROFILE_TOP = 0  # set by --profile N: the N most expensive device ops of one step, per policy


def _op_row(evt) -> dict:
    device_us = getattr(evt, "device_time_total", None)
    if device_us is None:
        device_us = getattr(evt, "cuda_time_total", 0)
    return {"name": evt.key[:120], "calls": evt.count, "device_us": round(device_us, 1),
            "cpu_us": round(evt.cpu_time_total, 1)}


def _profile_step(model, tokens, pos, labels, device) -> dict:
    """torch.profiler over one forward+backward: where the step's time goes (top ops by device time),
    plus the number of kernel launches and the total CPU-side time of the step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.zero_grad(set_to_none=True)
    with profile(activities=activities) as prof:
        model(tokens, pos, None, labels=labels).float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    key = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)
    kernels = [e for e in events if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    return {"top": [_op_row(e) for e in rows[:PROFILE_TOP]],
            "device_kernel_calls": sum(e.count for e in kernels),
            "device_kernel_us": round(sum(getattr(e, "self_device_time_total", 0) for e in kernels), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", default=["bf16", "agoq", "int8"])
    p.add_argument("--mbs", type=int, nargs="+", default=[1], help="micro-batch sizes (each a set of rows)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (2 steps)")
    p.add_argument("--json")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one step per policy and record its N most expensive ops")
    p.add_argument("--rounds", type=int, default=5,
                   help="then time the policies of each micro-batch size in R interleaved rounds of --steps "
                        "steps (bf16, agoq, ..., bf16, agoq, ...), so host-speed drift hits every policy alike "
                        "(0: off)")
    p.add_argument("--trace", metavar="DIR", help="also write one torch.profiler chrome trace per row (gzip) "
                   "to DIR and record the host-time and GPU-busy summary in the row")
    args = p.parse_args(argv)
    global PROFILE_TOP, TRACE_DIR
    PROFILE_TOP = args.profile
    if args.trace:
        TRACE_DIR = Path(args.trace)
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    handle = install(AgoqConfig(device="cpu" if device.type == "cpu" else "auto"))
    runtime.init_distributed(device, runtime.SINGLE_PROCESS)  # one process: run it with python, not torchrun
    runtime.init_model_parallel(ParallelLayout(), seed=1234, device=device)
    shape_kw, steps = (TINY, 2) if args.smoke else (LLAMA_1B, args.steps)
    rows, reference, bases = [], None, {}
    policies = ["bf16"] + [x for x in args.policies if x != "bf16"]
    try:
        for mbs in args.mbs:
            group = {}
            for policy in policies:
                row, model = measure(shape_kw, policy, mbs, steps, device, reference)
                reference = reference or model
                group[policy] = (row, model)
                bases.setdefault(mbs, row)
                rows.append(row)
            if args.rounds:
                interleaved_times(group, shape_kw, mbs, device, args.rounds, steps)
            del group
    finally:
        runtime.shutdown()
        handle.uninstall()
    for row in rows:
        base = bases[row["mbs"]]  # the bf16 row of the same micro-batch size
        row["activation_ratio_vs_bf16"] = row["held_layer_bytes"] / base["held_layer_bytes"]
        row["step_time_ratio_vs_bf16"] = row["step_s_median"] / base["step_s_median"]
        if "step_s_interleaved" in row:  # the same-rounds comparison: what the docs quote
            row["step_time_ratio_interleaved"] = row["step_s_interleaved"] / base["step_s_interleaved"]
            row["host_ratio_interleaved"] = row["host_s_interleaved"] / base["host_s_interleaved"]
        row["host_ratio_vs_bf16"] = row["fwd_bwd_host_s_median"] / base["fwd_bwd_host_s_median"]
        row["planner_error"] = row["held_layer_bytes"] / row["planner_layer_bytes"] - 1
        print(json.dumps({k: v for k, v in row.items() if k not in ("profile_top", "trace")}))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "shape": shape_kw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
