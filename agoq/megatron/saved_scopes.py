"""The activation policy on modules agoq did not build: Transformer Engine's, or Megatron's own local spec.

agoq's layer spec stores saved activations low-bit from inside its own linears, norms and SwiGLU. With
``--transformer-impl transformer_engine`` the layers are Transformer Engine's (fused LayerNorm-Linear, FP8 GEMMs,
fused attention), and TE keeps the activations its backward needs in 16 bits unless they are an FP8 GEMM input.
This module stores those 16-bit copies in the policy's formats without changing TE's modules: one
``torch.autograd.graph.saved_tensors_hooks`` scope around each module of a role, entered by a forward pre-hook and
left by a forward hook (``always_call``, so an exception leaves no scope open). Inside a scope, each saved tensor
that is an activation (floating point, contiguous, >= 2 dims, ``MIN_NUMEL`` elements, not a parameter or a view of
one) is quantized on save and dequantized on use (agoq.ops.saved_act); FP8 data (uint8) and everything else pass
through. The forward computes with the full-precision tensors: only the copies held for backward change.

Roles, by the module's place in Megatron's ``TransformerLayer`` (submodule names are Megatron's, for both specs):

=============================== =============================================================================
module                          roles of the tensors saved inside it
=============================== =============================================================================
``input_layernorm``,            ``norm.input`` (Megatron's local spec: a separate norm)
``pre_mlp_layernorm``
``self_attention.linear_qkv``   ``attn.qkv_input``; with a fused norm (TE's LayerNormLinear) also its input,
                                ``norm.input``: one scope, so the policy must give both one format
``self_attention.linear_proj``  ``attn.proj_input``
``mlp``                         ``mlp.swiglu_input`` (what the MLP saves outside its linears: the activation's input)
``mlp.linear_fc1``              ``mlp.fc1_input`` (+ ``norm.input`` when the norm is fused, as for QKV)
``mlp.linear_fc2``              ``mlp.fc2_input``
=============================== =============================================================================

Scopes nest: the innermost module's scope applies (``mlp.linear_fc1`` inside ``mlp``). Core attention keeps its
q / k / v / output as the attention implementation saves them: a policy that quantizes ``attn.q``, ``attn.k``,
``attn.v`` or ``attn.out`` is refused here (agoq's own spec stores them; TE's fused attention owns its layout).
A role whose format is bf16 gets no scope (the tensors are saved as they are: bit-identical training).

Seam card
---------
Touches: ``TransformerLayer.layer_number`` / ``self_attention`` / ``mlp`` and their submodule names
  (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, ``input_layernorm``, ``pre_mlp_layernorm``),
  ``nn.Module.register_forward_pre_hook`` / ``register_forward_hook(always_call=True)``.
Why: the TE spec's modules are TE's; a saved-tensor scope changes what they keep, not what they compute.
Verified on: megatron-core 0.19.2 local spec (CPU, tests/megatron/test_saved_scopes.py) and TE 2.20.2 spec (H100,
  tests/gpu/test_te_agoq_gpu.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from agoq.formats import QuantFormat
from agoq.megatron.sites import LayerPosition
from agoq.ops.saved_act import QuantizedSave, SavedBytesCounter, quantize_saved, unpack_saved
from agoq.policy import PolicySpec, ScheduleInfo, resolve

MIN_NUMEL = 1 << 16
"""Smallest tensor a scope quantizes: activations of a real layer are millions of elements; the norm statistics
(one value per token) and small buffers stay as they are."""

# submodule path in a TransformerLayer -> roles of what it saves (the second role only when the norm is fused in)
_SCOPES: tuple[tuple[str, str], ...] = (
    ("input_layernorm", "norm.input"),
    ("pre_mlp_layernorm", "norm.input"),
    ("self_attention.linear_qkv", "attn.qkv_input"),
    ("self_attention.linear_proj", "attn.proj_input"),
    ("mlp", "mlp.swiglu_input"),
    ("mlp.linear_fc1", "mlp.fc1_input"),
    ("mlp.linear_fc2", "mlp.fc2_input"),
)
_FUSED_NORM = {"self_attention.linear_qkv", "mlp.linear_fc1"}
_ATTENTION_ROLES = ("attn.q", "attn.k", "attn.v", "attn.out")


@dataclass
class ScopeStats:
    """What the scopes of one model did: exact bytes stored per (layer, role) (``counter``) and the bytes of
    tensors saved inside a scope that stayed as they were, by reason (FP8 data, small, parameter, ...)."""

    counter: SavedBytesCounter
    kept_bytes: dict[str, int]
    scopes: int = 0


class _Scope:
    """The saved-tensor hooks of one module: quantize activations to ``fmt``."""

    __slots__ = ("fmt", "key", "stats", "min_numel", "_hooks")

    def __init__(self, fmt: QuantFormat, key: tuple[int, str], stats: ScopeStats, min_numel: int):
        self.fmt, self.key, self.stats, self.min_numel, self._hooks = fmt, key, stats, min_numel, []

    def pack(self, t: torch.Tensor):
        reason = _keep_reason(t, self.min_numel)
        if reason is not None:
            kept = self.stats.kept_bytes
            kept[reason] = kept.get(reason, 0) + t.numel() * t.element_size()
            return t
        return QuantizedSave(quantize_saved(t, self.fmt, self.key, self.stats.counter))

    def enter(self, _module, _args) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack_saved)
        hooks.__enter__()
        self._hooks.append(hooks)

    def leave(self, _module, _args, _output) -> None:
        if self._hooks:
            self._hooks.pop().__exit__(None, None, None)


def _keep_reason(t: torch.Tensor, min_numel: int) -> str | None:
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return "parameter"
    if type(t) is not torch.Tensor:
        return "tensor subclass (TE's quantized tensors)"
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return "not floating point (FP8 data, indices)"
    if t.dim() < 2 or t.numel() < min_numel:
        return "small (statistics, buffers)"
    if not t.is_contiguous():
        return "not contiguous"
    return None


def _submodule(layer: torch.nn.Module, path: str) -> torch.nn.Module | None:
    module = layer
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, torch.nn.Module):
            return None
    return module


def _has_fused_norm(module: torch.nn.Module) -> bool:
    """A LayerNorm-Linear (TE's ``TELayerNormColumnParallelLinear``) carries the norm's weight."""
    return isinstance(getattr(module, "layer_norm_weight", None), torch.Tensor)


def check_policy_for_scopes(spec: PolicySpec, positions: Iterable[LayerPosition], schedule: ScheduleInfo,
                            fused_norm: bool) -> None:
    """Refuse what the scopes cannot store as the policy says: quantized attention tensors, and (fused norm) a norm
    input and its output given different formats. Names the policy file, the layer and the roles."""
    for pos in positions:
        for role in _ATTENTION_ROLES:
            fmt = resolve(spec, pos.site(role), schedule)
            if fmt.quantized:
                raise ValueError(
                    f"{spec.source}: layer {pos.layer_idx} role {role} resolves to {fmt.name}, but with Transformer "
                    f"Engine's attention agoq keeps q / k / v / output as TE saves them; set {role} to bf16 (a rule "
                    "`when: {role: [attn.q, attn.k, attn.v, attn.out]}` -> `set: {activations: bf16}`), or use "
                    "--transformer-impl local")
        if fused_norm:
            for role in ("attn.qkv_input", "mlp.fc1_input"):
                a, b = resolve(spec, pos.site("norm.input"), schedule), resolve(spec, pos.site(role), schedule)
                if a.name != b.name:
                    raise ValueError(
                        f"{spec.source}: layer {pos.layer_idx}: norm.input resolves to {a.name} and {role} to "
                        f"{b.name}, but Transformer Engine's fused LayerNorm-Linear saves both inside one module; "
                        "give them one format, or use --transformer-impl local")


def layer_positions(model_chunks) -> list[tuple[torch.nn.Module, LayerPosition]]:
    """Every Megatron ``TransformerLayer`` of the model chunks with its place in the pipeline."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out = []
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                vp_size = module.config.virtual_pipeline_model_parallel_size
                vp_stage = getattr(module, "vp_stage", None) if vp_size is not None else None
                out.append((module, LayerPosition(layer_idx=module.layer_number - 1, pp_rank=pp_rank,
                                                  pp_size=pp_size, vp_stage=vp_stage, vp_size=vp_size)))
    return out


def apply_saved_scopes(model_chunks, spec: PolicySpec, schedule: ScheduleInfo, *,
                       min_numel: int = MIN_NUMEL) -> tuple[ScopeStats, list]:
    """Add the policy's saved-tensor scopes to every transformer layer of ``model_chunks``; returns the stats and
    the hook handles (``handle.remove()`` on each undoes it). Raises where the policy cannot be stored as given.
    ``min_numel``: the smallest tensor quantized (tests of tiny models lower it)."""
    layers = layer_positions(model_chunks)
    if not layers:
        raise ValueError("agoq saved-activation scopes: the model has no Megatron TransformerLayer")
    fused = any(_has_fused_norm(m) for layer, _ in layers for m in (_submodule(layer, p) for p in _FUSED_NORM) if m)
    check_policy_for_scopes(spec, [pos for _, pos in layers], schedule, fused)
    stats, handles = ScopeStats(counter=SavedBytesCounter(), kept_bytes={}), []
    for layer, pos in layers:
        for path, fmt in wanted_scopes(layer, pos, spec, schedule).items():
            module = _submodule(layer, path)
            scope = _Scope(fmt, (pos.layer_idx, dict(_SCOPES)[path]), stats, min_numel)
            handles.append(module.register_forward_pre_hook(scope.enter))
            handles.append(module.register_forward_hook(scope.leave, always_call=True))
            module._agoq_saved_scope = scope  # what agoq.megatron.built_check reads
            stats.scopes += 1
    return stats, handles


def wanted_scopes(layer: torch.nn.Module, pos: LayerPosition, spec: PolicySpec,
                  schedule: ScheduleInfo) -> dict[str, QuantFormat]:
    """Submodule path -> the format its scope stores, for every module of ``layer`` whose role the policy quantizes
    at the layer's site (bf16 roles get no scope)."""
    out = {}
    for path, role in _SCOPES:
        if _submodule(layer, path) is None:
            continue
        fmt = resolve(spec, pos.site(role), schedule)
        if fmt.quantized:
            out[path] = fmt
    return out


def scope_problems(layer: torch.nn.Module, pos: LayerPosition, spec: PolicySpec, schedule: ScheduleInfo) -> list[str]:
    """What differs between the scopes ``layer``'s modules carry and the policy's at the layer's site."""
    problems = []
    for path, fmt in wanted_scopes(layer, pos, spec, schedule).items():
        scope = getattr(_submodule(layer, path), "_agoq_saved_scope", None)
        if scope is None or scope.fmt != fmt:
            built = "no scope" if scope is None else scope.fmt.name
            problems.append(f"{path} ({dict(_SCOPES)[path]}: built {built}; policy {fmt.name})")
    return problems
