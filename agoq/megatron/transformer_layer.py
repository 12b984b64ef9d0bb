"""agoq's transformer layer: resolves the activation policy and the FP8 settings for its own global layer
index and pipeline stage, and hands them to its modules through their constructors.

``agoq_layer_spec`` (agoq.megatron.model) puts two resolvers in the spec's ``params``, shared by every
layer built from it: ``agoq_storage`` (``agoq.megatron.activations.ActivationStorage``: policy,
schedule, byte counter, host paths) and ``agoq_compute`` (``agoq.megatron.compute.LayerCompute``: the
FP8 spec). Megatron's ``build_module`` passes them to ``AgoqTransformerLayer.__init__``, which, before
``TransformerLayer.__init__`` builds the submodules, computes the layer's position, asks both resolvers
for this layer, and builds a per-layer copy of the submodule spec whose agoq entries carry their
settings as ``ModuleSpec.params`` (``wire_submodules``): ``agoq_save`` (a ``SavedInputConfig``: format,
counter key, counter, host paths, recomputed), ``agoq_fp8`` (the linears' ``FP8Recipe``),
``agoq_smooth`` (the MLP's Smooth-SwiGLU mode) and the recompute hand-offs (``Handoff``: the layer owns
input_layernorm -> linear_qkv and pre_mlp_layernorm -> linear_fc1; the MLP owns SwiGLU -> linear_fc2).
No attribute is written onto a built module, and no module reaches a sibling.

Under Megatron's CUDA graphs (``TransformerConfig.cuda_graph_impl``), the layer refuses, before Megatron builds its
graph manager, every agoq feature it uses that graphs cannot hold or that is not validated yet
(agoq.megatron.graphs.check_cuda_graphs), and its ``forward`` puts its FP8 linears' scaling state and weight cache
into the graph phase of the call (record, warm-up, capture: agoq.megatron.graphs.set_fp8_graph_phase).

Seam card
---------
Touches: ``TransformerLayer.__init__`` (subclass, spec.module; its parameters ``layer_number``,
  ``pg_collection``, ``vp_stage``, ``is_mtp_layer``, ``add_layer_offset``),
  ``get_transformer_layer_offset`` (the global ``layer_number`` Megatron sets, computed the same way
  before the submodules are built and checked equal after), ``TransformerLayerSubmodules``,
  ``SelfAttentionSubmodules`` and ``MLPSubmodules`` (copied per layer with ``dataclasses.replace``),
  ``ModuleSpec.params`` / ``build_module`` (constructor arguments), the MLP builder
  ``partial(AgoqMLP.as_mlp_submodule, submodules=...)`` (its keywords), ``ProcessGroupCollection``.
Why: the policy is per (global layer, stage, role) and the layer is the first module that knows its
  index; Megatron's own way to configure a module is its constructor arguments through the spec.
Verified on: megatron-core 0.19.2.
When disabled: no resolver in the spec (``agoq_layer_spec(policy=None, compute=None)`` builds
  Megatron's own modules); with resolvers that decide bf16 / FP8 off everywhere, every agoq module
  runs Megatron's code (bit-identical, tests/megatron/test_activations.py).
Guarded by: ``tests/megatron/test_activations.py`` (constructor wiring, hand-off errors, bit-identity),
  ``tests/megatron/test_cuda_graph_refusal.py`` / ``test_cuda_graph_replay.py`` (graphs, on the CPU),
  ``tests/megatron/test_activations_pp.py`` (formats per stage, global indices),
  ``tests/megatron/test_fp8_smooth.py``, ``tests/megatron/test_contract.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from agoq.megatron.graphs import check_cuda_graphs, graph_phase, graphs_on, layer_features, set_fp8_graph_phase
from agoq.megatron.layers import (
    AgoqRMSNorm,
    Handoff,
    SavedInputConfig,
    _AgoqLinearMixin,
    with_params,
)
from agoq.megatron.mlp import AgoqMLP
from agoq.megatron.sites import position_of
from agoq.ops.fp8_scaling import FP8Recipe
from agoq.ops.saved_act import SavedBytesCounter, SavePaths
from agoq.plan.storage import LayerStorage

__all__ = ["AgoqTransformerLayer", "LayerOptions", "check_megatron_recompute", "wire_submodules"]

_NO_SAVE = SavedInputConfig()


@dataclass(frozen=True)
class LayerOptions:
    """What one layer's agoq modules get at construction, resolved for its global index and stage:
    the storage rule's result (``agoq.plan.storage.LayerStorage``, None: every role Megatron's), the
    shared byte counter and host paths, the FP8 recipe of its four linears and the Smooth-SwiGLU mode."""

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


def _module_class(entry):
    if isinstance(entry, functools.partial):  # the MLP builder: partial(AgoqMLP.as_mlp_submodule, ...)
        return getattr(entry.func, "__self__", entry.func)
    return entry.module if isinstance(entry, ModuleSpec) else entry


def _check_agoq_entries(entries: dict, layer_number: int) -> None:
    wanted = {"input_layernorm": AgoqRMSNorm, "pre_mlp_layernorm": AgoqRMSNorm, "mlp": AgoqMLP}
    wrong = [name for name, entry in entries.items()
             if not (isinstance(_module_class(entry), type)
                     and issubclass(_module_class(entry), wanted.get(name, _AgoqLinearMixin)))]
    if wrong:
        raise ValueError(
            f"layer {layer_number}: {wrong} are not agoq modules; build the model with "
            "agoq.megatron.model.agoq_layer_spec(..., policy=... or compute=...) so every saved activation "
            "and FP8 linear has an owner"
        )


def wire_submodules(submodules, options: LayerOptions, attn_handoff: Handoff, mlp_handoff: Handoff,
                    layer_number: int):
    """A per-layer copy of the spec's ``TransformerLayerSubmodules`` whose agoq entries carry their
    constructor arguments (``options``, the two pre-norm hand-offs); the MLP adds its own fc2 hand-off."""
    st = options.storage
    norm_rc = st is not None and st.norm_recompute
    fc2_rc = st is not None and st.swiglu_recompute
    attn = submodules.self_attention
    mlp = submodules.mlp
    if not (isinstance(mlp, functools.partial) and "submodules" in mlp.keywords):
        raise ValueError(f"layer {layer_number}: the spec's mlp entry must be partial(AgoqMLP.as_mlp_submodule, "
                         f"submodules=...) (agoq_layer_spec builds it), got {mlp!r}")
    attn_sub, mlp_sub = attn.submodules, mlp.keywords["submodules"]
    _check_agoq_entries({
        "input_layernorm": submodules.input_layernorm, "pre_mlp_layernorm": submodules.pre_mlp_layernorm,
        "linear_qkv": attn_sub.linear_qkv, "linear_proj": attn_sub.linear_proj, "mlp": mlp,
        "linear_fc1": mlp_sub.linear_fc1, "linear_fc2": mlp_sub.linear_fc2}, layer_number)
    fp8 = options.fp8
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn_sub,
        linear_qkv=with_params(attn_sub.linear_qkv, agoq_save=options.save("attn.qkv_input", norm_rc),
                               agoq_handoff=attn_handoff, agoq_fp8=fp8),
        linear_proj=with_params(attn_sub.linear_proj, agoq_save=options.save("attn.proj_input"), agoq_fp8=fp8)))
    mlp_sub = dataclasses.replace(
        mlp_sub,
        linear_fc1=with_params(mlp_sub.linear_fc1, agoq_save=options.save("mlp.fc1_input", norm_rc),
                               agoq_handoff=mlp_handoff, agoq_fp8=fp8),
        linear_fc2=with_params(mlp_sub.linear_fc2, agoq_save=options.save("mlp.fc2_input", fc2_rc), agoq_fp8=fp8))
    mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": mlp_sub,
                                                     "agoq_save": options.save("mlp.swiglu_input"),
                                                     "agoq_smooth": options.smooth})
    norm_save = options.save("norm.input")
    return dataclasses.replace(
        submodules,
        input_layernorm=with_params(submodules.input_layernorm, agoq_save=norm_save, agoq_handoff=attn_handoff),
        self_attention=attn,
        pre_mlp_layernorm=with_params(submodules.pre_mlp_layernorm, agoq_save=norm_save, agoq_handoff=mlp_handoff),
        mlp=mlp,
    )


def check_megatron_recompute(config, storage: LayerStorage | None) -> None:
    """Refuse, by name and with the fix, Megatron options that feed agoq's recomputing linears something else than
    the producer's output: its selective recompute of the norms (``recompute_modules`` "layernorm": the norm runs
    without a graph inside a checkpoint, so agoq's norm stores nothing and hands no stash) or of the MLP ("mlp": fc1
    runs without grad inside the checkpoint on a norm output handed without a graph, whose gradients the norm +
    linear node would otherwise lose), and its MLP chunking in
    training (``mlp_chunks_for_training`` > 1: fc1 and fc2 see chunks of the norm / SwiGLU output). Without this the
    first forward stops with an error that does not name the option (measured on megatron-core 0.19.2, CPU: the
    hand-off's "input is not the output of the recomputable op" for the chunks, a NameError inside Megatron's norm
    checkpoint without Transformer Engine for "layernorm")."""
    if storage is None:
        return
    problems = []
    modules = (config.recompute_modules or ()) if config.recompute_granularity == "selective" else ()
    if storage.norm_recompute and "layernorm" in modules:
        problems.append("recompute_modules with 'layernorm' (Megatron's norm recompute; agoq recomputes the norms "
                        "itself from their quantized input): drop 'layernorm' from --recompute-modules")
    if storage.norm_recompute and "mlp" in modules:
        problems.append("recompute_modules with 'mlp' (Megatron checkpoints the MLP, whose fc1 then runs without "
                        "grad on the pre-MLP norm's output): drop 'mlp' from --recompute-modules")
    if (storage.norm_recompute or storage.swiglu_recompute) and config.mlp_chunks_for_training > 1:
        problems.append(f"mlp_chunks_for_training={config.mlp_chunks_for_training}: leave it at 1")
    if problems:
        raise NotImplementedError(
            f"agoq's activation policy recomputes the norms / SwiGLU for the linears they feed, which does not combine "
            f"with {'; '.join(problems)}; or use a policy that keeps those roles bf16 (configs/policy/bf16.yaml)")


class AgoqTransformerLayer(TransformerLayer):
    """TransformerLayer whose agoq modules get the activation policy's formats and the FP8 settings for
    this layer through their constructors.

    ``agoq_storage`` (an ``agoq.megatron.activations.ActivationStorage``) and ``agoq_compute`` (an
    ``agoq.megatron.compute.LayerCompute``) arrive through the spec's ``params``: resolvers shared by
    every layer, queried here with this layer's global index and pipeline stage before Megatron builds
    the submodules (None leaves Megatron's behaviour). The layer owns the two pre-norm hand-offs
    (``agoq_handoffs``: input_layernorm -> linear_qkv, pre_mlp_layernorm -> linear_fc1).
    """

    def __init__(self, config, submodules, layer_number: int = 1, *, pg_collection=None, vp_stage: int | None = None,
                 is_mtp_layer: bool = False, add_layer_offset: bool = True, agoq_storage=None, agoq_compute=None,
                 **kwargs):
        if pg_collection is None:  # as TransformerLayer.__init__
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        # Megatron's global layer_number (TransformerLayer.__init__), needed before it builds the submodules
        global_number = layer_number
        if not is_mtp_layer and add_layer_offset:
            global_number += get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
        options, handoffs = None, ()
        if agoq_storage is not None or agoq_compute is not None:
            position = position_of(config, global_number, pg_collection.pp, vp_stage)
            options = LayerOptions(
                storage=None if agoq_storage is None else agoq_storage.resolve(position),
                counter=None if agoq_storage is None else agoq_storage.counter,
                paths=SavePaths() if agoq_storage is None else agoq_storage.paths,
                **({} if agoq_compute is None else agoq_compute.resolve(position, config.num_layers)),
            )
            # before Megatron builds the layer's graph manager: a feature graphs cannot hold is refused by name
            check_cuda_graphs(config, layer_features(options))
            check_megatron_recompute(config, options.storage)
            handoffs = (Handoff(f"layer {position.layer_idx} input_layernorm -> linear_qkv"),
                        Handoff(f"layer {position.layer_idx} pre_mlp_layernorm -> linear_fc1"))
            submodules = wire_submodules(submodules, options, *handoffs, layer_number=global_number)
        super().__init__(config, submodules, layer_number, pg_collection=pg_collection, vp_stage=vp_stage,
                         is_mtp_layer=is_mtp_layer, add_layer_offset=add_layer_offset, **kwargs)
        if self.layer_number != global_number:
            raise RuntimeError(f"agoq computed global layer_number {global_number}, Megatron's layer has "
                               f"{self.layer_number}; megatron-core's layer numbering changed (agoq.megatron.compat)")
        self.agoq_options = options  # LayerOptions this layer's modules were built with (None: no agoq settings)
        self.agoq_handoffs = handoffs  # (input_layernorm -> linear_qkv, pre_mlp_layernorm -> linear_fc1)
        # under Megatron's CUDA graphs, the FP8 linears whose scaling state and weight cache follow the graph phase
        self.agoq_graph_fp8 = () if not graphs_on(config) or options is None or options.fp8 is None else tuple(
            m for m in (self.self_attention.linear_qkv, self.self_attention.linear_proj,
                        self.mlp.linear_fc1, self.mlp.linear_fc2) if getattr(m, "agoq_fp8", None) is not None)

    @functools.wraps(TransformerLayer.forward)  # Megatron's signature for introspection
    def forward(self, *args, **kwargs):
        if self.agoq_graph_fp8:  # graphs on: record (eager), warm-up or capture (agoq.megatron.graphs.graph_phase)
            set_fp8_graph_phase(self.agoq_graph_fp8, graph_phase())
        return super().forward(*args, **kwargs)
