"""agoq's layer modules: Megatron's local-spec modules whose saved activations can be low-bit.

Seam card
---------
Touches: spec substitution of ``TransformerLayer`` (``spec.module``), ``input_layernorm`` /
  ``pre_mlp_layernorm`` (``WrappedTorchNorm`` -> ``torch.nn.RMSNorm`` subclass, same parameter
  name ``weight``: checkpoints are unchanged), ``SelfAttentionSubmodules.linear_qkv/linear_proj``,
  ``MLPSubmodules.linear_fc1/linear_fc2`` and the MLP builder
  ``partial(MLP.as_mlp_submodule, submodules=...)``; the private
  ``ColumnParallelLinear/RowParallelLinear._forward_impl(input, weight, *args, **kwargs)``, which
  calls ``LinearWithGradAccumulationAndAsyncCommunication`` (its ``ctx.save_for_backward(input,
  weight)`` is what agoq intercepts); ``MLP.forward`` (re-implemented for the recompute path only).
Why: AGoQ stores the pre-norm input (norm recomputed), the fc1 output (SwiGLU recomputed) and the
  out-projection input in low-bit (algorithms.md §3.2). The spec is the first-choice seam; the
  ``_forward_impl`` override keeps Megatron's own linear autograd (TP all-reduce, sequence
  parallel, gradient-accumulation fusion, wgrad deferral) and only swaps the saved input.
Verified on: megatron-core 0.19.2.
When disabled: a module whose ``agoq_fmt`` is None (every bf16 role) calls Megatron's code
  unchanged, so the bf16 policy is bit-identical to the plain local spec.
Guarded by: ``tests/megatron/test_activations.py`` (bit-identity, gradient SQNR, bytes) and
  ``tests/megatron/test_contract.py`` (the CONTRACT rows of these symbols).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from agoq.ops.saved_act import quantized_saves, rmsnorm_saving_input, swiglu_saving_input


class _AgoqStorageAttrs:
    """Storage settings written by ``ActivationStorage.assign`` after the layer is built."""

    agoq_fmt = None  # QuantFormat to store this module's saved tensor in, or None: Megatron's save
    agoq_key = (None, "")  # (global layer index, role) for the byte counter
    agoq_counter = None  # SavedBytesCounter shared by the model, or None


class AgoqRMSNorm(_AgoqStorageAttrs, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (what ``WrappedTorchNorm`` builds for RMSNorm) that can store only its
    quantized input and hand a recompute stash to the linear it feeds (``agoq_consumer``)."""

    agoq_consumer = None

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        problems = [name for name in ("layernorm_zero_centered_gamma", "persist_layer_norm", "sequence_parallel",
                                      "memory_efficient_layer_norm") if getattr(config, name)]
        if config.normalization != "RMSNorm" or problems:
            raise NotImplementedError(
                f"agoq's local-spec norm supports normalization='RMSNorm' without {problems or 'extras'} "
                f"(got normalization={config.normalization!r}); use --agoq-disable or the bf16 policy"
            )
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x_SBH: torch.Tensor) -> torch.Tensor:
        if self.agoq_fmt is None:
            return super().forward(x_SBH)
        y_SBH, stash = rmsnorm_saving_input(x_SBH, self.weight, self.eps, self.agoq_fmt, self.agoq_key,
                                            self.agoq_counter)
        self.agoq_consumer.agoq_pending = stash
        return y_SBH


class _AgoqLinearMixin(_AgoqStorageAttrs):
    """``_forward_impl`` that stores the input quantized (``agoq_fmt``) or not at all
    (``agoq_recomputed``: the producing norm / SwiGLU left a stash in ``agoq_pending``)."""

    agoq_recomputed = False
    agoq_pending = None

    def _forward_impl(self, input, weight, *args, **kwargs):
        stash, self.agoq_pending = self.agoq_pending, None
        saves_input = torch.is_grad_enabled() and weight.requires_grad and input.requires_grad
        if not saves_input:  # no graph, or frozen weight: Megatron saves no input for wgrad
            return super()._forward_impl(input, weight, *args, **kwargs)
        if self.agoq_recomputed:
            if stash is None:
                raise RuntimeError(
                    f"agoq: {self.agoq_key} expects its input from the recomputable op before it, which "
                    "left no stash; the layer's forward order changed (report it) or use a bf16 policy"
                )
            with quantized_saves(input, stash=stash, key=self.agoq_key):
                return super()._forward_impl(input, weight, *args, **kwargs)
        if self.agoq_fmt is not None:
            with quantized_saves(input, fmt=self.agoq_fmt, key=self.agoq_key, counter=self.agoq_counter):
                return super()._forward_impl(input, weight, *args, **kwargs)
        return super()._forward_impl(input, weight, *args, **kwargs)


class AgoqColumnParallelLinear(_AgoqLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear (linear_qkv, linear_fc1) with agoq's saved-input storage."""


class AgoqRowParallelLinear(_AgoqLinearMixin, RowParallelLinear):
    """RowParallelLinear (linear_proj, linear_fc2) with agoq's saved-input storage."""


class AgoqMLP(_AgoqStorageAttrs, MLP):
    """MLP whose SwiGLU can store only its quantized input (the fc1 output) and recompute.

    With ``agoq_fmt`` None this is Megatron's MLP. Otherwise forward = fc1 -> SwiGLU (Megatron's
    unfused ``glu`` values: ``silu(gate) * (up + glu_linear_offset)``) -> fc2, where fc2 stores
    nothing: its input is rebuilt from the same quantized fc1 output in backward.
    """

    def check_recompute_supported(self) -> None:
        cfg = self.config
        problems = []
        if not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
            problems.append("SwiGLU (gated_linear_unit=True, activation_func=F.silu)")
        if cfg.use_te_activation_func:
            problems.append("use_te_activation_func=False")
        if getattr(cfg, "activation_func_clamp_value", None) is not None:
            problems.append("activation_func_clamp_value=None")
        if problems:
            raise NotImplementedError(
                f"agoq's SwiGLU recompute needs {', '.join(problems)}; set mlp.swiglu_input to bf16 in the policy"
            )

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if self.agoq_fmt is None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None:
            raise NotImplementedError("agoq's SwiGLU recompute does not support per_token_scale (MoE experts)")
        h_SBF2, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            h_SBF2 = h_SBF2 + bias
        z_SBF, stash = swiglu_saving_input(h_SBF2, self.agoq_fmt, self.agoq_key, self.agoq_counter,
                                           offset=self.config.glu_linear_offset)
        self.linear_fc2.agoq_pending = stash
        return self.linear_fc2(z_SBF)


class AgoqTransformerLayer(TransformerLayer):
    """TransformerLayer that applies the activation policy to its modules once they are built.

    ``agoq_storage`` (an ``agoq.megatron.activations.ActivationStorage``) arrives through the
    spec's ``params``; None builds a plain layer.
    """

    def __init__(self, *args, agoq_storage=None, vp_stage: int | None = None, **kwargs):
        super().__init__(*args, vp_stage=vp_stage, **kwargs)
        self.agoq_vp_stage = vp_stage
        if agoq_storage is not None:
            agoq_storage.assign(self)
