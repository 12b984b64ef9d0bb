"""The suites of benchmarks/bench_pretrain.py (``--suite NAME``): every suite is a function ``NAME_suite(smoke)``
returning its variants, each a dict of ``name``, ``nproc`` (GPUs), ``args`` (scripts/pretrain_llama.py flags) and
optionally ``env``, ``script`` (a driver run in place of the script), ``side`` / ``expect`` (issue 23). ``smoke``
gives the tiny CPU version of the suite. SUITES names them all: this module's and pretrain_suites_scale.py's.

This module: ``attention`` (issue 2: SDPA vs Megatron's unfused DotProductAttention, ~350M and ~1B LLaMA
shapes, PP=1, one GPU); ``lean`` (issues 5/6/9: Megatron baseline vs agoq's optimizer and 8-bit
gradients, ~1B, PP=1, one GPU); ``memory`` (issue 9: baseline vs agoq presets at equal batch, and the baseline
with full recompute vs agoq at a larger micro-batch); ``fp8`` (issue 7: bf16 vs FP8 linears vs FP8 +
Smooth-SwiGLU vs FP8 with Triton's launch dispatch, ~1B, PP=1, one GPU, 30 iterations for a short loss
comparison; also run by benchmarks/bench_fp8.py); ``fp8_scale`` (issues 4 and 7: FP8 and agoq activations at
GPU-bound shapes, ~1B at micro-batch 4 and 8 layers of the LLaMA-2-7B body at seq 4096).
``grads`` (issue 5: the memory suite's equal-batch variants with and without 8-bit gradients, torch
Adam and agoq's optimizer, under 4 minutes). ``release`` (issue 6: agoq AdamW with an fp32 / bf16 gradient
buffer vs ``--agoq-gradient-release``, ~1B, one GPU, one micro-batch per step, under 4 minutes).
``act_host`` (issue 4: the host-bound ~1B shape at seq 4096, micro-batch 1 and 2, baseline vs agoq's default policy).
FP8 variants need a GPU, so the fp8 smoke suite runs bf16 and Smooth-SwiGLU only.

``graphs`` (issue 24 item 3: the host-bound ~1B shape at seq 4096, micro-batch 1, eager and under Megatron's CUDA
graphs, baseline / agoq / bf16 / FP8 pairs); ``graphs_pp2`` (the same shape at PP=2 on 2 GPUs, baseline and agoq);
``graphs_pp2_fp8`` (the same at PP=2, bf16 vs FP8 delayed linears).

pretrain_suites_scale.py: the data / pipeline parallel suites (dp2, dp2_link, dp2_transport, pp2_interleaved,
pp4_interleaved, pp4_distopt, dp2_pp2, dp2_pp4_8b, dp8) and issue 23's capacity and equal-memory suites.
"""

from __future__ import annotations

from pretrain_flags import COMMON, REPO_ROOT, SHAPES
from pretrain_suites_scale import (
    capacity_1gpu_suite,
    capacity_4gpu_suite,
    dp2_link_suite,
    dp2_pp2_suite,
    dp2_pp4_8b_suite,
    dp2_socket_allreduce_suite,
    dp2_suite,
    dp2_transport_suite,
    dp8_suite,
    equal_memory_1b_suite,
    equal_memory_8b_pp4_suite,
    llama70b_8gpu_suite,
    pp2_interleaved_suite,
    pp4_distopt_suite,
    pp4_interleaved_suite,
)


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
    # (agoq.kernels.fastlaunch): what the direct path saves in a whole step
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
    Smooth-SwiGLU (what agoq.plan.fp8 models for it) and one A/B variant: plain FP8 with Megatron's SwiGLU before
    the FP8 fc2 (AGOQ_FP8_SWIGLU_FUSION=0). The per-token un-smoothing after a tensor-wise GEMM (AGOQ_SMOOTH_UNSMOOTH,
    measured +0.6 % step time, docs/benchmarks/fp8.md) is no trainer switch any more: benchmarks/bench_fp8.py times
    it at the op level (``unsmooth="epilogue"``)."""
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
    (target: >= 1.00x the baseline in the same mode), and apart the part of it that is agoq's fused RoPE (Megatron
    with only that, agoq without it); bf16 linears and FP8 delayed linears under the bf16 policy
    (target: FP8 >= 1.05x bf16), and FP8 delayed + per-token Smooth-SwiGLU; eager also with Megatron-LM's
    --manual-gc (no collector pause inside a step). Every variant runs the same driver (it changes nothing when the
    refusal does not apply). About 14 minutes on one H100. ``--smoke``: the eager half on the
    CPU (graphs need a GPU)."""
    shape, seq, iters = ("tiny", "64", "4") if smoke else ("1b", "4096", "9")
    common = SHAPES[shape] + COMMON + ["--seq-length", seq, "--train-iters", iters, "--micro-batch-size", "1",
                                       "--global-batch-size", "8"]
    bf16 = ["--agoq-policy", str(REPO_ROOT / "configs" / "policy" / "bf16.yaml")]
    fp8 = [] if smoke else ["--agoq-fp8", "delayed"]  # FP8 needs a GPU: the smoke suite checks the plumbing
    pairs = {"baseline (Megatron)": ["--agoq-disable"], "agoq activations (default policy)": [],
             # agoq's fused RoPE (the default where agoq is on) apart: Megatron with it, agoq without it
             "Megatron + agoq RoPE only": ["--agoq-disable", "--rope-fusion", "agoq"],
             "agoq, unfused RoPE": ["--rope-fusion", "off"],
             "bf16 linears (bf16 policy)": bf16, "fp8 delayed (bf16 policy)": bf16 + fp8,
             "fp8 delayed + smooth-swiglu per-token (bf16 policy)": bf16 + fp8 + ["--agoq-smooth-swiglu", "per-token"]}
    modes = {"eager": [], "eager_manual_gc": ["--manual-gc"]}
    if not smoke:
        modes["graphs"] = ["--cuda-graph-impl", "local"]
    return [{"name": f"{shape}/mbs1/{name}/{mode}", "nproc": 1, "args": common + extra + graphs,
             "script": UNVALIDATED_GRAPHS_DRIVER}
            for name, extra in pairs.items() for mode, graphs in modes.items()]


def _graphs_pp2_common(smoke: bool) -> tuple[str, list[str]]:
    """(shape name, flags) of the PP=2 host-bound corner: ~1B, seq 4096, mbs 1, 16 micro-batches, 9 iterations."""
    shape, seq, iters = ("tiny", "64", "4") if smoke else ("1b", "4096", "9")
    return shape, SHAPES[shape] + COMMON + ["--seq-length", seq, "--train-iters", iters, "--micro-batch-size", "1",
                                            "--global-batch-size", "16", "--pipeline-model-parallel-size", "2"]


def graphs_pp2_suite(smoke: bool) -> list[dict]:
    """Issue 24 item 3 at PP=2 on 2 GPUs: the graphs suite's ~1B shape at seq 4096 and micro-batch 1 split over two
    pipeline stages (1F1B, 16 micro-batches per step, 9 iterations), eager, eager with Megatron-LM's --manual-gc
    (the 2026-11-27 eager agoq run had slow steps in bursts: Python's collector pausing one stage stalls both) and
    under Megatron's CUDA graphs, for the Megatron baseline and agoq's default activation policy (target: agoq >=
    1.00x the baseline in the same mode). About 7 minutes on two H100s. ``--smoke``: the eager half on the CPU."""
    shape, common = _graphs_pp2_common(smoke)
    pairs = {"baseline (Megatron)": ["--agoq-disable"], "agoq activations (default policy)": [],
             "Megatron + agoq RoPE only": ["--agoq-disable", "--rope-fusion", "agoq"]}  # agoq's RoPE part apart
    modes = {"eager": [], "eager_manual_gc": ["--manual-gc"]}
    if not smoke:
        modes["graphs"] = ["--cuda-graph-impl", "local"]
    return [{"name": f"{shape}/pp2/mbs1/{name}/{mode}", "nproc": 2, "args": common + extra + graphs,
             "script": UNVALIDATED_GRAPHS_DRIVER}
            for name, extra in pairs.items() for mode, graphs in modes.items()]


def graphs_pp2_fp8_suite(smoke: bool) -> list[dict]:
    """Issue 24 item 3's FP8 target at PP=2 on 2 GPUs: the graphs_pp2 shape (~1B, seq 4096, micro-batch 1, 16
    micro-batches, 1F1B, 9 iterations) with bf16 linears and FP8 delayed linears, both under the bf16 policy
    (target: FP8 >= 1.05x the bf16 linears), eager and under Megatron's CUDA graphs. About 5 minutes on two H100s.
    ``--smoke``: the bf16 eager run on the CPU (FP8 and graphs need a GPU)."""
    shape, common = _graphs_pp2_common(smoke)
    bf16 = ["--agoq-policy", str(REPO_ROOT / "configs" / "policy" / "bf16.yaml")]
    pairs = {"bf16 linears (bf16 policy)": bf16}
    modes = {"eager": []}
    if not smoke:
        pairs["fp8 delayed (bf16 policy)"] = bf16 + ["--agoq-fp8", "delayed"]
        modes["graphs"] = ["--cuda-graph-impl", "local"]
    return [{"name": f"{shape}/pp2/mbs1/{name}/{mode}", "nproc": 2, "args": common + extra + graphs,
             "script": UNVALIDATED_GRAPHS_DRIVER}
            for name, extra in pairs.items() for mode, graphs in modes.items()]


SUITES = {"act_host": act_host_suite, "graphs": graphs_suite, "graphs_pp2": graphs_pp2_suite,
          "graphs_pp2_fp8": graphs_pp2_fp8_suite,
          "pp2_interleaved": pp2_interleaved_suite, "attention": attention_suite,
          "fp8_scale": fp8_scale_suite, "lean": lean_suite, "memory": memory_suite, "fp8": fp8_suite,
          "grads": grads_suite, "dp2": dp2_suite, "dp2_link": dp2_link_suite,
          "dp2_socket_allreduce": dp2_socket_allreduce_suite, "dp2_transport": dp2_transport_suite,
          "release": release_suite,
          "pp4_interleaved": pp4_interleaved_suite, "pp4_distopt": pp4_distopt_suite, "dp2_pp2": dp2_pp2_suite,
          "capacity_1gpu": capacity_1gpu_suite, "capacity_4gpu": capacity_4gpu_suite,
          "equal_memory_1b": equal_memory_1b_suite, "equal_memory_8b_pp4": equal_memory_8b_pp4_suite,
          "dp2_pp4_8b": dp2_pp4_8b_suite, "dp8": dp8_suite, "llama70b_8gpu": llama70b_8gpu_suite}
