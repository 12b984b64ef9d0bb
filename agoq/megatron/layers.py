"""agoq's layer modules: Megatron's local-spec modules whose saved activations can be low-bit, whose
linears can run in FP8 and whose MLP can be Smooth-SwiGLU (the MLP itself, ``AgoqMLP``, is in
``agoq.megatron.mlp``; the seam card below covers both files).

Seam card
---------
Touches: spec substitution (the layer itself: ``agoq.megatron.transformer_layer``) of ``input_layernorm`` /
  ``pre_mlp_layernorm`` (``WrappedTorchNorm`` -> ``torch.nn.RMSNorm`` subclass, same parameter
  name ``weight``: checkpoints are unchanged), ``SelfAttentionSubmodules.linear_qkv/linear_proj``,
  ``MLPSubmodules.linear_fc1/linear_fc2`` and the MLP builder
  ``partial(MLP.as_mlp_submodule, submodules=...)`` (``AgoqMLP.as_mlp_submodule`` is Megatron's body plus
  agoq's keywords); the private
  ``ColumnParallelLinear/RowParallelLinear._forward_impl(input, weight, *args, **kwargs)``, which
  calls ``LinearWithGradAccumulationAndAsyncCommunication`` (its ``ctx.save_for_backward(input,
  weight)`` is what agoq intercepts: a ``saved_tensors_hooks`` scope around the call that matches the input
  by identity (public); its keyword arguments are the parameters of
  ``linear_with_grad_accumulation_and_async_allreduce``, which the FP8 path reads);
  ``copy_to_tensor_model_parallel_region`` (the FP8 path's dgrad all-reduce); for QKV / fc1 fed by a recomputed
  pre-norm, ``_forward_impl`` does not call Megatron's linear at all: the norm + linear node (agoq.ops.norm_linear)
  takes its keyword arguments (``bias``, ``allreduce_dgrad`` over ``tp_group``, ``sequence_parallel``: the gather of
  the sequence-sharded input and the reduce-scatter of its gradient over ``tp_group`` inside the node), and the linear
  reads ``TransformerConfig.gradient_accumulation_fusion`` / ``sequence_parallel`` (FP8 refused under it) /
  ``defer_embedding_wgrad_compute`` and
  its own ``gtp_remat_size`` / ``explicit_expert_comm`` / ``disable_grad_reduce`` at construction to decide whether
  it takes the node (``_takes_norm_feed``; otherwise the norm's stash and Megatron's linear, as before); likewise fc2
  fed by a recomputed SwiGLU runs as one node with it (agoq.ops.swiglu_linear, ``_takes_swiglu_feed``) and a linear
  storing its own input quantized as one node of its own (agoq.ops.quant_linear, ``_quantized_input_node``), both
  with Megatron's linear backward math (agoq.ops.linear_math), outside other saved-tensor hook scopes only;
  ``RowParallelLinear.forward``
  (fused (Smooth-)SwiGLU with an FP8 fc2 calls fc2 with the fc1 output, which it hands to ``_forward_impl``
  unchecked; fc2 then runs agoq.ops.smooth_swiglu_fp8 and Megatron's all-reduce and bias follow); ``MLP.forward``
  (re-implemented for the recompute, Smooth-SwiGLU and fused plain-FP8 paths only; the last computes Megatron's
  unfused ``glu`` values, so it applies only where Megatron's MLP runs that branch: no
  ``bias_activation_fusion``); ``MLP.tp_group``;
  ``ModuleSpec(module, params)`` / ``build_module`` (constructor arguments: ``with_params``).
Why: AGoQ stores the pre-norm input (norm recomputed), the fc1 output (SwiGLU recomputed) and the
  out-projection input in low-bit (arXiv 2605.00539). The spec is the first-choice seam; the
  ``_forward_impl`` override keeps Megatron's own linear autograd (TP all-reduce, sequence
  parallel, gradient-accumulation fusion, wgrad deferral) and only swaps the saved input, except where agoq's
  one-node linears reproduce its math for the common case (bf16 GEMMs, sequence parallelism or not, no accumulation
  fusion or wgrad deferral) to save host time per layer (docs/benchmarks/log.md "Host cost"). Under sequence
  parallelism ``AgoqRMSNorm`` marks its weight ``sequence_parallel`` (finalize_model_grads all-reduces its gradient
  over TP, as for Megatron's own norms) and the final norm is agoq's too (agoq.megatron.seqpar).
Verified on: megatron-core 0.19.2.
  FP8 linears and Smooth-SwiGLU (FP8 paper, arXiv 2409.12517) need the same two seams: the GEMM
  inside ``_forward_impl`` and the activation inside ``MLP.forward``.
Wiring: every option reaches a module through its constructor (``agoq_save``: a
  :class:`SavedInputConfig`; ``agoq_fp8``; ``agoq_smooth``; ``agoq_handoff``), as ``ModuleSpec.params``
  that ``agoq.megatron.transformer_layer.AgoqTransformerLayer`` builds from its own resolved row (its layer spec's
  ``agoq_layer``, agoq.megatron.layer_plan) before Megatron builds its submodules. The recompute
  hand-offs (pre-norm -> QKV / fc1, SwiGLU -> fc2) are :class:`Handoff` slots owned by the layer (norms -> QKV /
  fc1) and by the MLP (SwiGLU -> fc2), given to producer and consumer at construction; nothing is written onto
  a built module or a sibling.
When disabled: a module built with the default ``SavedInputConfig()`` (every bf16 role), no FP8 recipe
  and no Smooth-SwiGLU mode calls Megatron's code unchanged, so the bf16 policy is bit-identical to the
  plain local spec.
Guarded by: ``tests/megatron/test_activations.py`` (bit-identity, gradient SQNR, bytes, constructor
  wiring and hand-off errors, the norm + linear node against the two-node path), ``tests/megatron/test_layouts.py``
  (the node at TP=2), ``tests/gpu/test_norm_linear_gpu.py``,
  ``tests/megatron/test_fp8_smooth.py`` (Smooth-SwiGLU vs plain, TP=2, FP8 errors on CPU),
  ``tests/megatron/test_smooth_fp8_fused.py`` (the fused (Smooth-)SwiGLU FP8 paths vs the unfused ones),
  ``tests/gpu/test_fp8_megatron_gpu.py`` and ``tests/megatron/test_contract.py`` (the CONTRACT rows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec

from agoq.config import flag_for
from agoq.formats import QuantFormat
from agoq.ops import saved_norm, saved_swiglu  # noqa: F401 - their compile boundaries exist before prepare_all
from agoq.ops.fp8_linear import fp8_linear
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache
from agoq.ops.norm_linear import NormFeed, rmsnorm_linear, rmsnorm_no_graph
from agoq.ops.quant_linear import quantized_input_linear
from agoq.ops.saved_act import (
    Key,
    RecomputeStash,
    SavedBytesCounter,
    SavePaths,
    default_saved_hooks_active,
    eager_under_compile,
    quantized_saves,
    saved_input_handle,
)
from agoq.ops.saved_norm import rmsnorm_saving_input
from agoq.ops.smooth_swiglu import fold_channel_scale
from agoq.ops.smooth_swiglu_fp8 import (
    smooth_swiglu_fp8_fc2,
    swiglu_fp8_fc2,
)
from agoq.ops.swiglu_linear import SwiGLUFeed, swiglu_linear

# The linears replace Megatron's saved input through a hook scope around the call (public mechanisms only).


@dataclass(frozen=True, kw_only=True)
class SavedInputConfig:
    """How one module stores the tensor it saves for backward (a constructor argument, ``agoq_save``).

    The default (no format, not recomputed) is Megatron's own save: the module runs Megatron's code."""

    fmt: QuantFormat | None = None
    """Store a copy quantized to this format; None: Megatron's save (or nothing, when ``recomputed``)."""
    key: Key = (None, "")
    """(global layer index, role): the byte counter's key and the name in error messages."""
    counter: SavedBytesCounter | None = None
    """The model's byte counter, shared by every layer (None: not counted)."""
    paths: SavePaths = SavePaths()
    """Host paths of the saved-activation code (same bytes and gradients)."""
    recomputed: bool = False
    """Linears only: store nothing; the input is rebuilt from the stash the producing op (pre-norm or
    SwiGLU) leaves in the linear's :class:`Handoff`."""


@dataclass(frozen=True, kw_only=True)
class SmoothFc2Input:
    """Sent by ``AgoqMLP`` to its FP8 fc2 with the fc1 output as fc2's input: fc2 runs (Smooth-)SwiGLU and its
    GEMMs as one op (agoq.ops.smooth_swiglu_fp8)."""

    mode: str
    """agoq.ops.smooth_swiglu_fp8.SMOOTHING: "per_token" / "per_channel" smoothing, or "none" (plain SwiGLU)."""
    tp_group: object | None = None
    """The group the per-token amax is all-reduced over (the MLP's TP group; unused otherwise)."""
    store: tuple | None = None
    """(fmt, key, counter): keep only the fc1 output quantized (activation storage); None: keep it as is."""


class Handoff:
    """A one-slot hand-off from the op that produces a linear's input to that linear, within one forward.

    The producer (``AgoqRMSNorm`` for QKV / fc1, ``AgoqMLP``'s SwiGLU for fc2) ``put``s the
    ``RecomputeStash`` of its quantized input (and, per-channel Smooth-SwiGLU, the scale fc2 folds into
    its weight); the consumer linear ``take``s it at the start of its ``_forward_impl``. The slot is
    created by the module that owns both (the transformer layer, the MLP) and given to producer and
    consumer at construction. Order is checked: a producer that finds an untaken stash, and a
    recomputing consumer that finds none, raise instead of recomputing from the wrong tensor (the
    stash itself also checks that it feeds the tensor the producer returned).
    """

    __slots__ = ("name", "accepts_feed", "_stash", "_col_scale", "_smooth")

    def __init__(self, name: str):
        self.name = name  # "producer -> consumer", for error messages
        # set by a consumer linear at construction when it can run its producer with itself as one autograd node
        # (agoq.ops.norm_linear, agoq.ops.swiglu_linear): the producer then puts a NormFeed / SwiGLUFeed, not a stash
        self.accepts_feed = False
        self._stash: RecomputeStash | NormFeed | SwiGLUFeed | None = None
        self._col_scale: torch.Tensor | None = None
        self._smooth: SmoothFc2Input | None = None

    def put(self, stash: RecomputeStash | NormFeed | SwiGLUFeed | None, col_scale: torch.Tensor | None = None,
            smooth: SmoothFc2Input | None = None) -> None:
        if self.pending:
            raise RuntimeError(
                f"agoq hand-off {self.name}: the producer ran again before its consumer took the previous "
                "stash; the layer's forward order changed (report it) or use a bf16 policy")
        self._stash, self._col_scale, self._smooth = stash, col_scale, smooth

    def take(self) -> tuple[RecomputeStash | NormFeed | SwiGLUFeed | None, torch.Tensor | None, SmoothFc2Input | None]:
        """(stash, col_scale, smooth) left by the producer (Nones when none), and empty the slot."""
        out = self._stash, self._col_scale, self._smooth
        self._stash = self._col_scale = self._smooth = None
        return out

    @property
    def pending(self) -> bool:
        return self._stash is not None or self._col_scale is not None or self._smooth is not None

    def __repr__(self) -> str:
        return f"Handoff({self.name!r}, pending={self.pending})"


_NO_SAVE = SavedInputConfig()


class AgoqRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (what ``WrappedTorchNorm`` builds for RMSNorm) that can store only its
    quantized input (``agoq_save.fmt``) and hand a recompute stash to the linear it feeds
    (``agoq_handoff``, shared with that linear)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, agoq_save: SavedInputConfig = _NO_SAVE,
                 agoq_handoff: Handoff | None = None, **_unused):
        fixes = {"layernorm_zero_centered_gamma": "drop --apply-layernorm-1p",
                 "persist_layer_norm": "add --no-persist-layer-norm (apex's LayerNorm kernel; RMSNorm has none)",
                 "memory_efficient_layer_norm": "drop --memory-efficient-layer-norm"}
        problems = [f"{name}=True ({fix})" for name, fix in fixes.items() if getattr(config, name)]
        if config.normalization != "RMSNorm":
            problems.insert(0, f"normalization={config.normalization!r} (add --normalization RMSNorm)")
        if problems:
            raise NotImplementedError(
                f"agoq's RMSNorm does not support {'; '.join(problems)} (TransformerConfig; Megatron-LM's flags in "
                f"brackets); or use {flag_for('enabled')}"
            )
        if agoq_save.fmt is not None and agoq_handoff is None:
            raise ValueError(f"agoq: the norm {agoq_save.key} stores its input quantized but has no hand-off to the "
                             "linear it feeds; build it through AgoqTransformerLayer (agoq_layer_spec)")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            # the norm sees this rank's sequence shard: finalize_model_grads all-reduces the gradient of a weight so
            # marked over TP (Megatron's own norms set the same attribute; unset otherwise, as torch's RMSNorm)
            self.weight.sequence_parallel = True
        self.agoq_save = agoq_save
        self.agoq_handoff = agoq_handoff

    def forward(self, x_SBH: torch.Tensor) -> torch.Tensor:
        save = self.agoq_save
        if save.fmt is None:
            return super().forward(x_SBH)
        handoff = self.agoq_handoff
        if handoff.accepts_feed and torch.is_grad_enabled() and (x_SBH.requires_grad or self.weight.requires_grad) \
                and not torch.compiler.is_compiling() and not default_saved_hooks_active():
            # no autograd node here: the linear this feeds makes one node of norm and linear (agoq.ops.norm_linear);
            # under another saved-tensor hook scope (activation offloading, a meter) the stash path keeps agoq's
            # hooks innermost, as for every one-node linear
            y_SBH = rmsnorm_no_graph(x_SBH, self.weight, self.eps)
            handoff.put(NormFeed(x_SBH, self.weight, self.eps, y_SBH, save.fmt, save.key, save.counter))
            return y_SBH
        y_SBH, stash = rmsnorm_saving_input(x_SBH, self.weight, self.eps, save.fmt, save.key, save.counter)
        self.agoq_handoff.put(stash)
        return y_SBH


class _AgoqLinearMixin:
    """``_forward_impl`` that stores the input quantized (``agoq_save.fmt``) or not at all
    (``agoq_save.recomputed``: the producing norm / SwiGLU left a stash in ``agoq_handoff``), and that
    runs the GEMMs in FP8 when ``agoq_fp8`` (an ``FP8Recipe``) is set. A column scale in the hand-off
    (per-channel Smooth-SwiGLU, fc2) makes the GEMM use W * s."""

    def __init__(self, *args, agoq_save: SavedInputConfig = _NO_SAVE, agoq_handoff: Handoff | None = None,
                 agoq_fp8: FP8Recipe | None = None, **kwargs):
        if agoq_save.recomputed and agoq_handoff is None:
            raise ValueError(f"agoq: the linear {agoq_save.key} recomputes its input but has no hand-off from the "
                             "op that produces it; build it through AgoqTransformerLayer (agoq_layer_spec)")
        super().__init__(*args, **kwargs)
        if agoq_fp8 is not None and self.config.sequence_parallel:
            raise NotImplementedError(
                f"agoq's FP8 linears do not all-gather a sequence-sharded input (layer/role {agoq_save.key}: "
                f"sequence_parallel=True); run these layers in bf16 ({flag_for('fp8.recipe')} off) or drop "
                "--sequence-parallel")
        self.agoq_save = agoq_save
        self.agoq_handoff = agoq_handoff
        self.agoq_fp8 = agoq_fp8  # FP8Recipe for this linear, or None: Megatron's bf16 GEMMs
        if agoq_handoff is not None and (self._takes_norm_feed() or self._takes_swiglu_feed()):
            agoq_handoff.accepts_feed = True
        self.agoq_quantized_node = self._quantized_input_node()  # decided once: agoq.ops.quant_linear

    def _takes_norm_feed(self) -> bool:
        """Whether this linear runs with the norm before it as one autograd node (agoq.ops.norm_linear): a
        column-parallel linear recomputing its input, bf16 GEMMs, none of the Megatron options that node does not
        implement (they keep Megatron's linear with the norm's stash)."""
        return (isinstance(self, ColumnParallelLinear) and self.agoq_save.recomputed
                and self.agoq_save.paths.fuse_norm_linear and self._plain_megatron_linear()
                and not self.config.defer_embedding_wgrad_compute and not getattr(self, "disable_grad_reduce", False))

    def _plain_megatron_linear(self) -> bool:
        """What every one-node linear needs of Megatron's linear (agoq.ops.linear_math reproduces only this case):
        bf16 GEMMs, no gradient-accumulation fusion, no GTP weight remat, no expert comm. Sequence parallelism is
        reproduced (a column-parallel linear's gather / reduce-scatter; a row-parallel one's reduce-scatter of the
        output follows in Megatron's forward)."""
        config = self.config
        return (self.agoq_fp8 is None and not config.gradient_accumulation_fusion
                and getattr(self, "gtp_remat_size", 1) == 1 and not getattr(self, "explicit_expert_comm", False))

    def _takes_swiglu_feed(self) -> bool:
        """Whether this linear runs with the SwiGLU before it as one autograd node (agoq.ops.swiglu_linear): a
        row-parallel linear (fc2) recomputing its input, bf16 GEMMs, none of the Megatron options that node does not
        implement (they keep Megatron's linear with SwiGLU's stash). Plain SwiGLU only: the MLP hands a feed only
        without Smooth-SwiGLU and without the fused FP8 fc2 (agoq.megatron.mlp)."""
        return (isinstance(self, RowParallelLinear) and self.agoq_save.recomputed
                and self.agoq_save.paths.fuse_swiglu_linear and self._plain_megatron_linear())

    def _quantized_input_node(self) -> bool:
        """Whether this linear, storing its own input quantized (not recomputed), runs as one autograd node
        (agoq.ops.quant_linear) instead of Megatron's linear inside a hook scope: bf16 GEMMs and none of the Megatron
        options that node does not implement."""
        paths = self.agoq_save.paths
        return (self.agoq_save.fmt is not None and not self.agoq_save.recomputed
                and paths.quantized_linear_node and self._plain_megatron_linear()
                and not self.config.defer_embedding_wgrad_compute and not getattr(self, "disable_grad_reduce", False))

    def _forward_impl(self, input, weight, *args, **kwargs):
        if torch.compiler.is_compiling() and (self.agoq_handoff is not None or self.agoq_fp8 is not None
                                              or self.agoq_save.fmt is not None):
            return _eager_linear_forward_impl(self, input, weight, *args, **kwargs)
        stash, col_scale, smooth = (None, None, None) if self.agoq_handoff is None else self.agoq_handoff.take()
        if type(stash) is NormFeed:
            return self._norm_linear_forward_impl(input, weight, stash, args, kwargs)
        if type(stash) is SwiGLUFeed:
            return self._swiglu_linear_forward_impl(input, weight, stash, args, kwargs)
        if smooth is not None:
            return self._smooth_fp8_forward_impl(input, weight, smooth, args, kwargs)
        if self.agoq_fp8 is not None:
            return self._fp8_forward_impl(input, weight, stash, col_scale, args, kwargs)
        if col_scale is not None:
            weight = fold_channel_scale(weight, col_scale)  # W * s, differentiable in W
        saves_input = torch.is_grad_enabled() and weight.requires_grad and input.requires_grad
        if not saves_input:  # no graph, or frozen weight: Megatron saves no input for wgrad
            return super()._forward_impl(input, weight, *args, **kwargs)
        save = self.agoq_save
        if self.agoq_quantized_node and col_scale is None and stash is None and not default_saved_hooks_active():
            return self._quantized_node_forward_impl(input, weight, args, kwargs)
        if save.recomputed:
            kw = {"stash": self._require_stash(stash), "key": save.key}
        elif save.fmt is not None:
            kw = {"fmt": save.fmt, "key": save.key, "counter": save.counter}
        else:
            return super()._forward_impl(input, weight, *args, **kwargs)
        with quantized_saves(input, **kw):  # agoq's scope, innermost
            return super()._forward_impl(input, weight, *args, **kwargs)

    def _norm_linear_forward_impl(self, input, weight, feed: NormFeed, args, kw):
        """QKV / fc1 fed by the norm's output: norm and linear as one node from the norm's input
        (agoq.ops.norm_linear), storing only the norm's quantized input; Megatron's dgrad all-reduce inside it."""
        feed.check_feeds(input)
        if not torch.is_grad_enabled():
            # the norm ran with grad and handed its output without a graph: something between them (a checkpoint
            # such as Megatron's recompute of the MLP) turned grad off, and the node would not be recorded
            raise RuntimeError(
                f"agoq: {self.agoq_save.key} runs without grad on a norm output made with grad (a checkpoint between "
                "the norm and its linear, e.g. Megatron's recompute_modules 'mlp' or 'layernorm'); its gradients "
                "would be lost. Leave those modules out of --recompute-modules or use a policy that keeps the norm "
                "roles bf16")
        what = "agoq's norm + linear node"
        self._check_unfused_kwargs(args, kw, what, "build the layers with SavePaths(fuse_norm_linear=False)",
                                   sequence_parallel=True)
        return rmsnorm_linear(feed, weight, kw.get("bias"), self._dgrad_group(kw, what), self._sp_group(kw, what))

    def _quantized_node_forward_impl(self, input, weight, args, kw):
        """A linear storing its own input quantized as one node (agoq.ops.quant_linear); outside any other saved-
        tensor hooks (under them the hook scope runs, innermost, as before)."""
        save = self.agoq_save
        what = "agoq's quantized-input linear node"
        self._check_unfused_kwargs(args, kw, what, "build the layers with SavePaths(quantized_linear_node=False)",
                                   sequence_parallel=True)
        return quantized_input_linear(input, weight, kw.get("bias"), save.fmt, save.key, save.counter,
                                      self._dgrad_group(kw, what), self._sp_group(kw, what))

    def _sp_group(self, kw, what: str):
        """The group a one-node column-parallel linear gathers its sequence-sharded input over and reduce-scatters
        its input gradient over: Megatron's ``tp_group`` where it passes ``sequence_parallel``, else None."""
        if not kw.get("sequence_parallel"):
            return None
        group = kw.get("tp_group")
        if group is None:
            raise NotImplementedError(f"{what} under sequence parallelism needs the linear's tp_group "
                                      f"({self.agoq_save.key})")
        return group

    def _dgrad_group(self, kw, what: str):
        """The group a one-node linear all-reduces its input gradient over: Megatron's ``tp_group`` where it passes
        ``allreduce_dgrad`` (a column-parallel linear at TP > 1), else None."""
        if not kw.get("allreduce_dgrad"):
            return None
        group = kw.get("tp_group")
        if group is None:
            raise NotImplementedError(f"{what} needs the linear's tp_group ({self.agoq_save.key})")
        return group

    def _swiglu_linear_forward_impl(self, input, weight, feed: SwiGLUFeed, args, kw):
        """fc2 fed by the SwiGLU's output: SwiGLU and fc2 as one node from the fc1 output (agoq.ops.swiglu_linear),
        storing only the quantized fc1 output; Megatron's output all-reduce and bias follow in its forward."""
        feed.check_feeds(input)
        if not torch.is_grad_enabled():
            raise RuntimeError(
                f"agoq: {self.agoq_save.key} runs without grad on a SwiGLU output made with grad (a checkpoint "
                "between SwiGLU and fc2); its gradients would be lost. Use a policy that keeps mlp.swiglu_input bf16")
        self._check_unfused_kwargs(args, kw, "agoq's SwiGLU + linear node",
                                   "build the layers with SavePaths(fuse_swiglu_linear=False)")
        if kw.get("allreduce_dgrad"):
            raise NotImplementedError(f"agoq's SwiGLU + linear node is row-parallel: no dgrad all-reduce "
                                      f"({self.agoq_save.key})")
        return swiglu_linear(feed, weight, kw.get("bias"))

    def _require_stash(self, stash):
        if stash is None:
            raise RuntimeError(
                f"agoq: {self.agoq_save.key} expects its input from the recomputable op before it "
                f"(hand-off {self.agoq_handoff.name}), which left no stash; the layer's forward order changed "
                "(report it) or use a bf16 policy"
            )
        return stash

    def _smooth_fp8_forward_impl(self, h, weight, smooth: SmoothFc2Input, args, kw):
        """fc2 fed the fc1 output ``h`` by AgoqMLP: (Smooth-)SwiGLU and the FP8 GEMMs as one op
        (agoq.ops.smooth_swiglu_fp8), returning fc2's TP-partial output (Megatron's RowParallelLinear.forward
        all-reduces it and adds the bias)."""
        self._check_fp8_kwargs(args, kw)
        if kw.get("allreduce_dgrad"):
            raise NotImplementedError(
                f"agoq's fused SwiGLU + FP8 fc2 runs on a row-parallel fc2 only ({self.agoq_save.key})")
        cache = self.__dict__.get("_agoq_fp8_smooth_wcache")
        if cache is None:  # its entries carry the row-wise scale / the folded per-channel s: not the plain cache's
            cache = self.__dict__["_agoq_fp8_smooth_wcache"] = FP8WeightCache()
        state = self._fp8_state(weight.device)
        if smooth.mode == "none":
            y = swiglu_fp8_fc2(h, weight, state, self.agoq_fp8, weight_cache=cache, store=smooth.store)
        else:
            y = smooth_swiglu_fp8_fc2(h, weight, state, self.agoq_fp8, per_token=smooth.mode == "per_token",
                                      weight_cache=cache, tp_group=smooth.tp_group, store=smooth.store)
        return y if kw.get("bias") is None else y + kw["bias"]

    def _check_fp8_kwargs(self, args, kw) -> None:
        self._check_unfused_kwargs(args, kw, "agoq's FP8 linear",
                                   f"run this layer in bf16 ({flag_for('fp8.recipe')} off)")

    def _check_unfused_kwargs(self, args, kw, what: str, fix: str, *, sequence_parallel: bool = False) -> None:
        """Raise when Megatron passes an option that agoq's own linear nodes do not implement
        (``sequence_parallel``: this node implements Megatron's sequence parallelism)."""
        save = self.agoq_save
        unsupported = [name for name in ("gradient_accumulation_fusion", "sequence_parallel")
                       if kw.get(name) and not (name == "sequence_parallel" and sequence_parallel)]
        if kw.get("grad_output_buffer") is not None:
            unsupported.append("defer_embedding_wgrad_compute")
        if (kw.get("gtp_remat_size") or 1) > 1:
            unsupported.append("gtp_weight_remat_size > 1")
        if args or unsupported:
            raise NotImplementedError(
                f"{what} does not support {unsupported or 'positional arguments'} (layer/role "
                f"{save.key}); turn them off or {fix}")

    def _fp8_forward_impl(self, input, weight, stash, col_scale, args, kw):
        """Megatron's local linear (``linear_with_grad_accumulation_and_async_allreduce``) with FP8
        GEMMs: the column-parallel dgrad all-reduce becomes ``copy_to_tensor_model_parallel_region``
        (synchronous, not overlapped with wgrad); the rest of its options raise."""
        save = self.agoq_save
        self._check_fp8_kwargs(args, kw)
        if kw.get("allreduce_dgrad"):
            input = copy_to_tensor_model_parallel_region(input, group=kw.get("tp_group"))
        saver = None
        if torch.is_grad_enabled() and weight.requires_grad:
            if save.recomputed:
                stash = self._require_stash(stash)
                saver = lambda x2: saved_input_handle(input, stash=stash, key=save.key)  # noqa: E731
            elif save.fmt is not None:
                saver = lambda x2: saved_input_handle(x2, fmt=save.fmt, key=save.key,  # noqa: E731
                                                      counter=save.counter)
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


# Under torch.compile the saving (or FP8) linear runs eagerly, between graphs: it takes the recompute stash from
# the hand-off, checks it feeds this very input tensor (data pointers), and hooks the saved input of Megatron's
# autograd node (out.grad_fn), none of which a traced graph has (docs/numerics.md, "Custom ops and
# torch.compile"). Megatron's own linear breaks the graph here as well (a warnings.warn in
# get_tensor_model_parallel_group_if_none, megatron-core 0.19.2).
_eager_linear_forward_impl = eager_under_compile(
    _AgoqLinearMixin._forward_impl, "linear storing its input quantized or recomputed (autograd-node hooks, "
    "recompute hand-off) or running FP8 GEMMs")
eager_under_compile.prepare_all()  # built before any compilation: no extra graph break (the norm's, SwiGLU's too)


class AgoqColumnParallelLinear(_AgoqLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear (linear_qkv, linear_fc1) with agoq's saved-input storage."""


class AgoqRowParallelLinear(_AgoqLinearMixin, RowParallelLinear):
    """RowParallelLinear (linear_proj, linear_fc2) with agoq's saved-input storage."""


def with_params(entry, **params) -> ModuleSpec:
    """``entry`` of a spec (a module class or a ModuleSpec) as a ModuleSpec that also passes ``params`` to the
    module's ``__init__`` (Megatron's ``build_module``); the shared spec is not modified."""
    if isinstance(entry, ModuleSpec):
        return dataclasses.replace(entry, params={**entry.params, **params})
    return ModuleSpec(module=entry, params=params)
