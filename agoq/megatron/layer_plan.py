"""Resolve first, then build: the policy x layout table of one model, resolved before Megatron builds a layer.

``ModelPlan`` is made once per model by ``agoq_layer_spec`` (agoq.megatron.model) and travels in the layer spec's
``params`` (``agoq_plan``). For each model chunk (pipeline rank, virtual stage), :func:`decoder_block_spec` asks it
for the chunk's rows (``ModelPlan.stage``: Megatron's layer offset and layer count, computed once per chunk; the
policy resolved per role by the storage rule of agoq.plan.storage; the FP8 rule of agoq.megatron.compute) and hands
Megatron one layer spec per layer (``TransformerBlockSubmodules(layer_specs=...)``, as megatron-core's
``get_gpt_decoder_block_spec`` does), each carrying its own resolved row, a frozen :class:`LayerOptions`, in
``params["agoq_layer"]``. The layer reads its row; it computes no offset and asks no resolver.

The plan also produces the policy table the trainer prints and saves with checkpoints (:meth:`ModelPlan.table`) and
records the rows it resolved for this rank (``layers``: what ``storage_table`` prints per stage).

One runtime object is shared on purpose: the model's ``SavedBytesCounter`` (``ModelPlan.counter``), which every row
references and every agoq module adds its packed bytes to; it is an accumulator of the running model, not a setting.

Where Megatron expands one layer spec itself (Megatron-LM's ``--spec``, which hands the spec to ``GPTModel``
unchanged; or ``build_module`` on the layer spec), the layer finds its row in the same plan by its local number
(``ModelPlan.row``): the chunk's rows are resolved once, on the chunk's first layer.

Seam card
---------
Touches: ``get_transformer_layer_offset`` and ``get_num_layers_to_build`` (once per chunk: the chunk's first global
  layer and layer count, as ``TransformerBlock`` / ``TransformerLayer`` compute them; the layer checks its
  ``layer_number`` against its row after Megatron built it), ``TransformerBlockSubmodules(layer_specs, layer_norm)``,
  ``transformer_block.LayerNormImpl`` (the final norm Megatron's ``_get_block_submodules`` picks for a layer spec),
  ``ModuleSpec.params``, ``parallel_state.get_pipeline_model_parallel_group``.
Why: Megatron's own per-layer configuration is one spec per layer (``get_gpt_decoder_block_spec``).
Verified on: megatron-core 0.19.2.
When disabled: a layer spec without a plan (``--agoq-disable``) goes to Megatron as it is (sequence parallelism
  aside: agoq.megatron.seqpar).
Guarded by: ``tests/megatron/test_specs.py``, ``tests/megatron/test_activations.py``,
  ``tests/megatron/test_activations_pp.py``, ``tests/megatron/test_contract.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from agoq.megatron.layers import SavedInputConfig
from agoq.megatron.sites import LayerPosition, position_of
from agoq.ops.fp8_scaling import FP8Recipe
from agoq.ops.saved_act import SavedBytesCounter, SavePaths
from agoq.plan.storage import LayerStorage, layer_storage
from agoq.policy import FP8Spec, PolicySpec, ScheduleInfo

__all__ = ["LayerOptions", "ModelPlan", "plan_of"]

_NO_SAVE = SavedInputConfig()


@dataclass(frozen=True)
class LayerOptions:
    """One layer's resolved row: where it sits, what each role stores (``agoq.plan.storage.LayerStorage``, None:
    every role Megatron's), the model's byte counter and host paths, its four linears' FP8 recipe and its MLP's
    Smooth-SwiGLU mode. The layer hands it to its modules' constructors (agoq.megatron.transformer_layer)."""

    position: LayerPosition | None = None
    storage: LayerStorage | None = None
    counter: SavedBytesCounter | None = None
    paths: SavePaths = SavePaths()
    fp8: FP8Recipe | None = None
    smooth: str | None = None

    def save(self, role: str, recomputed: bool = False) -> SavedInputConfig:
        if self.storage is None:
            return _NO_SAVE
        return SavedInputConfig(fmt=self.storage.fmt(role), key=(self.storage.layer_idx, role),
                                counter=self.counter, paths=self.paths, recomputed=recomputed)


@dataclass(eq=False)
class ModelPlan:
    """The policy x layout table of one model (module docstring). ``policy``: the activation policy (None: no agoq
    storage); ``schedule``: the pipeline schedule it resolves under (required with ``auto`` bits); ``compute``: the
    FP8 / Smooth-SwiGLU settings (None: off); ``paths``: host paths of the saved-activation code."""

    policy: PolicySpec | None
    schedule: ScheduleInfo | None = None
    compute: FP8Spec | None = None
    paths: SavePaths = field(default_factory=SavePaths)
    counter: SavedBytesCounter = field(default_factory=SavedBytesCounter)
    layers: dict[int, LayerStorage] = field(default_factory=dict)  # this rank's resolved storage per global index
    fp8_layers: dict[int, bool] = field(default_factory=dict)  # this rank's layers: runs FP8, per global index
    _stages: dict = field(default_factory=dict, repr=False)  # (pp rank, vp stage) -> tuple of LayerOptions

    def stage(self, config, vp_stage: int | None, pp_group) -> tuple[LayerOptions, ...]:
        """The rows of the chunk ``vp_stage`` on this pipeline rank (``pp_group``), resolved on first call."""
        pp_rank = get_pg_rank(pp_group)
        key = (pp_rank, vp_stage)
        if key not in self._stages:
            first = get_transformer_layer_offset(config, vp_stage, pp_rank) + 1  # global 1-based, as Megatron's
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            self._stages[key] = tuple(self._resolve(config, position_of(config, first + i, pp_group, vp_stage))
                                      for i in range(count))
        return self._stages[key]

    def row(self, config, layer_number: int, pp_group, vp_stage: int | None) -> LayerOptions:
        """The row of the layer with local 1-based ``layer_number`` in its chunk (Megatron's argument to the layer)."""
        rows = self.stage(config, vp_stage, pp_group)
        if not 1 <= layer_number <= len(rows):
            raise ValueError(f"agoq: layer {layer_number} of a chunk of {len(rows)} layers (pipeline rank "
                             f"{get_pg_rank(pp_group)}, virtual stage {vp_stage}); build the model with "
                             "agoq.megatron.model.build_model_chunks")
        return rows[layer_number - 1]

    def _resolve(self, config, position: LayerPosition) -> LayerOptions:
        storage = None
        if self.policy is not None:
            if self.schedule is not None and (self.schedule.pp_size, self.schedule.vp_size) != (
                    position.pp_size, position.vp_size):
                raise ValueError(
                    f"agoq_layer_spec got schedule pp_size={self.schedule.pp_size}, vp_size={self.schedule.vp_size} "
                    f"but the model runs pp_size={position.pp_size}, vp_size={position.vp_size}; build the "
                    "ScheduleInfo from the same layout")
            storage = layer_storage(self.policy, position.site, self.schedule)
            self.layers[storage.layer_idx] = storage
        compute = {}
        if self.compute is not None:
            from agoq.megatron.compute import layer_compute

            compute = layer_compute(self.compute, position.layer_idx, config.num_layers)
            self.fp8_layers[position.layer_idx] = compute["fp8"] is not None
        return LayerOptions(position=position, storage=storage,
                            counter=None if self.policy is None else self.counter,
                            paths=SavePaths() if self.policy is None else self.paths, **compute)

    def table(self, num_layers: int) -> str:
        """The policy resolved per layer and role for every stage of a uniformly split model of ``num_layers``
        (what the trainer prints and saves with each checkpoint); empty without a policy."""
        from agoq.policy import format_table, model_sites, policy_table

        if self.policy is None:
            return ""
        return format_table(policy_table(self.policy, model_sites(num_layers, self.schedule), self.schedule))

    def layer_specs(self, layer_spec: ModuleSpec, config, vp_stage: int | None, pp_group) -> list[ModuleSpec]:
        """One spec per layer of the chunk: ``layer_spec`` with the layer's row in ``params["agoq_layer"]``."""
        params = {k: v for k, v in layer_spec.params.items() if k != "agoq_plan"}
        return [dataclasses.replace(layer_spec, params={**params, "agoq_layer": row})
                for row in self.stage(config, vp_stage, pp_group)]


def plan_of(spec) -> ModelPlan | None:
    """The plan a layer spec from ``agoq_layer_spec`` carries (None: Megatron's modules, agoq disabled)."""
    return getattr(spec, "params", {}).get("agoq_plan")
