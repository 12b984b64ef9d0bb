"""Megatron's sequence parallelism (``TransformerConfig.sequence_parallel``, ``--sequence-parallel``) on agoq's layer
spec: the pieces outside the layers (the layers themselves: agoq.megatron.layers / mlp; the ops: agoq.ops.sp_comm).

Under sequence parallelism the residual stream and the norms are split along the sequence over the tensor-parallel
ranks ([s/tp, b, h]); a column-parallel linear all-gathers its input along the sequence before its GEMM, a
row-parallel linear reduce-scatters its output instead of all-reducing it, and the norm weights carry
``sequence_parallel=True`` so that ``finalize_model_grads`` all-reduces their gradients over TP. agoq's saves of the
residual stream (the pre-norm inputs, ``norm.input``; a QKV / fc1 storing its own input) are then the sharded tensors,
quantized as they are: 1/tp of the bytes per rank (agoq.plan.storage.LayerDims.numel).

Seam card
---------
Touches: ``TransformerBlockSubmodules(layer_specs, layer_norm)``, ``transformer_block.LayerNormImpl`` and
  ``get_num_layers_to_build`` (GPTModel's ``transformer_layer_spec`` may be a block's submodules; Megatron's own
  ``_get_block_submodules`` builds the same from a layer spec, with its ``LayerNormImpl`` as the final norm).
  ``block_spec`` is also where agoq's layer spec becomes one spec per layer with the layer's resolved row
  (agoq.megatron.layer_plan), with or without sequence parallelism.
Why: without Transformer Engine or apex Megatron's final norm is ``WrappedTorchNorm``, which megatron-core 0.19.2
  refuses under sequence parallelism (an assert); agoq's ``AgoqRMSNorm`` (``torch.nn.RMSNorm``, same parameter name
  ``weight``, its weight marked ``sequence_parallel``) takes its place there, as it does for the layers' pre-norms.
Verified on: megatron-core 0.19.2.
When disabled: ``sequence_parallel=False`` keeps Megatron's final norm (``LayerNormImpl``); a spec without agoq's
  layer goes to Megatron as given.
Guarded by: ``tests/megatron/test_sequence_parallel.py`` (TP=2 with sequence parallelism trains as TP=2 without and
  as TP=1; saved bytes per rank), ``tests/megatron/test_specs.py``, ``tests/megatron/test_contract.py``.
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.utils import get_pg_rank

__all__ = ["block_spec"]


def block_spec(layer_spec, config, vp_stage: int | None, pp_group=None):
    """What ``GPTModel(transformer_layer_spec=...)`` gets for one model chunk. ``pp_group``: the pipeline group the
    chunk's layers resolve their rows on (None: Megatron's, ``parallel_state``; agoq.megatron.stage_proxy passes the
    one-rank stand-in of a pipeline stage).

    A layer spec from ``agoq_layer_spec`` with agoq's modules carries the model's plan (agoq.megatron.layer_plan):
    the block's submodules, one spec per layer with that layer's resolved row, and as final norm Megatron's own
    choice for a layer spec (``transformer_block.LayerNormImpl``) or, under sequence parallelism, agoq's RMSNorm
    (module docstring). Any other spec goes to Megatron as given (Transformer Engine's norm takes sequence
    parallelism; the plain local spec's torch norm is refused by Megatron, and by the trainer before it); the
    ``--agoq-disable`` spec (Megatron's local modules) too, except under sequence parallelism, where it cannot run."""
    from megatron.core.transformer import transformer_block

    from agoq.megatron.layer_plan import plan_of
    from agoq.megatron.layers import AgoqRMSNorm
    from agoq.megatron.transformer_layer import AgoqTransformerLayer

    module = getattr(layer_spec, "module", None)
    if not (isinstance(module, type) and issubclass(module, AgoqTransformerLayer)):
        return layer_spec
    plan = plan_of(layer_spec)
    if pp_group is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    if plan is not None:
        layer_specs = plan.layer_specs(layer_spec, config, vp_stage, pp_group)
    elif config.sequence_parallel:
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=get_pg_rank(pp_group))
        layer_specs = [layer_spec] * count
    else:
        return layer_spec
    final_norm = AgoqRMSNorm if config.sequence_parallel else transformer_block.LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=final_norm)
