"""Deterministic, resumable sampling of a map-style dataset into per-data-parallel-rank micro-batches.

No megatron import: the semantics are those of Megatron-LM's ``MegatronPretrainingSampler``
(megatron/training/datasets/data_samplers.py, 0.19.2), which a megatron test uses as the oracle.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class PretrainingSampler:
    """Megatron's ``MegatronPretrainingSampler``: consecutive sample indices from ``consumed_samples``.

    Each step of ``micro_batch_size * dp_size`` indices is cut into per-rank slices; rank r gets
    ``[r * micro_batch_size, (r + 1) * micro_batch_size)``. The last incomplete step is dropped.
    Resuming = constructing it again with the ``consumed_samples`` saved in the checkpoint.
    """

    def __init__(
        self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} outside the dataset's {total_samples} "
                "samples; was the dataset built for fewer iterations than the checkpoint ran?"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        begin = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + begin, start + begin + self.micro_batch_size))


def iterate_batches(dataset, sampler: PretrainingSampler) -> Iterator[dict]:
    """Stack ``dataset[i]`` dicts into micro-batches in ``sampler`` order.

    Yields ``tokens``/``labels``/``position_ids`` [b, s] int64 and ``loss_mask`` [b, s] float32 as the
    dataset returns them (GPTDataset), plus ``attention_mask`` None: attention is causal.
    """
    for indices in sampler:
        samples = [dataset[i] for i in indices]
        batch = {key: torch.stack([sample[key] for sample in samples]) for key in BATCH_KEYS}
        batch["attention_mask"] = None
        yield batch
