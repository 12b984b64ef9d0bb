"""megatron-core's parts of a training loop, handed to the trainer, which builds the loop from them: the pipeline
schedule, the gradient finalisation, the model config, and the optimizer / DDP configs and LR schedule built from
plain values (the trainer maps its flags onto their fields). No plugin module uses them: the plugin runs no loop.

Seam card
---------
Touches (megatron-core 0.19.2, public, passed through unchanged): ``pipeline_parallel.get_forward_backward_func``,
  ``distributed.finalize_model_grads``, ``utils.get_model_config``, ``optimizer.OptimizerConfig``,
  ``distributed.DistributedDataParallelConfig``, ``optimizer_param_scheduler.OptimizerParamScheduler``.
Why: one door to Megatron: the trainer names Megatron's fields, agoq.megatron imports Megatron.
Guarded by: tests/megatron/test_pretrain_script.py, tests/megatron/test_layouts.py.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

megatron_finalize_model_grads = finalize_model_grads  # the config hook's default: reduce and finalize the gradients


def forward_backward_func():
    """Megatron's pipeline schedule for this run's layout (no pipelining, 1F1B or interleaved)."""
    return get_forward_backward_func()


def model_config(model_chunk):
    """The TransformerConfig a (wrapped) model chunk was built with (Megatron's ``get_model_config``)."""
    return get_model_config(model_chunk)


def optimizer_config(**fields) -> OptimizerConfig:
    """Megatron's OptimizerConfig (lr, weight decay, Adam betas / eps, clipping, dtype, distributed optimizer)."""
    return OptimizerConfig(**fields)


def ddp_config(**fields) -> DistributedDataParallelConfig:
    """Megatron's DistributedDataParallelConfig (gradient reduction dtype, overlap, buckets, distributed optimizer)."""
    return DistributedDataParallelConfig(**fields)


def lr_schedule(optimizer, **fields) -> OptimizerParamScheduler:
    """Megatron's OptimizerParamScheduler over ``optimizer`` (LR warm-up / decay and weight-decay schedule)."""
    return OptimizerParamScheduler(optimizer, **fields)
