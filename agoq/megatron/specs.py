"""The one seam to Megatron's modules: agoq's ``BackendSpecProvider`` and the layer spec built from it.

``AgoqSpecProvider`` is the only place that names the module classes agoq puts into Megatron's layer (linears,
norms, core attention, the MLP builder, the layer itself); ``layer_submodules`` builds a LLaMA decoder layer's
``TransformerLayerSubmodules`` from a provider the way megatron-core's ``get_gpt_layer_local_submodules`` builds the
local one (same slots, bias-dropout-add functions, attention mask type and checkpoint key map), so the agoq layer spec
and Megatron's local spec differ only in the classes (``tests/megatron/test_specs.py`` compares them field by field).

With ``agoq_modules=False`` the provider is Megatron's ``LocalSpecProvider`` except for core attention (agoq's SDPA
when asked): the spec of ``--agoq-disable``.

Norm and QKV / fc1 stay two modules (``fuse_layernorm_and_linear()`` is False; the norm hands its recompute stash to
the linear through a ``Handoff``, agoq.megatron.layers): one module in Megatron's ``column_parallel_layer_norm_linear``
slot would move the norm weight inside the linear and change the order of the layer's parameters, hence Megatron's
gradient-buffer layout and the grad-norm summation order, which a behaviour-preserving step must keep bit for bit.

Seam card
---------
Touches: ``megatron.core.models.backends.LocalSpecProvider`` (subclass; ``BackendSpecProvider``'s methods),
  ``TransformerLayerSubmodules`` (``input_layernorm``, ``self_attention``, ``self_attn_bda``, ``pre_mlp_layernorm``,
  ``mlp``, ``mlp_bda``, ``sharded_state_dict_keys_map``), ``SelfAttention`` / ``SelfAttentionSubmodules``,
  ``MLPSubmodules``, ``MLP.as_mlp_submodule``, ``get_bias_dropout_add``, ``AttnMaskType.causal``, ``IdentityOp``.
Why: Megatron's own way to choose a layer's modules is a backend provider feeding the spec builder.
Verified on: megatron-core 0.19.2.
When disabled: ``AgoqSpecProvider(agoq_modules=False)`` names Megatron's local modules (core attention aside).
Guarded by: ``tests/megatron/test_specs.py``, ``tests/megatron/test_contract.py``.
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from agoq.config import flag_for

__all__ = ["ATTENTION_BACKENDS", "AgoqSpecProvider", "layer_spec", "layer_submodules"]

ATTENTION_BACKENDS = ("sdpa", "megatron")

# Megatron's local spec saves the norms under Transformer Engine's names (its fused norm + linear's parameters), so
# local and TE checkpoints are interchangeable; agoq's spec keeps the same map (megatron-core 0.19.2,
# get_gpt_layer_local_submodules)
NORM_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                 "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


class AgoqSpecProvider(LocalSpecProvider):
    """Megatron's ``BackendSpecProvider`` for agoq's layer: the one place naming agoq's module classes.

    ``attention``: "sdpa" (agoq's ``SDPACoreAttention``) or "megatron" (``DotProductAttention``).
    ``agoq_modules``: agoq's layer, norms, linears and MLP (activation storage, FP8, Smooth-SwiGLU); False:
    Megatron's local modules (the ``--agoq-disable`` baseline)."""

    def __init__(self, attention: str = "sdpa", agoq_modules: bool = True):
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {attention!r}: choose one of {ATTENTION_BACKENDS}")
        self.attention = attention
        self.agoq_modules = agoq_modules

    def column_parallel_linear(self) -> type:
        if not self.agoq_modules:
            return super().column_parallel_linear()
        from agoq.megatron.layers import AgoqColumnParallelLinear

        return AgoqColumnParallelLinear

    def row_parallel_linear(self) -> type:
        if not self.agoq_modules:
            return super().row_parallel_linear()
        from agoq.megatron.layers import AgoqRowParallelLinear

        return AgoqRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False  # module docstring: the norm hands its stash to the linear (agoq.megatron.layers.Handoff)

    def column_parallel_layer_norm_linear(self) -> None:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        if not self.agoq_modules:
            return super().layer_norm(rms_norm=rms_norm, for_qk=for_qk, has_residual=has_residual)
        if not rms_norm or for_qk:
            raise NotImplementedError("agoq's layer has RMSNorm pre-norms only (--normalization RMSNorm, no QK "
                                      f"norm); or use {flag_for('enabled')}")
        from agoq.megatron.layers import AgoqRMSNorm

        return AgoqRMSNorm

    def core_attention(self) -> type:
        if self.attention == "megatron":
            return DotProductAttention
        from agoq.megatron.attention import SDPACoreAttention

        return SDPACoreAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        raise NotImplementedError("agoq's layer spec is a dense LLaMA decoder: no mixture of experts")

    def mlp_builder(self):
        """The MLP entry of ``TransformerLayerSubmodules`` (a builder in megatron-core 0.19)."""
        if not self.agoq_modules:
            return MLP.as_mlp_submodule
        from agoq.megatron.mlp import AgoqMLP

        return AgoqMLP.as_mlp_submodule

    def transformer_layer(self) -> type:
        if not self.agoq_modules:
            return TransformerLayer
        from agoq.megatron.transformer_layer import AgoqTransformerLayer

        return AgoqTransformerLayer


def layer_submodules(provider: AgoqSpecProvider) -> TransformerLayerSubmodules:
    """A LLaMA decoder layer (RMSNorm pre-norms, self-attention, gated MLP) from ``provider``'s modules, with the slots
    and checkpoint key map of megatron-core's ``get_gpt_layer_local_submodules(normalization="RMSNorm")``."""
    norm = provider.layer_norm(rms_norm=True, for_qk=False, has_residual=True)
    return TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=provider.column_parallel_linear(), core_attention=provider.core_attention(),
                linear_proj=provider.row_parallel_linear(), q_layernorm=IdentityOp, k_layernorm=IdentityOp),
        ),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm,
        mlp=partial(provider.mlp_builder(), submodules=MLPSubmodules(
            linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear(),
            activation_func=provider.activation_func())),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=dict(NORM_KEYS_MAP),
    )


def layer_spec(provider: AgoqSpecProvider, params: dict | None = None) -> ModuleSpec:
    """The layer's ``ModuleSpec``: ``provider``'s layer class over :func:`layer_submodules`."""
    return ModuleSpec(module=provider.transformer_layer(), params=dict(params or {}),
                      submodules=layer_submodules(provider))
