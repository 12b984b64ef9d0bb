"""One global batch of random tokens through megatron-core's real pipeline schedule (PP tests' helper)."""

from __future__ import annotations

import torch


def one_global_batch(chunks, shape, num_microbatches: int, micro_batch: int, seed: int = 7) -> None:
    """Forward + backward of ``num_microbatches`` micro-batches with the schedule Megatron picks for the
    current parallel state (1F1B, or interleaved when there are several chunks); grads land in .grad."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from agoq.train.training import make_forward_step

    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, shape.vocab_size, (micro_batch, shape.seq_length + 1), generator=g)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                        "loss_mask": torch.ones(micro_batch, shape.seq_length),
                        "position_ids": torch.arange(shape.seq_length).expand(micro_batch, -1)})  # fmt: skip
    iters = [iter(list(batches)) for _ in chunks]
    get_forward_backward_func()(
        forward_step_func=make_forward_step(torch.device("cpu")), data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks, num_microbatches=num_microbatches, seq_length=shape.seq_length, micro_batch_size=micro_batch,
        forward_only=False)  # fmt: skip
