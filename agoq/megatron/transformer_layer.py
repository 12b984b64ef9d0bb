"""agoq's transformer layer: reads its own resolved row (format per role, FP8 recipe, Smooth-SwiGLU mode) from its
spec and hands it to its modules through their constructors.

The model's policy x layout table is resolved before Megatron builds a layer (``agoq.megatron.layer_plan.ModelPlan``):
each layer spec carries the layer's row, a ``LayerOptions``, as ``params["agoq_layer"]``, which Megatron's
``build_module`` passes to ``AgoqTransformerLayer.__init__``. Before ``TransformerLayer.__init__`` builds the
submodules, the layer builds a per-layer copy of the submodule spec whose agoq entries carry their settings as
``ModuleSpec.params`` (``wire_submodules``): ``agoq_save`` (a ``SavedInputConfig``: format, counter key, counter,
host paths, recomputed), ``agoq_fp8`` (the linears' ``FP8Recipe``), ``agoq_smooth`` (the MLP's Smooth-SwiGLU mode) and
the recompute hand-offs (``Handoff``: the layer owns input_layernorm -> linear_qkv and pre_mlp_layernorm ->
linear_fc1; the MLP owns SwiGLU -> linear_fc2). No attribute is written onto a built module, and no module reaches a
sibling. Where Megatron expanded one layer spec itself (Megatron-LM's ``--spec``), the spec carries the model's plan
(``params["agoq_plan"]``) and the layer takes its row from it by its local number (``ModelPlan.row``).

Under Megatron's CUDA graphs (``TransformerConfig.cuda_graph_impl``), the layer refuses, before Megatron builds its
graph manager, every agoq feature it uses that graphs cannot hold or that is not validated yet
(agoq.megatron.graphs.check_cuda_graphs), and its ``forward`` puts its FP8 linears' scaling state and weight cache
into the graph phase of the call (record, warm-up, capture: agoq.megatron.graphs.set_fp8_graph_phase).

Seam card
---------
Touches: ``TransformerLayer.__init__`` (subclass, spec.module; its parameters ``layer_number``,
  ``pg_collection``, ``vp_stage``, ``is_mtp_layer``, ``add_layer_offset``; the global ``layer_number`` Megatron
  sets is checked equal to the row's after), ``TransformerLayerSubmodules``,
  ``SelfAttentionSubmodules`` and ``MLPSubmodules`` (copied per layer with ``dataclasses.replace``),
  ``ModuleSpec.params`` / ``build_module`` (constructor arguments), the MLP builder
  ``partial(AgoqMLP.as_mlp_submodule, submodules=...)`` (its keywords), ``ProcessGroupCollection``.
Why: the policy is per (global layer, stage, role), resolved per layer spec before the build (Megatron's
  ``get_gpt_decoder_block_spec`` model); Megatron's own way to configure a module is its constructor arguments
  through the spec.
Verified on: megatron-core 0.19.2.
When disabled: no row in the spec (``agoq_layer_spec(policy=None, compute=None)`` builds
  Megatron's own modules); with rows that decide bf16 / FP8 off everywhere, every agoq module
  runs Megatron's code (bit-identical, tests/megatron/test_activations.py).
Guarded by: ``tests/megatron/test_activations.py`` (constructor wiring, hand-off errors, bit-identity),
  ``tests/megatron/test_cuda_graph_refusal.py`` / ``test_cuda_graph_replay.py`` (graphs, on the CPU),
  ``tests/megatron/test_activations_pp.py`` (formats per stage, global indices),
  ``tests/megatron/test_fp8_smooth.py``, ``tests/megatron/test_contract.py``.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from agoq.megatron.graphs import check_cuda_graphs, graph_phase, graphs_on, layer_features, set_fp8_graph_phase
from agoq.megatron.layer_plan import LayerOptions
from agoq.megatron.layers import (
    AgoqRMSNorm,
    Handoff,
    _AgoqLinearMixin,
    with_params,
)
from agoq.megatron.mlp import AgoqMLP
from agoq.plan.storage import LayerStorage

__all__ = ["AgoqTransformerLayer", "LayerOptions", "check_megatron_recompute", "wire_submodules"]

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
    """TransformerLayer whose agoq modules get this layer's resolved row (``agoq_layer``, a
    ``agoq.megatron.layer_plan.LayerOptions``, from the layer's spec) through their constructors.

    ``agoq_plan`` (the model's ``ModelPlan``) instead of a row: the layer was built from one spec shared by the
    chunk's layers (Megatron-LM's ``--spec``); its row is the plan's for its local ``layer_number``. Neither: Megatron's
    behaviour. The layer owns the two pre-norm hand-offs (``agoq_handoffs``: input_layernorm -> linear_qkv,
    pre_mlp_layernorm -> linear_fc1).
    """

    def __init__(self, config, submodules, layer_number: int = 1, *, pg_collection=None, vp_stage: int | None = None,
                 is_mtp_layer: bool = False, add_layer_offset: bool = True, agoq_layer: LayerOptions | None = None,
                 agoq_plan=None, **kwargs):
        if pg_collection is None:  # as TransformerLayer.__init__
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        options, handoffs = agoq_layer, ()
        if options is None and agoq_plan is not None:
            if is_mtp_layer or not add_layer_offset:
                raise NotImplementedError("agoq's layer is a decoder layer: no multi-token-prediction layer")
            options = agoq_plan.row(config, layer_number, pg_collection.pp, vp_stage)
        if options is not None:
            idx = options.position.layer_idx
            # before Megatron builds the layer's graph manager: a feature graphs cannot hold is refused by name
            check_cuda_graphs(config, layer_features(options))
            check_megatron_recompute(config, options.storage)
            handoffs = (Handoff(f"layer {idx} input_layernorm -> linear_qkv"),
                        Handoff(f"layer {idx} pre_mlp_layernorm -> linear_fc1"))
            submodules = wire_submodules(submodules, options, *handoffs, layer_number=idx + 1)
        super().__init__(config, submodules, layer_number, pg_collection=pg_collection, vp_stage=vp_stage,
                         is_mtp_layer=is_mtp_layer, add_layer_offset=add_layer_offset, **kwargs)
        if options is not None and self.layer_number != options.position.layer_idx + 1:
            raise RuntimeError(f"agoq resolved this layer's row for global layer_number "
                               f"{options.position.layer_idx + 1}, Megatron's layer has {self.layer_number}; "
                               "megatron-core's layer numbering changed (agoq.megatron.contract)")
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
