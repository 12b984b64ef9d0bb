"""agoq's layer modules: Megatron's local-spec modules whose saved activations can be low-bit, whose
linears can run in FP8 and whose MLP can be Smooth-SwiGLU.

Seam card
---------
Touches: spec substitution of ``TransformerLayer`` (``spec.module``), ``input_layernorm`` /
  ``pre_mlp_layernorm`` (``WrappedTorchNorm`` -> ``torch.nn.RMSNorm`` subclass, same parameter
  name ``weight``: checkpoints are unchanged), ``SelfAttentionSubmodules.linear_qkv/linear_proj``,
  ``MLPSubmodules.linear_fc1/linear_fc2`` and the MLP builder
  ``partial(MLP.as_mlp_submodule, submodules=...)``; the private
  ``ColumnParallelLinear/RowParallelLinear._forward_impl(input, weight, *args, **kwargs)``, which
  calls ``LinearWithGradAccumulationAndAsyncCommunication`` (its ``ctx.save_for_backward(input,
  weight)`` is what agoq intercepts: hooks on saved tensor 0 of the node it returns, checked per call by
  node name and input identity, or a ``saved_tensors_hooks`` scope when another scope is already
  active; its keyword arguments are the parameters of
  ``linear_with_grad_accumulation_and_async_allreduce``, which the FP8 path reads);
  ``copy_to_tensor_model_parallel_region`` (the FP8 path's dgrad all-reduce); ``MLP.forward``
  (re-implemented for the recompute and Smooth-SwiGLU paths only); ``MLP.tp_group``.
Why: AGoQ stores the pre-norm input (norm recomputed), the fc1 output (SwiGLU recomputed) and the
  out-projection input in low-bit (../shared/spec/algorithms.md §3.2). The spec is the first-choice seam; the
  ``_forward_impl`` override keeps Megatron's own linear autograd (TP all-reduce, sequence
  parallel, gradient-accumulation fusion, wgrad deferral) and only swaps the saved input.
Verified on: megatron-core 0.19.2.
  FP8 linears and Smooth-SwiGLU (FP8 paper, ../shared/spec/algorithms.md §2) need the same two seams: the GEMM
  inside ``_forward_impl`` and the activation inside ``MLP.forward``.
When disabled: a module whose ``agoq_fmt``, ``agoq_fp8`` and ``agoq_smooth`` are None (every bf16
  role, FP8 off) calls Megatron's code unchanged, so the bf16 policy is bit-identical to the plain
  local spec.
Guarded by: ``tests/megatron/test_activations.py`` (bit-identity, gradient SQNR, bytes),
  ``tests/megatron/test_fp8_smooth.py`` (Smooth-SwiGLU vs plain, TP=2, FP8 errors on CPU),
  ``tests/gpu/test_fp8_megatron_gpu.py`` and ``tests/megatron/test_contract.py`` (the CONTRACT rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from agoq.ops.fp8_linear import fp8_linear
from agoq.ops.fp8_scaling import FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache
from agoq.ops.saved_act import (
    SavePaths,
    default_saved_hooks_active,
    quantized_saves,
    replace_saved_input,
    saved_input_handle,
    smooth_swiglu_saving_input,
    swiglu_reference,
    swiglu_saving_input,
)
from agoq.ops.saved_norm import rmsnorm_saving_input
from agoq.ops.smooth_swiglu import fold_channel_scale, glu_smooth_scale, unsmooth_fc2_output

# The linears replace Megatron's saved input through that saved tensor's own hooks or a hook scope around
# the call (SavePaths.linear_via_node_hooks=False: scripts/bench_memory.py's A/B; also what runs inside
# another scope).
# the autograd node of LinearWithGradAccumulationAndAsyncCommunication (it saves (input, weight))
_MEGATRON_LINEAR_NODE = "LinearWithGradAccumulationAndAsyncCommunicationBackward"


class _AgoqStorageAttrs:
    """Storage settings written by ``ActivationStorage.assign`` after the layer is built."""

    agoq_fmt = None  # QuantFormat to store this module's saved tensor in, or None: Megatron's save
    agoq_key = (None, "")  # (global layer index, role) for the byte counter
    agoq_counter = None  # SavedBytesCounter shared by the model, or None
    agoq_paths = SavePaths()  # host paths of the saved-activation code (same bytes and gradients)


class AgoqRMSNorm(_AgoqStorageAttrs, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (what ``WrappedTorchNorm`` builds for RMSNorm) that can store only its
    quantized input and hand a recompute stash to the linear it feeds (``agoq_consumer``)."""

    agoq_consumer = None
    agoq_node_checked = False  # the CUDA norm node's saved input was checked to be x (first call)

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
                                            self.agoq_counter, check_identity=not self.agoq_node_checked,
                                            via_aten_node=self.agoq_paths.norm_via_aten_node)
        self.agoq_node_checked = self.agoq_node_checked or stash is not None
        self.agoq_consumer.agoq_pending = stash
        return y_SBH


class _AgoqLinearMixin(_AgoqStorageAttrs):
    """``_forward_impl`` that stores the input quantized (``agoq_fmt``) or not at all
    (``agoq_recomputed``: the producing norm / SwiGLU left a stash in ``agoq_pending``), and that runs
    the GEMMs in FP8 when ``agoq_fp8`` (an ``FP8Recipe``) is set. ``agoq_col_scale`` (set by the MLP
    just before fc2's call, per-channel Smooth-SwiGLU) makes the GEMM use W * s."""

    agoq_recomputed = False
    agoq_pending = None
    agoq_fp8 = None  # FP8Recipe for this linear, or None: Megatron's bf16 GEMMs
    agoq_col_scale = None
    agoq_save_checked = False  # replace_saved_input verified which saved tensor is the input (first call)

    def _forward_impl(self, input, weight, *args, **kwargs):
        stash, self.agoq_pending = self.agoq_pending, None
        col_scale, self.agoq_col_scale = self.agoq_col_scale, None
        if self.agoq_fp8 is not None:
            return self._fp8_forward_impl(input, weight, stash, col_scale, args, kwargs)
        if col_scale is not None:
            weight = fold_channel_scale(weight, col_scale)  # W * s, differentiable in W
        saves_input = torch.is_grad_enabled() and weight.requires_grad and input.requires_grad
        if not saves_input:  # no graph, or frozen weight: Megatron saves no input for wgrad
            return super()._forward_impl(input, weight, *args, **kwargs)
        if self.agoq_recomputed:
            kw = {"stash": self._require_stash(stash), "key": self.agoq_key}
        elif self.agoq_fmt is not None:
            kw = {"fmt": self.agoq_fmt, "key": self.agoq_key, "counter": self.agoq_counter}
        else:
            return super()._forward_impl(input, weight, *args, **kwargs)
        # agoq's scope must be innermost
        if not self.agoq_paths.linear_via_node_hooks or default_saved_hooks_active():
            with quantized_saves(input, **kw):
                return super()._forward_impl(input, weight, *args, **kwargs)
        out = super()._forward_impl(input, weight, *args, **kwargs)
        # Megatron's ctx.save_for_backward(input, weight): replace saved tensor 0 (cheaper on the host than
        # a hook scope, which also sends the weight through Python in forward and backward)
        # (identity of the saved input checked on this module's first call; node and count on every call)
        replace_saved_input(out, input, node_name=_MEGATRON_LINEAR_NODE, index=0,
                            check_identity=not self.agoq_save_checked, **kw)
        self.agoq_save_checked = True
        return out

    def _require_stash(self, stash):
        if stash is None:
            raise RuntimeError(
                f"agoq: {self.agoq_key} expects its input from the recomputable op before it, which "
                "left no stash; the layer's forward order changed (report it) or use a bf16 policy"
            )
        return stash

    def _fp8_forward_impl(self, input, weight, stash, col_scale, args, kw):
        """Megatron's local linear (``linear_with_grad_accumulation_and_async_allreduce``) with FP8
        GEMMs: the column-parallel dgrad all-reduce becomes ``copy_to_tensor_model_parallel_region``
        (synchronous, not overlapped with wgrad); the rest of its options raise."""
        unsupported = [name for name in ("gradient_accumulation_fusion", "sequence_parallel") if kw.get(name)]
        if kw.get("grad_output_buffer") is not None:
            unsupported.append("defer_embedding_wgrad_compute")
        if (kw.get("gtp_remat_size") or 1) > 1:
            unsupported.append("gtp_weight_remat_size > 1")
        if args or unsupported:
            raise NotImplementedError(
                f"agoq's FP8 linear does not support {unsupported or 'positional arguments'} (layer/role "
                f"{self.agoq_key}); turn them off or run this layer in bf16 (--agoq-fp8 off)")
        if kw.get("allreduce_dgrad"):
            input = copy_to_tensor_model_parallel_region(input, group=kw.get("tp_group"))
        saver = None
        if torch.is_grad_enabled() and weight.requires_grad:
            if self.agoq_recomputed:
                stash = self._require_stash(stash)
                saver = lambda x2: saved_input_handle(input, stash=stash, key=self.agoq_key)  # noqa: E731
            elif self.agoq_fmt is not None:
                saver = lambda x2: saved_input_handle(x2, fmt=self.agoq_fmt, key=self.agoq_key,  # noqa: E731
                                                      counter=self.agoq_counter)
        return fp8_linear(input, weight, self._fp8_state(weight.device), self.agoq_fp8, bias=kw.get("bias"),
                          w_col_scale=col_scale, x_saver=saver, weight_cache=self._fp8_weight_cache())

    def _fp8_weight_cache(self):
        """The FP8 copies of this linear's weight, reused by every micro-batch until the weight changes
        (agoq.ops.fp8_weight_cache; a plain attribute, outside the state dict)."""
        cache = self.__dict__.get("_agoq_fp8_wcache")
        if cache is None:
            cache = self.__dict__["_agoq_fp8_wcache"] = FP8WeightCache()
        return cache

    def _fp8_state(self, device):
        """Delayed scaling's amax history, one per linear, created on first use on the weight's device.

        A plain attribute, not a submodule: it stays out of the state dict (Megatron's sharded
        checkpoint would treat its per-TP-rank buffers as replicated); a resumed run bootstraps it."""
        if self.agoq_fp8.scaling != "delayed":
            return None
        state = self.__dict__.get("_agoq_fp8_state")
        if state is None or (state.recipe is not self.agoq_fp8 and state.recipe != self.agoq_fp8):
            state = FP8ScalingState(self.agoq_fp8, device=device)
            self.__dict__["_agoq_fp8_state"] = state
        return state


class AgoqColumnParallelLinear(_AgoqLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear (linear_qkv, linear_fc1) with agoq's saved-input storage."""


class AgoqRowParallelLinear(_AgoqLinearMixin, RowParallelLinear):
    """RowParallelLinear (linear_proj, linear_fc2) with agoq's saved-input storage."""


class AgoqMLP(_AgoqStorageAttrs, MLP):
    """MLP whose SwiGLU can store only its quantized input (the fc1 output) and recompute, and can be
    Smooth-SwiGLU (``agoq_smooth``: "per_token" or "per_channel", the FP8 paper's rescale).

    With ``agoq_fmt`` and ``agoq_smooth`` None this is Megatron's MLP. Otherwise forward = fc1 ->
    SwiGLU (Megatron's unfused ``glu`` values: ``silu(gate) * (up + glu_linear_offset)``) -> fc2. With
    storage, fc2 stores nothing: its input is rebuilt from the same quantized fc1 output in backward.
    Smooth-SwiGLU divides the SwiGLU output by a power-of-two s (exact) and undoes it around fc2: per
    token, fc2's output (after the TP all-reduce; s is all-reduced MAX over TP first) is multiplied
    by s; per channel, fc2 uses W * s (s folded into its input columns; each channel lives on one TP
    rank). In bf16 the smoothed MLP therefore equals the plain one bit for bit, barring underflow.
    """

    agoq_smooth = None

    def check_recompute_supported(self) -> None:
        problems = self._swiglu_problems()
        if problems:
            raise NotImplementedError(
                f"agoq's SwiGLU recompute needs {', '.join(problems)}; set mlp.swiglu_input to bf16 in the policy"
            )

    def check_smooth_supported(self) -> None:
        problems = self._swiglu_problems()
        if self.config.glu_linear_offset:
            problems.append("glu_linear_offset=0")
        if self.config.sequence_parallel:
            problems.append("sequence_parallel=False (the per-token scale would need slicing)")
        if problems:
            raise NotImplementedError(f"Smooth-SwiGLU needs {', '.join(problems)}; use --agoq-smooth-swiglu off")

    def _swiglu_problems(self) -> list[str]:
        cfg = self.config
        problems = []
        if not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
            problems.append("SwiGLU (gated_linear_unit=True, activation_func=F.silu)")
        if cfg.use_te_activation_func:
            problems.append("use_te_activation_func=False")
        if getattr(cfg, "activation_func_clamp_value", None) is not None:
            problems.append("activation_func_clamp_value=None")
        return problems

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if self.agoq_fmt is None and self.agoq_smooth is None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None:
            raise NotImplementedError("agoq's MLP (SwiGLU recompute / Smooth-SwiGLU) does not support "
                                      "per_token_scale (MoE experts)")
        h_SBF2, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            h_SBF2 = h_SBF2 + bias
        if self.agoq_smooth is None:
            z_SBF, stash = swiglu_saving_input(h_SBF2, self.agoq_fmt, self.agoq_key, self.agoq_counter,
                                               offset=self.config.glu_linear_offset,
                                               fuse=self.agoq_paths.fuse_swiglu)
            self.linear_fc2.agoq_pending = stash
            return self.linear_fc2(z_SBF)
        return self._smooth_forward(h_SBF2)

    def _smooth_forward(self, h_SBF2):
        mode = self.agoq_smooth
        tp_group = self.tp_group if mode == "per_token" else None

        def scale_fn(h, glu):
            return glu_smooth_scale(h, glu, mode, tp_group=tp_group)

        if self.agoq_fmt is None:
            glu_SBF = swiglu_reference(h_SBF2)
            s = scale_fn(h_SBF2, glu_SBF)
            z_SBF = glu_SBF / s.to(glu_SBF.dtype)  # a power of two: exact
        else:
            z_SBF, s, stash = smooth_swiglu_saving_input(h_SBF2, scale_fn, self.agoq_fmt, self.agoq_key,
                                                         self.agoq_counter, fuse=self.agoq_paths.fuse_swiglu)
            self.linear_fc2.agoq_pending = stash
        if mode == "per_channel":
            self.linear_fc2.agoq_col_scale = s
            return self.linear_fc2(z_SBF)
        out_SBH, out_bias = self.linear_fc2(z_SBF)
        return unsmooth_fc2_output(out_SBH, s), out_bias


class AgoqTransformerLayer(TransformerLayer):
    """TransformerLayer that applies the activation policy and the FP8 settings to its modules once
    they are built.

    ``agoq_storage`` (an ``agoq.megatron.activations.ActivationStorage``) and ``agoq_compute`` (an
    ``agoq.megatron.compute.LayerCompute``) arrive through the spec's ``params``; None leaves
    Megatron's behaviour.
    """

    def __init__(self, *args, agoq_storage=None, agoq_compute=None, vp_stage: int | None = None, **kwargs):
        super().__init__(*args, vp_stage=vp_stage, **kwargs)
        self.agoq_vp_stage = vp_stage
        if agoq_storage is not None:
            agoq_storage.assign(self)
        if agoq_compute is not None:
            agoq_compute.assign(self)
