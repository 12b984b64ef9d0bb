"""Checks of the parsed optimizer flags (the flags themselves are generated from AgoqConfig: agoq.cli.agoq_flags).

Part of the trainer's command line (with agoq.train.args): ``check_release_flags`` reads the parsed
Namespace (Megatron's layout and batch flags next to agoq's); library code gets ``agoq.config.AgoqConfig``."""

from __future__ import annotations

import argparse

from agoq.config import flag_for


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
            raise ValueError(f"{flag_for('optimizer.gradient_release')} conflicts with {what}; drop one of the two")
    if data_parallel is None:  # parsing: the data-parallel size, hence the micro-batches per step, comes later
        data_parallel, accumulation = 1, 1
    else:
        per_step = args.micro_batch_size * data_parallel
        accumulation = 1 if args.global_batch_size == per_step else max(2, -(-args.global_batch_size // per_step))
    check_release_compatible(pipeline_parallel=args.pipeline_model_parallel_size, data_parallel=data_parallel,
                             grad_accumulation=accumulation, clip_grad=args.clip_grad)  # fmt: skip
