"""Benchmark whole training steps of scripts/pretrain_llama.py: tokens/s and peak GPU memory per variant.

Every variant runs the real script (torchrun, one process per GPU) in this one invocation, so the
baseline and the variants share the device, the versions and the data. The script's ``--log-json``
records are summarised as: median tokens/s and step time over the iterations after ``--warmup``,
the peak of ``torch.cuda.max_memory_allocated`` (the logging rank, i.e. the last pipeline stage) and
the first/last loss, and the planner's predicted peak of the same stage (``agoq.plan.peak``, written by
the script at start-up: ``predicted_peak_gib``, ``predicted_peak_error``; docs/benchmarks/planner.md).

    python benchmarks/bench_pretrain.py --suite attention --out benchmarks/results/pretrain_attention.json

Suites: ``attention`` (issue 2: SDPA vs Megatron's unfused DotProductAttention, ~350M and ~1B LLaMA
shapes, PP=1, one GPU); ``lean`` (issues 5/6/9: Megatron baseline vs agoq's optimizer and 8-bit
gradients, ~1B, PP=1, one GPU); ``memory`` (issue 9: baseline vs agoq presets at equal batch, and the baseline
with full recompute vs agoq at a larger micro-batch); ``fp8`` (issue 7: bf16 vs FP8 linears vs FP8 +
Smooth-SwiGLU vs FP8 with Triton's launch dispatch, ~1B, PP=1, one GPU, 30 iterations for a short loss
comparison; also run by benchmarks/bench_fp8.py); ``fp8_scale`` (issues 4 and 7: FP8 and agoq activations at
GPU-bound shapes, ~1B at micro-batch 4 and 8 layers of the LLaMA-2-7B body at seq 4096).
``grads`` (issue 5: the memory suite's equal-batch variants with and without 8-bit gradients, torch
Adam and agoq's optimizer, under 4 minutes). ``release`` (issue 6: agoq AdamW with an fp32 / bf16 gradient
buffer vs ``--agoq-gradient-release``, ~1B, one GPU, one micro-batch per step, under 4 minutes).
``--smoke`` runs a tiny CPU version of the suite (for CI-style checks; FP8 variants need a GPU, so the fp8
smoke suite runs bf16 and Smooth-SwiGLU only).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from agoq.testing.procs import PRETRAIN_SCRIPT, child_env, torchrun_command  # noqa: E402

# Shapes: LLaMA-style, bf16, seq 2048. "350m" is a GPT-3-Medium-sized body (24 x 1024, the issue's
# 350M example); "1b" is the LLaMA-3.2-1B body (16 x 2048, 32 heads, 8 KV groups, ffn 8192).
SHAPES = {
    "350m": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--num-query-groups", "16", "--ffn-hidden-size", "2816"],
    "1b": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32",
           "--num-query-groups", "8", "--ffn-hidden-size", "8192"],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--ffn-hidden-size", "192"],
}
COMMON = ["--seq-length", "2048", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--log-interval", "1"]


def attention_suite(smoke: bool) -> list[dict]:
    if smoke:
        batch = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4"]
        return [{"name": f"tiny/{b}", "nproc": 1, "args": SHAPES["tiny"] + COMMON[2:] + batch
                 + ["--attention-backend", b]} for b in ("sdpa", "megatron")]
    variants = []
    for shape, mbs, gbs in (("350m", 4, 16), ("1b", 2, 8)):
        for backend in ("sdpa", "megatron"):
            variants.append({
                "name": f"{shape}/{backend}", "nproc": 1,
                "args": SHAPES[shape] + COMMON + ["--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
                                                  "--train-iters", "12", "--attention-backend", backend],
            })
    return variants


def lean_suite(smoke: bool) -> list[dict]:
    """~1B LLaMA, PP=1, one GPU, SDPA everywhere: Megatron baseline vs agoq optimizer / 8-bit grads."""
    shape, batch = "1b", ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "12"]
    if smoke:
        shape, batch = "tiny", ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                                "--train-iters", "4"]
    base = SHAPES[shape] + (COMMON[2:] if smoke else COMMON) + batch
    variants = {
        "baseline (Megatron Adam, fp32 grads)": ["--agoq-disable"],
        "agoq adamw split24 + cint8/cuint8 moments": ["--agoq-optimizer", "adamw"],
        "agoq adamw + int8_b256 grads (store)": ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256"],
    }
    return [{"name": f"{shape}/{name}", "nproc": 1, "args": base + extra} for name, extra in variants.items()]


def memory_suite(smoke: bool) -> list[dict]:
    """Issue 9: ~1B LLaMA, PP=1, one GPU, seq 2048, SDPA everywhere. Per-GPU peak of the Megatron baseline vs
    agoq presets at equal batch (micro-batch 4), plus the equal-memory pair at micro-batch 8: the baseline
    with Megatron's full activation recompute vs agoq's full preset without recompute."""
    shape, mbs, big = "1b", "4", "8"
    common = SHAPES["1b"] + COMMON + ["--train-iters", "10"]
    if smoke:
        shape, mbs, big = "tiny", "2", "4"
        common = SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"]
    grads = ["--agoq-grads", "int8_b256"]
    lean = ["--agoq-optimizer", "adamw"]
    equal_batch = {
        "baseline (Megatron)": ["--agoq-disable"],
        "agoq activations (default policy)": [],
        "agoq activations + 8-bit grads": grads,
        "agoq activations + lean optimizer": lean,
        "agoq full (activations + 8-bit grads + lean optimizer)": grads + lean,
        "agoq activations + lean optimizer + bf16 grads": lean + ["--grad-reduce-in-bf16"],
    }
    variants = [{"name": f"{shape}/mbs{mbs}/{name}", "nproc": 1,
                 "args": common + ["--micro-batch-size", mbs, "--global-batch-size", str(4 * int(mbs))] + extra}
                for name, extra in equal_batch.items()]  # fmt: skip
    bigger = {
        "baseline (Megatron)": ["--agoq-disable"],
        "baseline + full recompute": ["--agoq-disable"] + ([] if smoke else ["--recompute-granularity", "full"]),
        "agoq full": grads + lean,
        "agoq activations + lean optimizer + bf16 grads": lean + ["--grad-reduce-in-bf16"],
        "agoq full + full recompute": grads + lean + ([] if smoke else ["--recompute-granularity", "full"]),
    }
    variants += [{"name": f"{shape}/mbs{big}/{name}", "nproc": 1,
                  "args": common + ["--micro-batch-size", big, "--global-batch-size", str(2 * int(big))] + extra}
                 for name, extra in bigger.items()]  # fmt: skip
    return variants


def dp2_suite(smoke: bool) -> list[dict]:
    """Issue 5/9: ~1B LLaMA, DP=2 (two GPUs), seq 2048, micro-batch 4, global batch 16: Megatron with its
    distributed optimizer vs agoq's 8-bit gradient reduction and lean optimizer, with and without sharding."""
    shape, common = "1b", SHAPES["1b"] + COMMON + ["--train-iters", "10"]
    batch = ["--micro-batch-size", "4", "--global-batch-size", "16"]
    if smoke:
        shape, common = "tiny", SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"]
        batch = ["--micro-batch-size", "2", "--global-batch-size", "8"]
    grads, lean, distopt = ["--agoq-grads", "int8_b256"], ["--agoq-optimizer", "adamw"], ["--use-distributed-optimizer"]
    variants = {
        "baseline (Megatron, distributed optimizer)": ["--agoq-disable"] + distopt,
        "baseline (Megatron, no distributed optimizer)": ["--agoq-disable"],
        "agoq full (8-bit grads + lean optimizer)": grads + lean,
        "agoq lean optimizer + distributed optimizer": lean + distopt,
        "agoq full + distributed optimizer": grads + lean + distopt,
    }
    return [{"name": f"{shape}/dp2/{name}", "nproc": 2, "args": common + batch + extra}
            for name, extra in variants.items()]  # fmt: skip


# NCCL over TCP sockets between the local GPUs (no peer access, no shared memory, no InfiniBand): a
# stand-in for an inter-node Ethernet link, labelled so in every variant name (issue 19, item 3).
SOCKET_LINK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}


def dp2_link_suite(smoke: bool) -> list[dict]:
    """Issue 19: ~1B LLaMA, DP=2, seq 2048, micro-batch 4, global batch 16, as users run data parallelism
    (distributed optimizer, --overlap-grad-reduce, Megatron's default bucket size): Megatron with fp32 and
    with bf16 gradient reduction against agoq full (8-bit gradients + lean optimizer), on NVLink and on the
    socket stand-in for an inter-node link."""
    shape, common = "1b", SHAPES["1b"] + COMMON + ["--train-iters", "6"]
    batch = ["--micro-batch-size", "4", "--global-batch-size", "16"]
    if smoke:
        shape, common = "tiny", SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"]
        batch = ["--micro-batch-size", "2", "--global-batch-size", "8"]
    users = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
    full = ["--agoq-grads", "int8_b256", "--agoq-optimizer", "adamw"]
    variants = {
        "Megatron, fp32 reduction": ["--agoq-disable"],
        "Megatron, bf16 reduction": ["--agoq-disable", "--grad-reduce-in-bf16"],
        "agoq full (8-bit grads + lean optimizer), NCCL transport": full + ["--agoq-grad-transport", "nccl"],
    }
    # NVLink peer memory is not a network link: the socket stand-in measures the NCCL transport only
    peer = {"agoq full (8-bit grads + lean optimizer), peer transport": full + ["--agoq-grad-transport", "peer"]}
    links = {"nvlink": {}, "socket link": {} if smoke else SOCKET_LINK_ENV}
    return [{"name": f"{shape}/dp2/{link}/{name}", "nproc": 2, "args": common + batch + users + extra, "env": env}
            for link, env in links.items()
            for name, extra in {**variants, **(peer if link == "nvlink" and not smoke else {})}.items()]  # fmt: skip


def grads_suite(smoke: bool) -> list[dict]:
    """Issue 5 (a): the memory suite's equal-batch shape (~1B, PP=1, one GPU, micro-batch 4, global batch 16,
    default activation policy), only the four variants that show what the 8-bit gradient store costs or saves:
    with Megatron's torch Adam (the reduced gradient is dequantized into the float buffer for the step) and with
    agoq's optimizer (per-parameter reads, no float buffer); 6 iterations so the suite stays under 4 minutes."""
    shape, mbs = ("tiny", "2") if smoke else ("1b", "4")
    common = SHAPES[shape] + (COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"] if smoke
                              else COMMON + ["--train-iters", "6"])
    grads, lean = ["--agoq-grads", "int8_b256"], ["--agoq-optimizer", "adamw"]
    variants = {
        "baseline (Megatron)": ["--agoq-disable"],
        "agoq activations + 8-bit grads (torch Adam)": grads,
        "agoq activations + lean optimizer": lean,
        "agoq full (activations + 8-bit grads + lean optimizer)": grads + lean,
        "agoq activations + lean optimizer + bf16 grads": lean + ["--grad-reduce-in-bf16"],
    }
    return [{"name": f"{shape}/mbs{mbs}/{name}", "nproc": 1,
             "args": common + ["--micro-batch-size", mbs, "--global-batch-size", str(4 * int(mbs))] + extra}
            for name, extra in variants.items()]  # fmt: skip


def fp8_suite(smoke: bool) -> list[dict]:
    """~1B LLaMA (the lean / attention suites' shape: 16 x 2048, ffn 8192), PP=1, one GPU: bf16
    linears vs agoq's FP8 linears.

    Every variant uses the bf16 activation policy, so only the linears' precision differs; FP8 keeps
    the first and last layer and the LM head in bf16 (the default rule)."""
    shape, batch = "1b", ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "30"]
    if smoke:
        shape, batch = "tiny", ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                                "--train-iters", "4"]
    base = SHAPES[shape] + (COMMON[2:] if smoke else COMMON) + batch + [
        "--agoq-policy", str(REPO_ROOT / "configs" / "policy" / "bf16.yaml")]
    variants = {"bf16": [], "fp8 delayed": ["--agoq-fp8", "delayed"],
                "fp8 delayed + smooth-swiglu per-token": ["--agoq-fp8", "delayed", "--agoq-smooth-swiglu", "per-token"]}
    # the FP8 linear's Triton casts through Triton's own dispatch instead of agoq's direct launches
    # (agoq.kernels._fastlaunch): what the direct path saves in a whole step
    envs = {"fp8 delayed, Triton dispatch": {"AGOQ_TRITON_FAST_LAUNCH": "0"}}
    variants["fp8 delayed, Triton dispatch"] = ["--agoq-fp8", "delayed"]
    if smoke:
        variants = {"bf16": [], "smooth-swiglu per-token": ["--agoq-smooth-swiglu", "per-token"]}
    return [{"name": f"{shape}/{name}", "nproc": 1, "args": base + extra, "env": envs.get(name, {})}
            for name, extra in variants.items()]


def fp8_scale_suite(smoke: bool) -> list[dict]:
    """Issues 4 and 7 where the GPU, not the host, sets the pace: the fp8 suite's ~1B shape at micro-batch 4
    (8192 tokens per micro-batch, 2x the fp8 suite's) and 8 layers of the LLaMA-2-7B body (4096 hidden,
    32 heads, ffn 11008, seq 4096, micro-batch 1): bf16 vs FP8 linears (bf16 activation policy), and the
    Megatron baseline vs agoq's default activation policy at the 7B-layer shape; at 1B also per-channel
    Smooth-SwiGLU (what agoq.plan.fp8 models for it)."""
    wide = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--num-query-groups", "32", "--ffn-hidden-size", "11008"]
    one_b = SHAPES["1b"] + COMMON + ["--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "12"]
    seven_b = wide + COMMON + ["--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "4",
                               "--train-iters", "12"]
    if smoke:
        one_b = SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--micro-batch-size", "2",
                                               "--global-batch-size", "4", "--train-iters", "4"]
        seven_b = one_b
    bf16_policy = ["--agoq-policy", str(REPO_ROOT / "configs" / "policy" / "bf16.yaml")]
    fp8 = [] if smoke else ["--agoq-fp8", "delayed"]  # FP8 needs a GPU: the smoke suite checks the plumbing
    variants = []
    for shape, base in (("1b/mbs4", one_b), ("7b-layers/mbs1", seven_b)):
        variants += [
            {"name": f"{shape}/bf16", "nproc": 1, "args": base + bf16_policy},
            {"name": f"{shape}/fp8 delayed", "nproc": 1, "args": base + bf16_policy + fp8},
            {"name": f"{shape}/fp8 delayed + smooth-swiglu per-token", "nproc": 1,
             "args": base + bf16_policy + fp8 + ["--agoq-smooth-swiglu", "per-token"]},
        ]
    if not smoke:  # the planner's per-channel terms (agoq.plan.fp8: no fc2 weight cache, W * s saved on bf16 layers)
        variants.insert(3, {"name": "1b/mbs4/fp8 delayed + smooth-swiglu per-channel", "nproc": 1,
                            "args": one_b + bf16_policy + fp8 + ["--agoq-smooth-swiglu", "per-channel"]})
    variants += [
        {"name": "7b-layers/mbs1/baseline (Megatron)", "nproc": 1, "args": seven_b + ["--agoq-disable"]},
        {"name": "7b-layers/mbs1/agoq activations (default policy)", "nproc": 1, "args": seven_b},
    ]
    return variants


def release_suite(smoke: bool) -> list[dict]:
    """Issue 6 item 3: ~1B LLaMA, PP=1, one GPU, default activation policy, agoq AdamW (split24 + int8 moments),
    one micro-batch per step (micro-batch 4 = global batch 4; --clip-grad 0 in every variant, as release needs):
    Megatron's fp32 gradient buffer vs a bf16 one vs gradient release (no buffer, each parameter stepped in
    backward). The measured peak and the grads_gib breakdown show what release saves; tokens/s what the
    per-parameter steps and non-finite checks cost. 8 iterations per variant (the suite stays under 4 minutes)."""
    shape, mbs = ("tiny", "2") if smoke else ("1b", "4")
    common = SHAPES[shape] + (COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"] if smoke
                              else COMMON + ["--train-iters", "8"])
    lean = ["--agoq-optimizer", "adamw", "--clip-grad", "0", "--micro-batch-size", mbs, "--global-batch-size", mbs]
    variants = {
        "agoq adamw, fp32 grad buffer": [],
        "agoq adamw, bf16 grad buffer": ["--grad-reduce-in-bf16"],
        "agoq adamw, gradient release": ["--agoq-gradient-release"],
    }
    return [{"name": f"{shape}/mbs{mbs}/{name}", "nproc": 1, "args": common + lean + extra}
            for name, extra in variants.items()]  # fmt: skip


def act_host_suite(smoke: bool) -> list[dict]:
    """Issue 4's host-bound corner in whole training steps: the ~1B shape at seq 4096, micro-batch 1 and 2,
    8 micro-batches per step (gradient accumulation), Megatron baseline vs agoq's default activation policy.
    benchmarks/bench_memory.py times forward + backward alone; here Megatron's optimizer step, the gradient
    buffer and the data pipeline are in the step too. At micro-batch 1 the pair runs twice, alternating, so
    host-speed drift shows up as the spread between the repeats instead of as a bias."""
    shape, seq, iters = ("tiny", "64", "4") if smoke else ("1b", "4096", "9")
    common = SHAPES[shape] + COMMON + ["--seq-length", seq, "--train-iters", iters]
    pairs = [("1", ""), ("1", " (repeat)"), ("2", "")] if not smoke else [("1", "")]
    variants = []
    for mbs, tag in pairs:
        batch = ["--micro-batch-size", mbs, "--global-batch-size", str(8 * int(mbs))]
        variants += [
            {"name": f"{shape}/mbs{mbs}/baseline (Megatron){tag}", "nproc": 1,
             "args": common + batch + ["--agoq-disable"]},
            {"name": f"{shape}/mbs{mbs}/agoq activations (default policy){tag}", "nproc": 1, "args": common + batch},
        ]
    return variants


def _interleaved_variants(shape: str, common: list[str], nproc: int, vpp: list[str]) -> list[dict]:
    """1F1B against the interleaved schedule, Megatron baseline and agoq's default policy in each."""
    return [{"name": f"{shape}/{schedule}/{who}", "nproc": nproc, "args": common + extra + more}
            for schedule, extra in (("1f1b", []), ("vpp2", vpp))
            for who, more in (("baseline (Megatron)", ["--agoq-disable"]), ("agoq (default policy)", []))]


_INTERLEAVED_SMOKE = SHAPES["tiny"] + ["--num-layers", "4", "--seq-length", "64", "--micro-batch-size", "1",
                                       "--global-batch-size", "4", "--train-iters", "3", "--lr-warmup-iters", "1",
                                       "--log-interval", "1", "--pipeline-model-parallel-size", "2"]


def pp2_interleaved_suite(smoke: bool) -> list[dict]:
    """Issue 18 on 2 GPUs: ~1B LLaMA (16 layers, the activations_pp2 shape), PP=2, seq 4096, micro-batch 1,
    16 micro-batches: 1F1B against VPP=2 (4 layers per virtual stage). Per-stage peaks come from the
    script's measured-memory line."""
    if smoke:
        return _interleaved_variants("tiny", _INTERLEAVED_SMOKE, 2, ["--num-layers-per-virtual-pipeline-stage", "1"])
    common = SHAPES["1b"] + ["--seq-length", "4096", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2",
                             "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "8",
                             "--log-interval", "1", "--pipeline-model-parallel-size", "2"]
    return _interleaved_variants("1b", common, 2, ["--num-layers-per-virtual-pipeline-stage", "4"])


def pp4_interleaved_suite(smoke: bool) -> list[dict]:
    """Issue 18 on 4 GPUs: the LLaMA-3-8B shape (configs/model/llama3-8b.yaml), PP=4, seq 4096, micro-batch 1,
    16 micro-batches: 1F1B against VPP=2 (4 layers per virtual stage)."""
    if smoke:
        return _interleaved_variants("tiny", _INTERLEAVED_SMOKE, 2, ["--num-layers-per-virtual-pipeline-stage", "1"])
    common = ["--config", str(REPO_ROOT / "configs" / "model" / "llama3-8b.yaml"), "--seq-length", "4096",
              "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "8", "--lr-warmup-iters", "2",
              "--log-interval", "1"]
    return _interleaved_variants("8b", common, 4, ["--num-layers-per-virtual-pipeline-stage", "4"])


_FULL = ["--agoq-grads", "int8_b256", "--agoq-optimizer", "adamw"]  # agoq full: 8-bit grads + lean optimizer
_USERS = ["--use-distributed-optimizer", "--overlap-grad-reduce"]  # data parallelism as Megatron-LM users run it
_DP_PP_SMOKE = SHAPES["tiny"] + ["--num-layers", "4", "--seq-length", "64", "--micro-batch-size", "1",
                                 "--global-batch-size", "4", "--train-iters", "3", "--lr-warmup-iters", "1",
                                 "--log-interval", "1"]


def pp4_distopt_suite(smoke: bool) -> list[dict]:
    """Issue 19's done-criterion on 4 GPUs: the LLaMA-3-8B shape (configs/model/llama3-8b.yaml, which turns the
    distributed optimizer and --overlap-grad-reduce on), PP=4, seq 4096, micro-batch 1, 16 micro-batches:
    Megatron baseline vs agoq full (default activation policy + 8-bit gradients + agoq AdamW) with the
    distributed optimizer on. Every stage's peak and the planner's prediction per stage."""
    if smoke:
        common, nproc = _DP_PP_SMOKE + ["--pipeline-model-parallel-size", "2"] + _USERS, 2
    else:
        common, nproc = ["--config", str(REPO_ROOT / "configs" / "model" / "llama3-8b.yaml"), "--seq-length", "4096",
                         "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "6",
                         "--lr-warmup-iters", "2", "--log-interval", "1"], 4
    shape = "tiny" if smoke else "8b"
    return [{"name": f"{shape}/pp4/distopt/baseline (Megatron)", "nproc": nproc, "args": common + ["--agoq-disable"]},
            {"name": f"{shape}/pp4/distopt/agoq full", "nproc": nproc, "args": common + _FULL}]


# LLaMA-3.2-3B body (28 x 3072, 24 heads, 8 KV groups, ffn 8192)
SHAPE_3B = ["--num-layers", "28", "--hidden-size", "3072", "--num-attention-heads", "24", "--num-query-groups", "8",
            "--ffn-hidden-size", "8192"]


def dp2_pp2_suite(smoke: bool) -> list[dict]:
    """Issue 19 item 4 on 4 GPUs: DP=2 x PP=2 of the ~3B LLaMA-3.2 shape, seq 4096, micro-batch 1, global batch
    16 (8 micro-batches per DP rank), distributed optimizer and --overlap-grad-reduce with Megatron's default
    bucket size, 20 iterations: Megatron (fp32 and bf16 reduction) vs agoq full."""
    if smoke:
        common, shape = _DP_PP_SMOKE + ["--pipeline-model-parallel-size", "2"] + _USERS, "tiny"
        nproc = 4
    else:
        common = SHAPE_3B + ["--seq-length", "4096", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2",
                             "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "20",
                             "--log-interval", "1", "--pipeline-model-parallel-size", "2"] + _USERS
        shape, nproc = "3b", 4
    variants = {"baseline (Megatron, fp32 reduction)": ["--agoq-disable"],
                "baseline (Megatron, bf16 reduction)": ["--agoq-disable", "--grad-reduce-in-bf16"],
                "agoq full, NCCL transport": _FULL + ["--agoq-grad-transport", "nccl"]}
    if not smoke:
        variants["agoq full, peer transport"] = _FULL + ["--agoq-grad-transport", "peer"]
    return [{"name": f"{shape}/dp2_pp2/{name}", "nproc": nproc, "args": common + extra}
            for name, extra in variants.items()]


SUITES = {"act_host": act_host_suite, "pp2_interleaved": pp2_interleaved_suite, "attention": attention_suite,
          "fp8_scale": fp8_scale_suite, "lean": lean_suite, "memory": memory_suite, "fp8": fp8_suite,
          "grads": grads_suite, "dp2": dp2_suite, "dp2_link": dp2_link_suite, "release": release_suite,
          "pp4_interleaved": pp4_interleaved_suite, "pp4_distopt": pp4_distopt_suite, "dp2_pp2": dp2_pp2_suite}


def run_variant(variant: dict, workdir: Path, timeout: float) -> dict:
    log = workdir / ("".join(c if c.isalnum() else "_" for c in variant["name"]) + ".jsonl")
    cmd = torchrun_command(variant["nproc"], PRETRAIN_SCRIPT, variant["args"] + ["--log-json", str(log)])
    env = variant.get("env", {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(**env), cwd=REPO_ROOT)
    result = {"name": variant["name"], "command": " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd[1:]]),
              "returncode": proc.returncode}
    if proc.returncode != 0:
        result["error_tail"] = (proc.stdout + proc.stderr)[-4000:]
        return result
    records = [json.loads(line) for line in log.read_text().splitlines()]
    predicted = [r["predicted_memory"] for r in records if "predicted_memory" in r]
    if predicted:
        result["predicted_memory"] = predicted[-1]  # agoq.plan.peak, per stage (the script's start-up report)
    breakdowns = [r["memory_breakdown"] for r in records if "memory_breakdown" in r]
    if breakdowns:
        result["memory_breakdown_last"] = breakdowns[-1]  # weights / grads / optimizer GiB + peak (logging rank)
    stage_peaks = _stage_peaks(proc.stdout)
    if stage_peaks:
        result["stage_peaks_gib"] = stage_peaks  # every pipeline stage's, from the last measured-memory line
    records = [r for r in records if "lm_loss" in r]  # training iterations (validation records have no lm_loss)
    result["records"] = records
    return result


_STAGE_PEAK = re.compile(r"stage (\d+): mem alloc [\d.]+ GiB \| peak ([\d.]+) GiB")


def _stage_peaks(stdout: str) -> list[float]:
    """Peak GiB per pipeline stage from the script's last "measured memory after iteration N" line."""
    lines = [line for line in stdout.splitlines() if line.startswith("measured memory after iteration")]
    if not lines:
        return []
    return [float(peak) for _, peak in sorted((int(s), p) for s, p in _STAGE_PEAK.findall(lines[-1]))]


def summarise(result: dict, warmup: int) -> dict:
    if result["returncode"] != 0:
        return {"name": result["name"], "failed": True}
    steady = [r for r in result["records"] if r["iteration"] > warmup] or result["records"]
    summary = {
        "name": result["name"],
        "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in steady),
        "step_ms_median": 1e3 * statistics.median(r["step_seconds"] for r in steady),
        "first_loss": result["records"][0]["lm_loss"],
        "last_loss": result["records"][-1]["lm_loss"],
    }
    if "peak_gib" in result["records"][-1]:
        summary["peak_gib"] = max(r["peak_gib"] for r in result["records"])
    if "peak_gib" in summary and "predicted_memory" in result:
        # the measured peak is the logging rank's (the last pipeline stage): compare with that stage
        summary["predicted_peak_gib"] = result["predicted_memory"]["peak_gib"][-1]
        summary["predicted_peak_error"] = summary["predicted_peak_gib"] / summary["peak_gib"] - 1
    if result.get("stage_peaks_gib"):
        summary["stage_peaks_gib"] = result["stage_peaks_gib"]
        summary["losses"] = [r["lm_loss"] for r in result["records"]]
        if "predicted_memory" in result:
            summary["predicted_stage_peaks_gib"] = result["predicted_memory"]["peak_gib"]
    for key in ("weights_gib", "grads_gib", "optimizer_gib"):
        if key in result.get("memory_breakdown_last", {}):
            summary[key] = result["memory_breakdown_last"][key]
    return summary


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    try:
        import megatron.core
        import triton

        info.update(megatron_core=megatron.core.__version__, triton=triton.__version__)
    except ImportError as exc:
        info["import_error"] = str(exc)
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["num_gpus"] = torch.cuda.device_count()
    else:
        info["device"] = "cpu"
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="attention")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the medians")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU version of the suite")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="run only the variants whose name contains one of these strings")
    args = parser.parse_args(argv)
    report = {
        "suite": args.suite, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "environment": environment(),
        "warmup_iterations_excluded": args.warmup, "variants": [], "summary": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        variants = SUITES[args.suite](args.smoke)
        if args.only:
            variants = [v for v in variants if any(t in v["name"] for t in args.only)]
            if not variants:
                raise SystemExit(f"--only {args.only}: no variant of suite {args.suite!r} matches")
        for variant in variants:
            result = run_variant(variant, Path(tmp), args.timeout)
            report["variants"].append(result)
            report["summary"].append(summarise(result, args.warmup))
            print(json.dumps(report["summary"][-1]), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            # after each variant: a cut run keeps its results
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    failed = [s["name"] for s in report["summary"] if s.get("failed")]
    if failed:
        print(f"failed variants: {failed} (see error_tail in {args.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
