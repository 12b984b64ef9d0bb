"""megatron-core's configs and gradient hook that a trainer hands to Megatron: the model config of a built chunk,
the optimizer / DDP configs built from plain values (the trainer maps its flags onto their fields) and the default
gradient finalisation. No plugin module uses them. The loop's own parts (the pipeline schedule and the LR schedule)
are not here: the plugin runs no loop and names none of its parts; the trainer's entry script hands them in
(agoq.train.megatron_setup.MegatronLoop).

Seam card
---------
Touches (megatron-core 0.19.2, public, passed through unchanged): ``distributed.finalize_model_grads``,
  ``utils.get_model_config``, ``optimizer.OptimizerConfig``, ``distributed.DistributedDataParallelConfig``.
Why: one door to Megatron: the trainer names Megatron's fields, agoq.megatron imports Megatron.
Guarded by: tests/megatron/test_pretrain_script.py, tests/megatron/test_layouts.py.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from megatron.core.utils import get_model_config

megatron_finalize_model_grads = finalize_model_grads  # the config hook's default: reduce and finalize the gradients


def model_config(model_chunk):
    """The TransformerConfig a (wrapped) model chunk was built with (Megatron's ``get_model_config``)."""
    return get_model_config(model_chunk)


def optimizer_config(**fields) -> OptimizerConfig:
    """Megatron's OptimizerConfig (lr, weight decay, Adam betas / eps, clipping, dtype, distributed optimizer)."""
    return OptimizerConfig(**fields)


def ddp_config(**fields) -> DistributedDataParallelConfig:
    """Megatron's DistributedDataParallelConfig (gradient reduction dtype, overlap, buckets, distributed optimizer)."""
    return DistributedDataParallelConfig(**fields)
