"""Where a Megatron transformer layer sits: global layer index, pipeline rank, virtual stage.

Seam card
---------
Touches: the global 1-based layer number (Megatron adds the stage offset of
  ``get_transformer_layer_offset``; agoq.megatron.layer_plan computes it once per model chunk before the build,
  and each layer checks its row's against ``TransformerLayer.layer_number``), the layer's ``pg_collection.pp``
  (pipeline group),
  ``TransformerConfig.virtual_pipeline_model_parallel_size``, ``megatron.core.utils.get_pg_rank/size``.
Why: the activation policy is resolved per (global layer, pipeline rank, virtual stage, role).
Verified on: megatron-core 0.19.2 (PP=2 x VPP=2 with 4 layers puts layers {0, 2} on rank 0).
Guarded by: ``tests/megatron/test_activations_pp.py`` (formats per stage, global indices).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.utils import get_pg_rank, get_pg_size

from agoq.policy import Site


@dataclass(frozen=True)
class LayerPosition:
    """A layer's place in the pipeline; ``site(role)`` builds the policy Site."""

    layer_idx: int  # global, 0-based
    pp_rank: int
    pp_size: int
    vp_stage: int | None
    vp_size: int | None

    def site(self, role: str) -> Site:
        return Site(self.layer_idx, self.pp_rank, self.pp_size, self.vp_stage, self.vp_size, role)


def position_of(config, layer_number: int, pp_group, vp_stage: int | None) -> LayerPosition:
    """Position of the ``TransformerLayer`` with global 1-based ``layer_number`` (Megatron's, stage offset
    included) on the pipeline group ``pp_group`` (``pg_collection.pp``), ``vp_stage`` as passed to its
    constructor; callable in the layer's ``__init__`` before Megatron builds its submodules."""
    vp_size = config.virtual_pipeline_model_parallel_size
    if (vp_size is None) != (vp_stage is None):
        raise ValueError(
            f"layer {layer_number}: virtual_pipeline_model_parallel_size={vp_size} but vp_stage={vp_stage}; "
            "build every model chunk with its vp_stage (agoq.megatron.model.build_model_chunks does)"
        )
    return LayerPosition(
        layer_idx=layer_number - 1,
        pp_rank=get_pg_rank(pp_group),
        pp_size=get_pg_size(pp_group),
        vp_stage=vp_stage,
        vp_size=vp_size,
    )
