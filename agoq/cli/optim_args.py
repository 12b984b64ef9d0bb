"""--agoq-optimizer / --agoq-moments / --agoq-master ... flags (wired into agoq/cli/flags.py).

Part of the trainer's command line (with agoq.megatron.train.args): ``check_release_flags`` reads the parsed
Namespace (Megatron's layout and batch flags next to agoq's); library code gets ``agoq.config.AgoqConfig``."""

from __future__ import annotations

import argparse

# the values and defaults live with the config (agoq.config: one set of defaults for the trainer, the
# planner and the memory report); re-exported here for the flags' help and older imports
from agoq.config import (  # noqa: F401
    DEFAULT_MASTER,
    DEFAULT_MOMENTS,
    MASTER_CHOICES,
    MOMENT_PRESETS,
    OPTIMIZERS,
    parse_moments,
)


def add_optim_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agoq optimizer (quantized states, split master weights)")
    g.add_argument(
        "--agoq-optimizer",
        choices=OPTIMIZERS,
        default="torch",
        help="torch: Megatron's own Adam; adamw/lion/sgd: agoq.optim over quantized states",
    )
    g.add_argument(
        "--agoq-moments", default=DEFAULT_MOMENTS,
        help=f"state formats of agoq's optimizer: preset {sorted(MOMENT_PRESETS)} or '<m fmt>,<v fmt>' "
             f"(default {DEFAULT_MOMENTS}; needs --agoq-optimizer adamw/lion/sgd)",
    )
    g.add_argument(
        "--agoq-master",
        choices=MASTER_CHOICES,
        default=DEFAULT_MASTER,
        help="master weight of agoq's optimizer: split24 = bf16 + int8 remainder (FlashOptim), split32 = + int16, "
        f"fp32 = separate copy, none = plain bf16 update (default {DEFAULT_MASTER})",
    )
    g.add_argument(
        "--agoq-unfused",
        action="store_true",
        help="use the plain-PyTorch reference step instead of the fused Triton kernel",
    )
    g.add_argument(
        "--agoq-small-numel",
        type=int,
        default=4096,
        help="tensors with ndim < 2 or fewer elements keep fp32 states and a split32 master",
    )
    g.add_argument(
        "--agoq-gradient-release",
        action="store_true",
        help="step each param in its backward hook and free its grad (one stage, no accumulation)",
    )
    g.add_argument("--agoq-sgd-momentum", type=float, default=0.9, help="--agoq-optimizer sgd: momentum")
    g.add_argument("--agoq-sgd-nesterov", action="store_true", help="--agoq-optimizer sgd: Nesterov momentum")
    g.add_argument("--agoq-lion-beta1", type=float, default=0.9, help="--agoq-optimizer lion: update interpolation")
    g.add_argument("--agoq-lion-beta2", type=float, default=0.99, help="--agoq-optimizer lion: momentum decay")


def check_release_flags(args: argparse.Namespace, data_parallel: int | None = None) -> None:
    """With --agoq-gradient-release: raise ValueError naming the first flag it conflicts with.

    Release steps each parameter inside backward and keeps no gradient buffer, so it needs agoq's
    optimizer, gradients that are final after one backward (one pipeline stage, one tensor-parallel
    rank, one data-parallel rank, one micro-batch per step), no global-norm clipping, and none of the
    options that shape a gradient buffer (8-bit gradients, bf16 buffer, distributed optimizer).
    ``data_parallel`` None (the data-parallel size is not known yet: argument parsing): the data-parallel size and
    the micro-batches per step are left to the later calls that know it (the script's preflight, from the world
    size; pretrain, from the process group), so a DP=2 run is not told that it accumulates gradients."""
    if not getattr(args, "agoq_gradient_release", False):
        return
    from agoq.optim.release import check_release_compatible

    # --agoq-optimizer torch, --agoq-grads and --grad-reduce-in-bf16 with release: refused by AgoqConfig itself
    # (agoq.config: OptimizerOptions / AgoqConfig), which the trainer and python -m agoq.plan both build
    flags = [
        (args.use_distributed_optimizer, "--use-distributed-optimizer (it shards a gradient buffer that release "
                                         "does not have)"),
        (args.tensor_model_parallel_size > 1, f"--tensor-model-parallel-size {args.tensor_model_parallel_size} "
                                              "(needs 1)"),
        (getattr(args, "overlap_grad_reduce", False), "--overlap-grad-reduce (there is no gradient reduction to "
                                                      "overlap: release needs one data-parallel rank)"),
    ]  # fmt: skip
    for bad, what in flags:
        if bad:
            raise ValueError(f"--agoq-gradient-release conflicts with {what}; drop one of the two")
    if data_parallel is None:  # parsing: the data-parallel size, hence the micro-batches per step, comes later
        data_parallel, accumulation = 1, 1
    else:
        per_step = args.micro_batch_size * data_parallel
        accumulation = 1 if args.global_batch_size == per_step else max(2, -(-args.global_batch_size // per_step))
    check_release_compatible(pipeline_parallel=args.pipeline_model_parallel_size, data_parallel=data_parallel,
                             grad_accumulation=accumulation, clip_grad=args.clip_grad)  # fmt: skip
