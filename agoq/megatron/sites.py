"""Where a Megatron transformer layer sits: global layer index, pipeline rank, virtual stage.

Seam card
---------
Touches: ``TransformerLayer.layer_number`` (global, 1-based: Megatron adds the stage offset of
  ``get_transformer_layer_offset``), ``TransformerLayer.pg_collection.pp`` (pipeline group),
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


def layer_position(layer, vp_stage: int | None) -> LayerPosition:
    """Position of a built ``TransformerLayer`` (``vp_stage`` as passed to its constructor)."""
    vp_size = layer.config.virtual_pipeline_model_parallel_size
    if (vp_size is None) != (vp_stage is None):
        raise ValueError(
            f"layer {layer.layer_number}: virtual_pipeline_model_parallel_size={vp_size} but vp_stage={vp_stage}; "
            "build every model chunk with its vp_stage (agoq.megatron.model.build_model_chunks does)"
        )
    pp_group = layer.pg_collection.pp
    return LayerPosition(
        layer_idx=layer.layer_number - 1,
        pp_rank=get_pg_rank(pp_group),
        pp_size=get_pg_size(pp_group),
        vp_stage=vp_stage,
        vp_size=vp_size,
    )
