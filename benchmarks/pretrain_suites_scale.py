"""The suites of benchmarks/bench_pretrain.py that scale out or fill the memory (pretrain_suites.py has the rest
and the SUITES table).

Data and pipeline parallelism: ``dp2`` (issues 5/9: DP=2, distributed optimizer vs agoq's 8-bit reduction);
``dp2_link``, ``dp2_socket_allreduce`` and ``dp2_transport`` (issue 19: DP=2 as users run it, NVLink and a socket
stand-in for an inter-node link, with and without the distributed optimizer; NCCL vs peer transport);
``pp2_interleaved`` and ``pp4_interleaved`` (issue 18: 1F1B vs VPP=2); ``pp4_distopt`` and ``dp2_pp2`` (issue 19:
PP=4 and DP=2 x PP=2 with the distributed optimizer); ``dp2_pp4_8b`` and ``dp8`` (issue 26, 8 GPUs).

Issue 23 (capacity and speed at equal memory; every variant records tokens/s, MFU, loss first/last and the
planner's per-stage prediction next to the measured per-stage peaks):
``capacity_1gpu`` (the LLaMA-3-8B shape with its 128,256-row vocabulary on one GPU, seq 4096: Megatron's
baseline, expected to run out of memory and recorded as such, against agoq full, full + 4-bit moments and
gradient release; the planner's capacity answer for the device's memory is in the report);
``capacity_4gpu`` (the ~32B shape, configs/model/llama-32b.yaml, PP=4 on 4 GPUs: baseline vs agoq full, full +
4-bit moments); ``equal_memory_1b`` (~1B, seq 4096, one GPU) and ``equal_memory_8b_pp4`` (8B shape on 4 GPUs):
the baseline's options (micro-batch, selective / full recompute, the distributed optimizer where DP > 1) against
agoq's (larger micro-batches, no recompute, fewer pipeline stages); the report's ``equal_memory`` table takes,
per memory budget (EQUAL_MEMORY_BUDGETS_GIB), the fastest run of each side whose measured peak fits, with their
tokens/s ratio and MFUs.
"""

from __future__ import annotations

from pretrain_flags import COMMON, REAL_VOCAB, REPO_ROOT, SHAPES, arch_flags

# The suites below that take configs/model/llama3-8b.yaml were measured with the built-in tokenizer's 4096 rows; the
# file's vocab_size (LLaMA-3's 128256) is overridden so they keep that shape (benchmarks/validate_planner.py predicts
# them with those rows, BUILTIN_VOCAB).
LLAMA3_8B_FILE = ["--config", str(REPO_ROOT / "configs" / "model" / "llama3-8b.yaml"), "--vocab-size", "4096"]


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


def dp2_socket_allreduce_suite(smoke: bool) -> list[dict]:
    """Issue 19 item 3 without the distributed optimizer: the dp2_link steps on the socket stand-in only, every
    gradient all-reduced (Megatron fp32, Megatron bf16, agoq full, whose 8-bit store is all-reduced at two ranks
    through one all-gather of the codes, agoq.comm.reduce.stored_allreduce_route), --overlap-grad-reduce on."""
    shape, common = "1b", SHAPES["1b"] + COMMON + ["--train-iters", "6"]
    batch = ["--micro-batch-size", "4", "--global-batch-size", "16"]
    env = SOCKET_LINK_ENV
    if smoke:
        shape, common = "tiny", SHAPES["tiny"] + COMMON[2:] + ["--seq-length", "64", "--train-iters", "4"]
        batch, env = ["--micro-batch-size", "2", "--global-batch-size", "8"], {}
    variants = {
        "Megatron, fp32 reduction": ["--agoq-disable"],
        "Megatron, bf16 reduction": ["--agoq-disable", "--grad-reduce-in-bf16"],
        "agoq full (8-bit grads + lean optimizer), NCCL transport":
            ["--agoq-grads", "int8_b256", "--agoq-optimizer", "adamw", "--agoq-grad-transport", "nccl"],
    }
    return [{"name": f"{shape}/dp2/socket link/no distributed optimizer/{name}", "nproc": 2,
             "args": common + batch + ["--overlap-grad-reduce"] + extra, "env": env}
            for name, extra in variants.items()]


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
    common = [*LLAMA3_8B_FILE, "--seq-length", "4096",
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
        common, nproc = [*LLAMA3_8B_FILE, "--seq-length", "4096",
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
        common = [*LLAMA3_8B_FILE, "--seq-length", "4096",
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


def llama70b_8gpu_suite(smoke: bool) -> list[dict]:
    """Issue 47 on one 8-GPU node (a withheld kind so far): the LLaMA-3-70B shape (configs/model/llama3-70b.yaml's
    architecture, the 128,256-row vocabulary), seq 4096, micro-batch 1, 20 iterations, each layout the planner
    answered for 8 x 80 GB (docs/benchmarks/capacity.md): TP=2 x PP=4 agoq full + int8 policy (the fastest, 74.12 GiB
    predicted on stage 0); TP=1 x PP=8 with selective recompute and the aggressive policy under expandable segments
    (77.29 predicted; its stage 0 measured 77.24 alone on one H100, and ran out of memory without them); FP8 Smooth-
    SwiGLU at TP=4 x PP=2, agoq policy (75.00); and Megatron bf16 at its lowest-peak layout, TP=4 x PP=2 with full
    recompute (180.78 predicted: expected out of memory). Global batch 32, not the model file's 512: every stage
    holds the same micro-batches in flight (min(PP, micro-batches per step)), so the same peaks, in 1/16 of the
    step time (~15 s modelled at TP=2 x PP=4). About 25 minutes on eight H100s."""
    if smoke:
        common = _SMOKE_23 + ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "4"]
        pp2 = ["--pipeline-model-parallel-size", "2"]
        return [_v("tiny/pp2/baseline (Megatron bf16)", 2, common + pp2 + _BASELINE, "baseline"),
                _v("tiny/pp2/agoq full", 2, common + pp2 + _FULL + _policy("int8"), "agoq")]
    # --vocab-size: the model's 128,256 rows padded per TP as the planner pads them (REAL_VOCAB's divisor would be
    # multiplied by TP); the built-in corpus's 4096-entry tokenizer fits in them
    common = arch_flags("llama3-70b") + ["--vocab-size", "128256"] + COMMON[2:] + [
        "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "32", "--train-iters", "20"]
    layout = lambda tp, pp: ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]  # noqa: E731
    variants = [
        _v("70b/tp2_pp4/agoq full", 8, common + layout(2, 4) + _FULL + _policy("int8"), "agoq"),
        {**_v("70b/tp1_pp8/agoq full, selective recompute", 8,
              common + layout(1, 8) + _FULL + _SELECTIVE + _policy("aggressive"), "agoq"),
         "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
        _v("70b/tp4_pp2/agoq full + fp8 smooth-swiglu", 8, common + layout(4, 2) + _FULL + _FP8_SMOOTH
           + _policy("agoq"), "agoq"),
        _v("70b/tp4_pp2/baseline (Megatron bf16, full recompute)", 8,
           common + layout(4, 2) + _BASELINE + _FULL_RECOMPUTE, "baseline", expect="oom"),
    ]
    return variants


def _policy(name: str) -> list[str]:
    return ["--agoq-policy", str(REPO_ROOT / "configs" / "policy" / f"{name}.yaml")]


def equal_memory_1b_suite(smoke: bool) -> list[dict]:
    """Issue 23 item 2 on one GPU: ~1B (the LLaMA-3.2-1B body, the built-in 4096-row vocabulary as the memory
    suite), seq 4096, 32 sequences per step, 8 iterations. The baseline's options: micro-batch 1 / 2 / 4 / 8
    without recompute, 1 and 4 with selective recompute of core attention, 8 and 16 with full recompute; agoq
    full at micro-batch 4 / 8 / 16 without recompute, and agoq full with FP8 delayed linears and per-token
    Smooth-SwiGLU (the stable FP8 recipe, docs/numerics.md) at micro-batch 4 / 8: agoq spending its memory on FP8's
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
    per-token Smooth-SwiGLU; then the baseline's best layouts by the planner, PP=2 x DP=2 with the distributed
    optimizer at micro-batch 1 and at micro-batch 2 with full recompute, and agoq's DP=4 with FP8 + Smooth-SwiGLU
    at micro-batch 1 and 2. Every variant is predicted to fit 80 GiB. About 9 minutes on four H200s."""
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
        # the baseline's best layouts by the planner (2026-11-27): PP=2 x DP=2 without recompute (69.6 GiB) and
        # with full recompute at micro-batch 2 (53.4 GiB); agoq without a pipeline at all, with FP8
        _v("8b/pp2_dp2/baseline mbs1, distributed optimizer", 4, common + pp(2) + mbs(1) + _USERS + _BASELINE,
           "baseline"),
        _v("8b/pp2_dp2/baseline mbs2 full recompute, distributed optimizer", 4,
           common + pp(2) + mbs(2) + _USERS + _BASELINE + _FULL_RECOMPUTE, "baseline"),
        _v("8b/dp4/agoq full + fp8 smooth-swiglu mbs1, distributed optimizer", 4,
           common + pp(1) + mbs(1) + _USERS + _FULL + _FP8_SMOOTH, "agoq"),
        _v("8b/dp4/agoq full + fp8 smooth-swiglu mbs2, distributed optimizer", 4,
           common + pp(1) + mbs(2) + _USERS + _FULL + _FP8_SMOOTH, "agoq"),
    ]


# per equal-memory suite: the budgets (GiB per GPU) at which the fastest fitting run of each side is compared
EQUAL_MEMORY_BUDGETS_GIB = {"equal_memory_1b": (24, 32, 48, 80), "equal_memory_8b_pp4": (48, 64, 80)}
# per capacity suite: the model file and GPU count the planner's capacity answer is given for
CAPACITY_PLANS = {"capacity_1gpu": ("llama3-8b", 1), "capacity_4gpu": ("llama-32b", 4)}
