"""What ``scripts/pretrain_llama.py`` checks before torch and megatron load, once the world size is known: the
parallel layout (:func:`check_layout`), the batch sizes (:func:`microbatch_count`, also called by the trainer), the
policy's explicit requests against this layout (``check_policy_requests``) and, with --data-path, the tokenizer and
every dataset (:func:`preflight`).
"""

from __future__ import annotations

import argparse

from agoq.cli.optim_args import check_release_flags
from agoq.train.checks import check_policy_requests, data_blend


def check_layout(args: argparse.Namespace, world_size: int) -> None:
    """Tensor x pipeline parallel size against the number of processes (before any process group exists)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes "
            f"(torchrun --nproc-per-node {tp * pp}) or lower the parallel sizes"
        )


def microbatch_count(global_batch: int, micro_batch: int, tp: int, pp: int, vpp: int | None,
                     world_size: int) -> int:
    """Micro-batches per step and data-parallel rank, or a ValueError naming the flags and the batch sizes that
    fit: the global batch is a multiple of micro-batch x data-parallel size, and Megatron's interleaved
    schedule needs a multiple of the pipeline size of them."""
    dp_size = world_size // (tp * pp)
    per_step = micro_batch * dp_size
    if global_batch % per_step:
        below = global_batch // per_step * per_step
        fits = " or ".join(str(g) for g in (below, below + per_step) if g > 0)
        raise ValueError(
            f"--global-batch-size {global_batch} must be a multiple of --micro-batch-size {micro_batch} x "
            f"data-parallel size {dp_size} (world size {world_size} / (TP {tp} x PP {pp})) = {per_step}; use "
            f"--global-batch-size {fits}, or another --micro-batch-size"
        )
    count = global_batch // per_step
    if vpp and count % pp:
        fits = -(-count // pp) * pp * per_step
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({count}) to be a multiple of "
            f"--pipeline-model-parallel-size {pp}; raise --global-batch-size (e.g. {fits}), or drop "
            "--num-layers-per-virtual-pipeline-stage"
        )
    return count


def preflight(args: argparse.Namespace, world_size: int) -> None:
    """What the script checks before torch and megatron load: the layout and the batch sizes against ``world_size``
    (gradient release against the real data-parallel size too), and with
    --data-path the tokenizer and every dataset (headers, sizes, splits, token ids: agoq.data.indexed)."""
    check_layout(args, world_size)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    microbatches = microbatch_count(args.global_batch_size, args.micro_batch_size, tp, pp, args.vpp, world_size)
    check_release_flags(args, data_parallel=world_size // (tp * pp))
    check_policy_requests(args, microbatches)
    blend = data_blend(args.data_path)
    if blend:
        from agoq.data.indexed import check_split, check_token_ids, check_tokenizer_record, read_index
        from agoq.data.tokenizer import Tokenizer, model_vocab_size

        tokenizer = Tokenizer.load(args.tokenizer_model)
        model_vocab_size(tokenizer.vocab_size, args.vocab_size, f"--tokenizer-model {args.tokenizer_model}")
        for prefix in (p if isinstance(p, str) else p[1] for p in blend):
            data = read_index(prefix)
            check_split(data, args.split)
            check_token_ids(data, tokenizer.vocab_size, args.tokenizer_model)
            check_tokenizer_record(prefix, tokenizer.vocab_size, tokenizer.sha256, args.tokenizer_model)
