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
smoke suite runs bf16 and Smooth-SwiGLU only). ``--list`` prints every variant's command and runs nothing.

``graphs`` (issue 24 item 3: the host-bound ~1B shape at seq 4096, micro-batch 1, eager and under Megatron's CUDA
graphs, baseline / agoq / bf16 / FP8 pairs); ``graphs_pp2`` (the same shape at PP=2 on 2 GPUs, baseline and agoq).

Issue 23 (capacity and speed at equal memory; every variant records tokens/s, MFU, loss first/last and the
planner's per-stage prediction next to the measured per-stage peaks):
``capacity_1gpu`` (the LLaMA-3-8B shape with its 128,256-row vocabulary on one GPU, seq 4096: Megatron's
baseline, expected to run out of memory and recorded as such, against agoq full, full + 4-bit moments and
gradient release; the planner's capacity answer for the device's memory is in the report);
``capacity_4gpu`` (the ~32B shape, configs/model/llama-32b.yaml, PP=4 on 4 GPUs: baseline vs agoq full, full +
4-bit moments); ``equal_memory_1b`` (~1B, seq 4096, one GPU) and ``equal_memory_8b_pp4`` (8B shape on 4 GPUs):
the baseline's options (micro-batch, selective / full recompute, the distributed optimizer where DP > 1) against
agoq's (larger micro-batches, no recompute, fewer pipeline stages); the report's ``equal_memory`` table takes,
per memory budget, the fastest run of each side whose measured peak fits, with their tokens/s ratio and MFUs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
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
MODEL_DIR = REPO_ROOT / "configs" / "model"
# The trainer flags of a model file's architecture (its layout, batch and schedule keys are the suite's to set).
ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "rotary_base",
             "norm_epsilon")
# LLaMA-3's vocabulary (meta-llama/Meta-Llama-3-8B config.json vocab_size; configs/model/llama3-8b.yaml). The
# suites reach it without LLaMA-3's tokenizer (the GPU machines reach no network) by padding the built-in
# corpus's tokenizer (agoq.data.tokenizer.DEFAULT_VOCAB_SIZE 4096 rows) to a multiple of 128,256 at TP=1: the
# embedding, the output layer and the logits have the real 128,256 rows; the token ids stay below 4096.
LLAMA3_VOCAB = 128256
REAL_VOCAB = ["--make-vocab-size-divisible-by", str(LLAMA3_VOCAB)]
# Dense BF16 tensor-core peak per GPU, TFLOP/s (NVIDIA's H100 and H200 datasheets: 1,979 with 2:4 sparsity for
# the SXM parts, 1,513 for H100 PCIe), the denominator of MFU (model FLOPs of agoq.megatron.train.flops, no recompute).
DENSE_BF16_TFLOPS = {"H100 PCIe": 756.5, "H100": 989.4, "H200": 989.4}


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


def dp2_transport_suite(smoke: bool) -> list[dict]:
    """Issue 19: the same DP=2 ~1B steps as dp2_link on NVLink, agoq full only, with and without the distributed
    optimizer (8-bit store reduced to its owners / all-reduced in place), over the NCCL transport and the NVLink
    peer transport (--agoq-grad-transport): what the transport alone changes in a whole step."""
    shape, common = "1b", SHAPES["1b"] + COMMON + ["--train-iters", "6"]
    batch = ["--micro-batch-size", "4", "--global-batch-size", "16"]
    if smoke:
        shape, common = "tiny", SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"]
        batch = ["--micro-batch-size", "2", "--global-batch-size", "8"]
    full = ["--agoq-grads", "int8_b256", "--agoq-optimizer", "adamw", "--overlap-grad-reduce"]
    layouts = {"distributed optimizer": ["--use-distributed-optimizer"], "no distributed optimizer": []}
    transports = ("nccl",) if smoke else ("nccl", "peer")
    return [{"name": f"{shape}/dp2/agoq full/{layout}/{t} transport", "nproc": 2,
             "args": common + batch + full + extra + ["--agoq-grad-transport", t]}
            for layout, extra in layouts.items() for t in transports]


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
    Smooth-SwiGLU (what agoq.plan.fp8 models for it) and two A/B variants: the per-token un-smoothing after a
    tensor-wise GEMM, and plain FP8 with Megatron's SwiGLU before the FP8 fc2 (AGOQ_FP8_SWIGLU_FUSION=0)."""
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
        # issue 27's A/B: the fused per-token op un-smoothing after a tensor-wise GEMM instead of in a row-wise one
        variants.insert(4, {"name": "1b/mbs4/fp8 delayed + smooth-swiglu per-token, unsmooth epilogue", "nproc": 1,
                            "args": one_b + bf16_policy + fp8 + ["--agoq-smooth-swiglu", "per-token"],
                            "env": {"AGOQ_SMOOTH_UNSMOOTH": "epilogue"}})
        # plain FP8's A/B: Megatron's SwiGLU then the FP8 fc2 (the path before the fused plain SwiGLU + FP8 fc2 op)
        variants.insert(2, {"name": "1b/mbs4/fp8 delayed, unfused swiglu", "nproc": 1,
                            "args": one_b + bf16_policy + fp8, "env": {"AGOQ_FP8_SWIGLU_FUSION": "0"}})
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


# issue 24 items 1 and 3: agoq's features under Megatron's CUDA graphs run through this driver (pretrain_llama.py
# with the refusal of not-yet-validated graph features lifted; agoq/megatron/graphs.py) until they are validated
UNVALIDATED_GRAPHS_DRIVER = REPO_ROOT / "agoq" / "testing" / "unvalidated_cuda_graphs.py"


def graphs_suite(smoke: bool) -> list[dict]:
    """Issue 24 item 3, the host-bound corner with and without Megatron's CUDA graphs (--cuda-graph-impl local): the
    ~1B shape at seq 4096, micro-batch 1, 8 micro-batches per step, 9 iterations (iteration 1 records and captures:
    left out by --warmup), one GPU. Pairs (eager, graphs) of: the Megatron baseline; agoq's default activation policy
    (target: >= 1.00x the baseline in the same mode); bf16 linears and FP8 delayed linears under the bf16 policy
    (target: FP8 >= 1.05x bf16), and FP8 delayed + per-token Smooth-SwiGLU. Every variant runs the same driver (it
    changes nothing when the refusal does not apply). About 10 minutes on one H100. ``--smoke``: the eager half on the
    CPU (graphs need a GPU)."""
    shape, seq, iters = ("tiny", "64", "4") if smoke else ("1b", "4096", "9")
    common = SHAPES[shape] + COMMON + ["--seq-length", seq, "--train-iters", iters, "--micro-batch-size", "1",
                                       "--global-batch-size", "8"]
    bf16 = ["--agoq-policy", str(REPO_ROOT / "configs" / "policy" / "bf16.yaml")]
    fp8 = [] if smoke else ["--agoq-fp8", "delayed"]  # FP8 needs a GPU: the smoke suite checks the plumbing
    pairs = {"baseline (Megatron)": ["--agoq-disable"], "agoq activations (default policy)": [],
             "bf16 linears (bf16 policy)": bf16, "fp8 delayed (bf16 policy)": bf16 + fp8,
             "fp8 delayed + smooth-swiglu per-token (bf16 policy)": bf16 + fp8 + ["--agoq-smooth-swiglu", "per-token"]}
    modes = {"eager": []} if smoke else {"eager": [], "graphs": ["--cuda-graph-impl", "local"]}
    return [{"name": f"{shape}/mbs1/{name}/{mode}", "nproc": 1, "args": common + extra + graphs,
             "script": UNVALIDATED_GRAPHS_DRIVER}
            for name, extra in pairs.items() for mode, graphs in modes.items()]


def graphs_pp2_suite(smoke: bool) -> list[dict]:
    """Issue 24 item 3 at PP=2 on 2 GPUs: the graphs suite's ~1B shape at seq 4096 and micro-batch 1 split over two
    pipeline stages (1F1B, 16 micro-batches per step, 9 iterations), eager and under Megatron's CUDA graphs, for the
    Megatron baseline and agoq's default activation policy (target: agoq >= 1.00x the baseline in the same mode).
    About 5 minutes on two H100s. ``--smoke``: the eager half on the CPU."""
    shape, seq, iters = ("tiny", "64", "4") if smoke else ("1b", "4096", "9")
    common = SHAPES[shape] + COMMON + ["--seq-length", seq, "--train-iters", iters, "--micro-batch-size", "1",
                                       "--global-batch-size", "16", "--pipeline-model-parallel-size", "2"]
    pairs = {"baseline (Megatron)": ["--agoq-disable"], "agoq activations (default policy)": []}
    modes = {"eager": []} if smoke else {"eager": [], "graphs": ["--cuda-graph-impl", "local"]}
    return [{"name": f"{shape}/pp2/mbs1/{name}/{mode}", "nproc": 2, "args": common + extra + graphs,
             "script": UNVALIDATED_GRAPHS_DRIVER}
            for name, extra in pairs.items() for mode, graphs in modes.items()]


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


def dp2_pp4_8b_suite(smoke: bool) -> list[dict]:
    """Issue 26 run 1 (8 GPUs, a withheld kind): the LLaMA-3-8B shape (configs/model/llama3-8b.yaml: distributed
    optimizer and --overlap-grad-reduce on), DP=2 x PP=4, seq 4096, micro-batch 1, global batch 32 (16 micro-batches
    per DP rank), 20 iterations: Megatron baseline vs agoq full; every stage's peak against the planner."""
    if smoke:
        common, nproc, shape = _DP_PP_SMOKE + ["--pipeline-model-parallel-size", "2"] + _USERS, 4, "tiny"
    else:
        common = ["--config", str(REPO_ROOT / "configs" / "model" / "llama3-8b.yaml"), "--seq-length", "4096",
                  "--micro-batch-size", "1", "--global-batch-size", "32", "--train-iters", "20",
                  "--lr-warmup-iters", "2", "--log-interval", "1", "--pipeline-model-parallel-size", "4"] + _USERS
        nproc, shape = 8, "8b"
    return [{"name": f"{shape}/dp2_pp4/baseline (Megatron)", "nproc": nproc, "args": common + ["--agoq-disable"]},
            {"name": f"{shape}/dp2_pp4/agoq full", "nproc": nproc, "args": common + _FULL}]


def dp8_suite(smoke: bool) -> list[dict]:
    """Issue 26 runs 2-3 (8 GPUs, a withheld kind): ~1B LLaMA, DP=8 as users run it (distributed optimizer,
    --overlap-grad-reduce, Megatron's bucket size), seq 2048, micro-batch 4, global batch 64: Megatron's fp32 and
    bf16 reduction vs agoq full over the NCCL and the NVLink peer transport, on NVLink and on the socket stand-in
    for an inter-node link (NCCL transport only there)."""
    nproc = 4 if smoke else 8
    shape, common = "1b", SHAPES["1b"] + COMMON + ["--train-iters", "6"]
    batch = ["--micro-batch-size", "4", "--global-batch-size", "64"]
    if smoke:
        shape, common = "tiny", SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"]
        batch = ["--micro-batch-size", "1", "--global-batch-size", "8"]
    variants = {"Megatron, fp32 reduction": ["--agoq-disable"],
                "Megatron, bf16 reduction": ["--agoq-disable", "--grad-reduce-in-bf16"],
                "agoq full, NCCL transport": _FULL + ["--agoq-grad-transport", "nccl"]}
    peer = {"agoq full, peer transport": _FULL + ["--agoq-grad-transport", "peer"]}
    links = {"nvlink": {}, "socket link": {} if smoke else SOCKET_LINK_ENV}
    return [{"name": f"{shape}/dp{nproc}/{link}/{name}", "nproc": nproc, "args": common + batch + _USERS + extra,
             "env": env}
            for link, env in links.items()
            for name, extra in {**variants, **(peer if link == "nvlink" and not smoke else {})}.items()]  # fmt: skip


def arch_flags(model: str) -> list[str]:
    """``--num-layers ...`` of configs/model/<model>.yaml's architecture (ARCH_KEYS)."""
    import yaml

    cfg = yaml.safe_load((MODEL_DIR / f"{model}.yaml").read_text())
    return [arg for key in ARCH_KEYS for arg in ("--" + key.replace("_", "-"), str(cfg[key]))]


# issue 23: "agoq full" (8-bit gradient store + agoq AdamW, default policy) and its variants
_FULL_4BIT = _FULL + ["--agoq-moments", "4bit"]
_RELEASE = ["--agoq-optimizer", "adamw", "--agoq-gradient-release", "--clip-grad", "0"]
_SELECTIVE, _FULL_RECOMPUTE = ["--recompute-granularity", "selective"], ["--recompute-granularity", "full"]
_BASELINE = ["--agoq-disable"]
_FP8_SMOOTH = ["--agoq-fp8", "delayed", "--agoq-smooth-swiglu", "per-token"]  # the stable FP8 recipe (issue 27)
_SMOKE_23 = SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--train-iters", "3"]


def _v(name: str, nproc: int, args: list[str], side: str, expect: str | None = None) -> dict:
    """A variant of the issue-23 suites: ``side`` baseline | agoq; ``expect`` "oom": an out-of-memory exit is the
    expected result (recorded, not a failure of the suite)."""
    return {"name": name, "nproc": nproc, "args": args, "side": side, "expect": expect}


def capacity_1gpu_suite(smoke: bool) -> list[dict]:
    """Issue 23 item 1 on one GPU: the LLaMA-3-8B shape (configs/model/llama3-8b.yaml) with the 128,256-row
    vocabulary (REAL_VOCAB), PP=1, seq 4096, micro-batch 1, 20 iterations. Megatron's bf16 baseline needs
    16 B/param of model state (~128 GB): expected out of memory. agoq full (default policy, 8-bit gradients,
    agoq AdamW; 4 micro-batches per step), the same with 4-bit first moments, and gradient release (one
    micro-batch per step, --clip-grad 0 as release needs). About 7 minutes on one H100."""
    if smoke:
        batch = ["--micro-batch-size", "1", "--global-batch-size", "2"]
        return [_v(f"tiny/{n}", 1, _SMOKE_23 + b + x, side) for n, b, x, side in (
            ("baseline (Megatron)", batch, _BASELINE, "baseline"), ("agoq full", batch, _FULL, "agoq"),
            ("agoq release", ["--micro-batch-size", "1", "--global-batch-size", "1"], _RELEASE, "agoq"))]
    common = arch_flags("llama3-8b") + REAL_VOCAB + COMMON[2:] + ["--seq-length", "4096", "--micro-batch-size", "1",
                                                                   "--train-iters", "20"]
    four, one = ["--global-batch-size", "4"], ["--global-batch-size", "1"]
    return [_v("8b/baseline (Megatron bf16)", 1, common + four + _BASELINE, "baseline", expect="oom"),
            _v("8b/agoq full", 1, common + four + _FULL, "agoq"),
            _v("8b/agoq full + 4-bit moments", 1, common + four + _FULL_4BIT, "agoq"),
            _v("8b/agoq gradient release", 1, common + one + _RELEASE, "agoq")]


def capacity_4gpu_suite(smoke: bool) -> list[dict]:
    """Issue 23 item 1 on four GPUs: the ~32B shape (configs/model/llama-32b.yaml) with the 128,256-row
    vocabulary, PP=4 (16 layers per stage), seq 4096, micro-batch 1, 8 micro-batches per step, 20 iterations:
    Megatron's baseline (~8.1e9 parameters per stage at 16 B/param: expected out of memory), agoq full and agoq
    full + 4-bit moments (planner: 66 / 61 / 58 / 72 GiB and 63 / 58 / 55 / 69 GiB per stage). About 8 minutes on
    four H100s."""
    if smoke:
        common = _SMOKE_23 + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                              "--global-batch-size", "4"]
        return [_v("tiny/pp2/baseline (Megatron)", 2, common + _BASELINE, "baseline"),
                _v("tiny/pp2/agoq full", 2, common + _FULL, "agoq")]
    common = arch_flags("llama-32b") + REAL_VOCAB + COMMON[2:] + [
        "--seq-length", "4096", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "20"]
    return [_v("32b/pp4/baseline (Megatron bf16)", 4, common + _BASELINE, "baseline", expect="oom"),
            _v("32b/pp4/agoq full", 4, common + _FULL, "agoq"),
            _v("32b/pp4/agoq full + 4-bit moments", 4, common + _FULL_4BIT, "agoq")]


def equal_memory_1b_suite(smoke: bool) -> list[dict]:
    """Issue 23 item 2 on one GPU: ~1B (the LLaMA-3.2-1B body, the built-in 4096-row vocabulary as the memory
    suite), seq 4096, 32 sequences per step, 8 iterations. The baseline's options: micro-batch 1 / 2 / 4 / 8
    without recompute, 1 and 4 with selective recompute of core attention, 8 and 16 with full recompute; agoq
    full at micro-batch 4 / 8 / 16 without recompute, and agoq full with FP8 delayed linears and per-token
    Smooth-SwiGLU (the stable FP8 recipe, docs/fp8.md) at micro-batch 4 / 8: agoq spending its memory on FP8's
    tensor-core rate (the baseline stays bf16: megatron-core's FP8 needs Transformer Engine). The report's
    equal_memory table compares, per budget (EQUAL_MEMORY_BUDGETS_GIB), the fastest run of each side whose measured
    peak fits. About 8 minutes on one H100 (~120k tokens/s at micro-batch 1)."""
    if smoke:
        batch = lambda mbs: ["--micro-batch-size", str(mbs), "--global-batch-size", "4"]  # noqa: E731
        return [_v("tiny/baseline mbs1", 1, _SMOKE_23 + batch(1) + _BASELINE, "baseline"),
                _v("tiny/baseline mbs2 selective", 1, _SMOKE_23 + batch(2) + _BASELINE + _SELECTIVE, "baseline"),
                _v("tiny/agoq full mbs4", 1, _SMOKE_23 + batch(4) + _FULL, "agoq")]
    common = SHAPES["1b"] + COMMON[2:] + ["--seq-length", "4096", "--global-batch-size", "32", "--train-iters", "8"]
    mbs = lambda n: ["--micro-batch-size", str(n)]  # noqa: E731
    variants = [_v(f"1b/baseline mbs{n}", 1, common + mbs(n) + _BASELINE, "baseline") for n in (1, 2, 4, 8)]
    variants += [_v(f"1b/baseline mbs{n} selective recompute", 1, common + mbs(n) + _BASELINE + _SELECTIVE,
                    "baseline") for n in (1, 4)]
    variants += [_v(f"1b/baseline mbs{n} full recompute", 1, common + mbs(n) + _BASELINE + _FULL_RECOMPUTE,
                    "baseline") for n in (8, 16)]
    variants += [_v(f"1b/agoq full mbs{n}", 1, common + mbs(n) + _FULL, "agoq") for n in (4, 8, 16)]
    return variants + [_v(f"1b/agoq full + fp8 smooth-swiglu mbs{n}", 1, common + mbs(n) + _FULL + _FP8_SMOOTH,
                          "agoq") for n in (4, 8)]


def equal_memory_8b_pp4_suite(smoke: bool) -> list[dict]:
    """Issue 23 item 2 on four GPUs: the LLaMA-3-8B shape with the 128,256-row vocabulary, seq 4096, 16 sequences
    per step, 8 iterations. Baseline: PP=4 micro-batch 1 without and with selective recompute (the issue's
    measured layout), and DP=4 with the distributed optimizer and full recompute (no pipeline bubble; planner
    75 GiB); agoq full: PP=4 at micro-batch 2, PP=2 x DP=2 and DP=4 (PP=1) with the distributed optimizer
    (fewer pipeline stages; planner 31 / 31 / 60 GiB), and PP=2 x DP=2 again with FP8 delayed linears and
    per-token Smooth-SwiGLU. Every variant is predicted to fit 80 GiB. About 9 minutes on four H100s."""
    if smoke:
        common = _SMOKE_23 + ["--num-layers", "4", "--global-batch-size", "4", "--micro-batch-size", "1"]
        return [_v("tiny/pp2/baseline", 2, common + ["--pipeline-model-parallel-size", "2"] + _BASELINE, "baseline"),
                _v("tiny/dp2/agoq full", 2, common + _USERS + _FULL, "agoq")]
    common = arch_flags("llama3-8b") + REAL_VOCAB + COMMON[2:] + ["--seq-length", "4096", "--global-batch-size",
                                                                   "16", "--train-iters", "8"]
    pp = lambda n: ["--pipeline-model-parallel-size", str(n)]  # noqa: E731
    mbs = lambda n: ["--micro-batch-size", str(n)]  # noqa: E731
    return [
        _v("8b/pp4/baseline mbs1", 4, common + pp(4) + mbs(1) + _BASELINE, "baseline"),
        _v("8b/pp4/baseline mbs1 selective recompute", 4, common + pp(4) + mbs(1) + _BASELINE + _SELECTIVE, "baseline"),
        _v("8b/dp4/baseline mbs1 full recompute, distributed optimizer", 4,
           common + pp(1) + mbs(1) + _USERS + _BASELINE + _FULL_RECOMPUTE, "baseline"),
        _v("8b/pp4/agoq full mbs2", 4, common + pp(4) + mbs(2) + _FULL, "agoq"),
        _v("8b/pp2_dp2/agoq full mbs2, distributed optimizer", 4, common + pp(2) + mbs(2) + _USERS + _FULL, "agoq"),
        _v("8b/dp4/agoq full mbs1, distributed optimizer", 4, common + pp(1) + mbs(1) + _USERS + _FULL, "agoq"),
        _v("8b/pp2_dp2/agoq full + fp8 smooth-swiglu mbs2, distributed optimizer", 4,
           common + pp(2) + mbs(2) + _USERS + _FULL + _FP8_SMOOTH, "agoq"),
    ]


# per equal-memory suite: the budgets (GiB per GPU) at which the fastest fitting run of each side is compared
EQUAL_MEMORY_BUDGETS_GIB = {"equal_memory_1b": (24, 32, 48, 80), "equal_memory_8b_pp4": (48, 64, 80)}
# per capacity suite: the model file and GPU count the planner's capacity answer is given for
CAPACITY_PLANS = {"capacity_1gpu": ("llama3-8b", 1), "capacity_4gpu": ("llama-32b", 4)}


SUITES = {"act_host": act_host_suite, "graphs": graphs_suite, "graphs_pp2": graphs_pp2_suite,
          "pp2_interleaved": pp2_interleaved_suite, "attention": attention_suite,
          "fp8_scale": fp8_scale_suite, "lean": lean_suite, "memory": memory_suite, "fp8": fp8_suite,
          "grads": grads_suite, "dp2": dp2_suite, "dp2_link": dp2_link_suite, "dp2_transport": dp2_transport_suite,
          "release": release_suite,
          "pp4_interleaved": pp4_interleaved_suite, "pp4_distopt": pp4_distopt_suite, "dp2_pp2": dp2_pp2_suite,
          "capacity_1gpu": capacity_1gpu_suite, "capacity_4gpu": capacity_4gpu_suite,
          "equal_memory_1b": equal_memory_1b_suite, "equal_memory_8b_pp4": equal_memory_8b_pp4_suite,
          "dp2_pp4_8b": dp2_pp4_8b_suite, "dp8": dp8_suite}


def variant_command(variant: dict, log: Path) -> tuple[list[str], str]:
    """(argv, the shell line) of one variant: torchrun + scripts/pretrain_llama.py (or the variant's ``script``, a
    driver that runs it) + its flags + --log-json."""
    script = variant.get("script", PRETRAIN_SCRIPT)
    cmd = torchrun_command(variant["nproc"], script, variant["args"] + ["--log-json", str(log)])
    env = variant.get("env", {})
    return cmd, " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd[1:]])


# what torch prints when the caching allocator cannot serve a request (torch.OutOfMemoryError's message)
OUT_OF_MEMORY_MARKERS = ("torch.OutOfMemoryError", "CUDA out of memory", "OutOfMemoryError")


TIMEOUT_RETURNCODE = 124  # as timeout(1): the variant ran past --timeout and its process group was killed


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc's parent links), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and all its workers. torchrun starts each worker in a session of its own
    (torch.distributed.elastic's SubprocessHandler, start_new_session=True), so killing torchrun's process
    group alone leaves the workers running, holding their GPU memory and the output pipes (the 2026-11-26
    capacity_4gpu run hung that way). The tree is read before anything is killed: orphans lose their parent link."""
    for target in [pid, *_descendants(pid)]:
        for kill in (lambda t: os.killpg(t, signal.SIGKILL), lambda t: os.kill(t, signal.SIGKILL)):
            try:
                kill(target)
            except (ProcessLookupError, PermissionError):
                pass


def _run_bounded(cmd: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    """Run torchrun in its own process group; past ``timeout`` kill it and every worker (see _kill_tree) and
    return TIMEOUT_RETURNCODE with what was printed, so the suite goes on. Output goes to files, not pipes, so
    a surviving grandchild can never block the read."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=REPO_ROOT,
                                start_new_session=True)
        note = ""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            note = f"\nbench: killed after --timeout {timeout} s"
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode if not note else TIMEOUT_RETURNCODE,
                                           out.read(), err.read() + note)


def _error_lines(output: str, limit: int = 20) -> list[str]:
    """The distinct lines that name an error (``...Error: ...`` / ``error:``), first ``limit``."""
    lines = [line.strip() for line in output.splitlines() if re.search(r"(Error|error):", line)]
    return list(dict.fromkeys(lines))[:limit]


def run_variant(variant: dict, workdir: Path, timeout: float) -> dict:
    log = workdir / ("".join(c if c.isalnum() else "_" for c in variant["name"]) + ".jsonl")
    cmd, line = variant_command(variant, log)
    env = variant.get("env", {})
    proc = _run_bounded(cmd, timeout, child_env(**env))
    result = {"name": variant["name"], "command": line, "returncode": proc.returncode,
              **{k: variant[k] for k in ("side", "expect") if variant.get(k)}}
    records = [json.loads(r) for r in log.read_text().splitlines()] if log.exists() else []
    predicted = [r["predicted_memory"] for r in records if "predicted_memory" in r]
    if predicted:
        result["predicted_memory"] = predicted[-1]  # agoq.plan.peak, per stage (the script's start-up report)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        result["out_of_memory"] = any(m in output for m in OUT_OF_MEMORY_MARKERS)
        result["error_lines"] = _error_lines(output)  # the workers' errors (torchrun's own report comes last)
        result["error_tail"] = output[-4000:]
        return result
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


def summarise(result: dict, warmup: int, device: str | None = None) -> dict:
    if result["returncode"] != 0:
        out = {"name": result["name"], "failed": True, "out_of_memory": result.get("out_of_memory", False),
               "timed_out": result["returncode"] == TIMEOUT_RETURNCODE,
               **{k: result[k] for k in ("side", "expect") if k in result}}
        if out["out_of_memory"] and result.get("expect") == "oom":
            out["outcome"] = "out of memory (expected)"
        if "predicted_memory" in result:
            out["predicted_stage_peaks_gib"] = result["predicted_memory"]["peak_gib"]
        return out
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
    summary.update(_mfu(steady, device))
    for key in ("side", "expect"):
        if key in result:
            summary[key] = result[key]
    if result.get("expect") == "oom":
        summary["outcome"] = "trained (expected out of memory)"
    return summary


def peak_tflops(device: str | None) -> float | None:
    """DENSE_BF16_TFLOPS of the device name (the most specific key it contains), None if unknown."""
    keys = [k for k in DENSE_BF16_TFLOPS if device and k in device]
    return DENSE_BF16_TFLOPS[max(keys, key=len)] if keys else None


def _mfu(steady: list[dict], device: str | None) -> dict:
    """Median model TFLOP/s per GPU (agoq.megatron.train.flops: no recompute counted) and MFU against the device's dense
    BF16 peak."""
    if not steady or "tflops_per_gpu" not in steady[0]:
        return {}
    tflops = statistics.median(r["tflops_per_gpu"] for r in steady)
    peak = peak_tflops(device)
    return {"tflops_per_gpu_median": tflops, **({"mfu": tflops / peak} if peak else {})}


def measured_peak_gib(summary: dict) -> float | None:
    """The largest measured per-GPU peak of a run (every stage where the script reported them)."""
    if summary.get("stage_peaks_gib"):
        return max(summary["stage_peaks_gib"])
    return summary.get("peak_gib")


def _fastest(summaries: list[dict], side: str, budget_gib: float) -> dict | None:
    fits = [s for s in summaries if s.get("side") == side and not s.get("failed")
            and (measured_peak_gib(s) or float("inf")) <= budget_gib]
    return max(fits, key=lambda s: s["tokens_per_second_median"]) if fits else None


def equal_memory_table(summaries: list[dict], budgets_gib) -> list[dict]:
    """Per budget: the fastest baseline and agoq run whose measured peak fits it, their tokens/s ratio and MFUs."""
    rows = []
    for budget in budgets_gib:
        base, agoq = _fastest(summaries, "baseline", budget), _fastest(summaries, "agoq", budget)
        row = {"budget_gib": budget, "baseline": base and base["name"], "agoq": agoq and agoq["name"]}
        for tag, run in (("baseline", base), ("agoq", agoq)):
            if run:
                row[f"{tag}_tokens_per_second"] = run["tokens_per_second_median"]
                row[f"{tag}_peak_gib"] = measured_peak_gib(run)
                row[f"{tag}_mfu"] = run.get("mfu")
        if base and agoq:
            row["speedup"] = agoq["tokens_per_second_median"] / base["tokens_per_second_median"]
        rows.append(row)
    return rows


def planner_capacity(model: str, budget: str, seq: int = 4096) -> dict:
    """``python -m agoq.plan --capacity`` for configs/model/<model>.yaml with LLaMA-3's vocabulary at ``budget``."""
    from agoq.plan.__main__ import main as plan_main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "capacity.json"
        argv = ["--capacity", "--model", str(MODEL_DIR / f"{model}.yaml"), "--vocab-size", str(LLAMA3_VOCAB),
                "--seq", str(seq), "--memory-budget", budget, "--max-gpus", "16", "--out", str(out)]
        if plan_main(argv) != 0:
            return {"error": f"python -m agoq.plan {' '.join(argv)} failed"}
        return {"command": "python -m agoq.plan " + " ".join(argv[:-2]), **json.loads(out.read_text())}


def _device_budget() -> str:
    """The planner's budget for this machine: GPU 0's total memory, 80GiB without a GPU."""
    import torch

    if torch.cuda.is_available():
        return str(torch.cuda.get_device_properties(0).total_memory)
    return "80GiB"


def expected_failure(summary: dict) -> bool:
    return bool(summary.get("failed") and summary.get("out_of_memory") and summary.get("expect") == "oom")


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


def select_variants(suite: str, smoke: bool, only: list[str] | None) -> list[dict]:
    variants = SUITES[suite](smoke)
    if only:
        variants = [v for v in variants if any(t in v["name"] for t in only)]
        if not variants:
            raise SystemExit(f"--only {only}: no variant of suite {suite!r} matches")
    return variants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="attention")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the medians")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU version of the suite")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="run only the variants whose name contains one of these strings")
    parser.add_argument("--list", action="store_true", help="print every variant's command; run nothing")
    args = parser.parse_args(argv)
    if args.list:
        for variant in select_variants(args.suite, args.smoke, args.only):
            print(f"{variant['name']}\n  {variant_command(variant, Path(args.out + '.' + 'log.jsonl'))[1]}")
        return 0
    report = {
        "suite": args.suite, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "environment": environment(),
        "warmup_iterations_excluded": args.warmup, "variants": [], "summary": [],
    }
    if args.suite in CAPACITY_PLANS:
        model, gpus = CAPACITY_PLANS[args.suite]
        report["planner_capacity"] = {"gpus_in_this_suite": gpus, **planner_capacity(model, _device_budget())}
    device = report["environment"].get("device")
    with tempfile.TemporaryDirectory() as tmp:
        for variant in select_variants(args.suite, args.smoke, args.only):
            print(f"bench: {dt.datetime.now(dt.UTC):%H:%M:%S} running {variant['name']}", file=sys.stderr, flush=True)
            result = run_variant(variant, Path(tmp), args.timeout)
            report["variants"].append(result)
            report["summary"].append(summarise(result, args.warmup, device))
            if args.suite in EQUAL_MEMORY_BUDGETS_GIB:
                report["equal_memory"] = equal_memory_table(report["summary"], EQUAL_MEMORY_BUDGETS_GIB[args.suite])
            print(json.dumps(report["summary"][-1]), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            # after each variant: a cut run keeps its results
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    failed = [s["name"] for s in report["summary"] if s.get("failed") and not expected_failure(s)]
    if failed:
        print(f"failed variants: {failed} (see error_tail in {args.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
