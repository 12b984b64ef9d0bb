"""agoq's Megatron MLP (moved out of agoq/megatron/layers.py, which keeps the norms, the linears and the
hand-offs it uses): SwiGLU with quantized-input storage and recompute, Smooth-SwiGLU, and the SwiGLU fused with
an FP8 fc2. The Megatron symbols it touches are CONTRACT rows (agoq/megatron/contract.py)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from agoq.config import flag_for
from agoq.megatron.layers import _NO_SAVE, Handoff, SavedInputConfig, SmoothFc2Input, with_params
from agoq.ops.saved_act import default_saved_hooks_active
from agoq.ops.saved_swiglu import smooth_swiglu_saving_input, swiglu_reference, swiglu_saving_input
from agoq.ops.smooth_swiglu import glu_smooth_scale, sequence_shard, unsmooth_fc2_output
from agoq.ops.smooth_swiglu_fp8 import fused_smooth_supported
from agoq.ops.swiglu_linear import swiglu_no_graph


class AgoqMLP(MLP):
    """MLP whose SwiGLU can store only its quantized input (the fc1 output) and recompute
    (``agoq_save.fmt``), and can be Smooth-SwiGLU (``agoq_smooth``: "per_token" or "per_channel", the FP8
    paper's rescale).

    With neither this is Megatron's MLP. Otherwise forward = fc1 -> SwiGLU (Megatron's unfused ``glu``
    values: ``silu(gate) * (up + glu_linear_offset)``) -> fc2. With storage, fc2 stores nothing: its
    input is rebuilt from the same quantized fc1 output in backward, through the MLP's own
    :class:`Handoff` (``agoq_fc2_handoff``, given to fc2 at construction).
    Smooth-SwiGLU divides the SwiGLU output by a power-of-two s (exact) and undoes it around fc2: per
    token, fc2's output (after the TP all-reduce; s is all-reduced MAX over TP first) is multiplied
    by s (under sequence parallelism fc2's output is reduce-scattered along the sequence, and each rank multiplies
    by its own shard of s: fc1's output, and so s, covers the whole sequence); per channel, fc2 uses W * s (s
    folded into its input columns, handed to fc2 with the stash; each channel lives on one TP rank). In bf16 the
    smoothed MLP therefore equals the plain one bit for bit, barring underflow.

    Plain SwiGLU with an FP8 fc2 under per-tensor delayed scaling (``agoq_plain_fp8``, decided at construction;
    the rule is :meth:`plain_fusion_problems`) hands fc2 the fc1 output and fc2 runs SwiGLU, its E4M3 cast and
    its GEMMs as one op (agoq.ops.smooth_swiglu_fp8.swiglu_fp8_fc2: Megatron's values, no silu output kept),
    unless switched off by the config (``SavePaths.fuse_swiglu_fp8`` False, from ``AgoqConfig.kernels``: Megatron's
    MLP, benchmarks' A/B).
    """

    def __init__(self, config, submodules, *args, agoq_save: SavedInputConfig = _NO_SAVE,
                 agoq_smooth: str | None = None, **kwargs):
        handoff = Handoff(f"layer {agoq_save.key[0]} SwiGLU -> linear_fc2")
        submodules = dataclasses.replace(
            submodules, linear_fc2=with_params(submodules.linear_fc2, agoq_handoff=handoff))
        super().__init__(config, submodules, *args, **kwargs)
        self.agoq_save = agoq_save
        self.agoq_smooth = agoq_smooth
        self.agoq_fc2_handoff = handoff
        if agoq_save.fmt is not None:
            self.check_recompute_supported()
        if agoq_smooth is not None:
            self.check_smooth_supported()
        # the policy's fc2 input request lets the fused op run (fixed per module: decided once, not per forward)
        self.agoq_fc2_request = self._fc2_request_problem()
        # plain SwiGLU fused with the FP8 fc2 (forward checks the switch, eager mode and the fc1 output's dtype)
        self.agoq_plain_fp8 = agoq_smooth is None and not self.plain_fusion_problems()

    @classmethod
    def as_mlp_submodule(cls, submodules, config, pg_collection, is_mtp_layer, is_expert: bool = False,
                         input_size: int | None = None, ffn_hidden_size: int | None = None, name: str | None = None,
                         *, agoq_save: SavedInputConfig = _NO_SAVE, agoq_smooth: str | None = None) -> AgoqMLP:
        """Megatron's builder (``MLP.as_mlp_submodule``) plus agoq's two constructor arguments, which the
        layer spec's ``partial`` carries (the MLP entry of ``TransformerLayerSubmodules`` is a builder, not a
        ModuleSpec, in megatron-core 0.19)."""
        del is_mtp_layer
        return cls(config=config, submodules=submodules, tp_group=pg_collection.tp, is_expert=is_expert,
                   input_size=input_size, ffn_hidden_size=ffn_hidden_size, name=name, agoq_save=agoq_save,
                   agoq_smooth=agoq_smooth)

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
        if problems:
            raise NotImplementedError(f"Smooth-SwiGLU needs {', '.join(problems)}; use "
                                      f"{flag_for('fp8.smooth_swiglu')} off")

    def plain_fusion_problems(self) -> list[str]:
        """Why plain SwiGLU cannot run fused with fc2 (empty: it can): fc2 must be FP8 with per-tensor delayed
        scaling (agoq.ops.smooth_swiglu_fp8.fused_smooth_supported's recipe rule), and Megatron's MLP must be
        computing the unfused ``glu`` the fused kernel reproduces: plain SwiGLU, no clamp, no offset, no
        ``bias_activation_fusion`` (Megatron's compiled bias_swiglu rounds once in fp32, not after silu and after
        the product). Anything else keeps Megatron's MLP (docs/numerics.md, "SwiGLU fused with a plain FP8 fc2")."""
        recipe = getattr(self.linear_fc2, "agoq_fp8", None)
        problems = []
        if recipe is None or recipe.granularity != "tensor" or recipe.scaling != "delayed":
            problems.append(f"an FP8 fc2 with per-tensor delayed scaling ({flag_for('fp8.recipe')} delayed)")
        problems += self._swiglu_problems()
        if self.config.glu_linear_offset:
            problems.append("glu_linear_offset=0")
        if self.config.bias_activation_fusion:
            problems.append("bias_activation_fusion=False (--no-bias-swiglu-fusion)")
        if self.agoq_fc2_request:
            problems.append(self.agoq_fc2_request)
        return problems

    def _fc2_request_problem(self) -> str | None:
        """Why the fused SwiGLU -> FP8 fc2 op would not store what the policy asks (None: it would). With the SwiGLU
        input in bf16 the op keeps fc2's input as its own E4M3 copy, which is Megatron's save of an FP8 linear,
        so mlp.fc2_input must be bf16 there; a quantized request runs the unfused SwiGLU and the FP8 fc2, which
        stores fc2's input in the asked format (a quantized SwiGLU input leaves fc2 nothing to store: the op keeps
        the quantized fc1 output only)."""
        fc2_save = getattr(self.linear_fc2, "agoq_save", _NO_SAVE)
        if self.agoq_save.fmt is not None or fc2_save.fmt is None:
            return None
        return (f"mlp.fc2_input bf16 where mlp.swiglu_input is bf16 (the policy asks {fc2_save.fmt.name} for layer "
                f"{fc2_save.key[0]}'s fc2 input; the fused op would keep its own E4M3 copy instead)")

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
        save = self.agoq_save
        plain_fused = per_token_scale is None and self._fused_plain(hidden_states)
        if save.fmt is None and self.agoq_smooth is None and not plain_fused:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None:
            raise NotImplementedError("agoq's MLP (SwiGLU recompute / Smooth-SwiGLU) does not support "
                                      "per_token_scale (MoE experts)")
        h_SBF2, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            h_SBF2 = h_SBF2 + bias
        if self.agoq_smooth is not None:
            return self._smooth_forward(h_SBF2)
        if plain_fused and fused_smooth_supported(self.linear_fc2.agoq_fp8, h_SBF2):
            return self._fused_fc2(h_SBF2, "none", None)
        if save.fmt is None:  # an fc1 output the fused op does not take (not the input's dtype): Megatron's glu
            return self.linear_fc2(self._megatron_glu(h_SBF2))
        handoff = self.agoq_fc2_handoff
        if handoff.accepts_feed and torch.is_grad_enabled() and h_SBF2.requires_grad \
                and not torch.compiler.is_compiling() and not default_saved_hooks_active():
            # no autograd node here: fc2 makes one node of SwiGLU and itself (agoq.ops.swiglu_linear); under another
            # saved-tensor hook scope the stash path keeps agoq's hooks innermost
            feed = swiglu_no_graph(h_SBF2, save.fmt, save.key, save.counter, offset=self.config.glu_linear_offset,
                                   fuse=save.paths.fuse_swiglu)
            handoff.put(feed)
            return self.linear_fc2(feed.z)
        z_SBF, stash = swiglu_saving_input(h_SBF2, save.fmt, save.key, save.counter,
                                           offset=self.config.glu_linear_offset, fuse=save.paths.fuse_swiglu)
        self.agoq_fc2_handoff.put(stash)
        return self.linear_fc2(z_SBF)

    def _fused_plain(self, hidden_states) -> bool:
        """Whether plain SwiGLU runs fused with the FP8 fc2 (class docstring): the construction-time rule, the
        process-wide switch, eager mode (under torch.compile Megatron's ops are traced) and an input dtype the
        fused kernels take (the fc1 output has the input's dtype; checked again on it)."""
        return (self.agoq_plain_fp8 and self.agoq_save.paths.fuse_swiglu_fp8 and not torch.compiler.is_compiling()
                and hidden_states.dtype in (torch.bfloat16, torch.float16))

    def _megatron_glu(self, h_SBF2):
        """megatron.core.transformer.mlp.MLP.forward's unfused ``glu`` under ``plain_fusion_problems``' rule (no
        clamp), in its own words (``x_linear + glu_linear_offset`` included)."""
        x_glu, x_linear = torch.chunk(h_SBF2, 2, dim=-1)
        return self.config.activation_func(x_glu) * (x_linear + self.config.glu_linear_offset)

    def _fused_fc2(self, h_SBF2, mode: str, tp_group):
        """Hand fc2 the fc1 output: fc2 runs the SwiGLU (``mode``: agoq.ops.smooth_swiglu_fp8.SMOOTHING), its
        E4M3 cast and its GEMMs as one op; with activation storage only the quantized h is kept."""
        save = self.agoq_save
        store = None if save.fmt is None else (save.fmt, save.key, save.counter)
        self.agoq_fc2_handoff.put(None, smooth=SmoothFc2Input(mode=mode, tp_group=tp_group, store=store))
        return self.linear_fc2(h_SBF2)

    def _fused_smooth(self, h_SBF2) -> bool:
        """Whether the Smooth-SwiGLU MLP runs as one op with its FP8 fc2: fc2 in FP8 with per-tensor delayed
        scaling (agoq.ops.smooth_swiglu_fp8.fused_smooth_supported), ``SavePaths.fuse_smooth_fp8`` (the default),
        eager mode (under torch.compile the unfused ops, the same math, are traced) and a policy whose fc2 input
        request the op keeps (:meth:`_fc2_request_problem`)."""
        return (self.agoq_save.paths.fuse_smooth_fp8 and not torch.compiler.is_compiling()
                and self.agoq_fc2_request is None
                and fused_smooth_supported(getattr(self.linear_fc2, "agoq_fp8", None), h_SBF2))

    def _smooth_forward(self, h_SBF2):
        mode, save = self.agoq_smooth, self.agoq_save
        tp_group = self.tp_group if mode == "per_token" else None
        if self._fused_smooth(h_SBF2):  # fc2 takes the fc1 output: one op (agoq.ops.smooth_swiglu_fp8)
            return self._fused_fc2(h_SBF2, mode, tp_group)

        def scale_fn(h, glu):
            return glu_smooth_scale(h, glu, mode, tp_group=tp_group)

        stash = None
        if save.fmt is None:
            glu_SBF = swiglu_reference(h_SBF2)
            s = scale_fn(h_SBF2, glu_SBF)
            z_SBF = glu_SBF / s.to(glu_SBF.dtype)  # a power of two: exact
        else:
            z_SBF, s, stash = smooth_swiglu_saving_input(h_SBF2, scale_fn, save.fmt, save.key, save.counter,
                                                         fuse=save.paths.fuse_swiglu)
        if mode == "per_channel":
            self.agoq_fc2_handoff.put(stash, col_scale=s)
            return self.linear_fc2(z_SBF)
        self.agoq_fc2_handoff.put(stash)
        out_SBH, out_bias = self.linear_fc2(z_SBF)
        if self.config.sequence_parallel:  # fc2's output was reduce-scattered along the sequence: this rank's s
            s = sequence_shard(s, self.tp_group)
        return unsmooth_fc2_output(out_SBH, s), out_bias
