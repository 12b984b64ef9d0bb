"""Megatron's fused-RoPE slot filled with agoq's Triton RoPE when Transformer Engine does not fill it.

Seam card
---------
Touches: ``megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb`` (a module global that
  megatron-core fills from Transformer Engine at import, None without it) and ``TransformerConfig.apply_rope_fusion``
  (a constructor argument: ``apply_rotary_pos_emb`` then calls the slot for bshd inputs with mscale 1, and
  ``TransformerConfig.__post_init__`` refuses the flag while the slot is empty).
Why: without TE, Megatron's RoPE is ~11 elementwise launches per query / key in the forward and ~10 in the
  backward (``_apply_rotary_pos_emb_bshd``: cos, sin, casts, two products, chunk / neg / cat, a sum, the cat with
  the pass-through part), ~40 launches per layer and micro-batch: host time that a small micro-batch's step waits
  on (docs/benchmarks/log.md, "Host cost"). agoq's op (agoq.ops.rope) is one launch each way with the same values
  and gradients, bit for bit.
Kind: a runtime patch of one module global (no constructor argument or hook reaches it), recorded with
  ``agoq.megatron.install.set_module_attr``: ``Handle.undo()`` / ``undo_runtime_changes()`` put None back.
  A slot that TE filled is left alone (TE's kernel runs).
Verified on: megatron-core 0.19.2.
When disabled: ``--rope-fusion off`` (trainer), ``llama_transformer_config(rope_fusion=False)``: Megatron's unfused
  RoPE, the slot untouched.
Guarded by: ``tests/megatron/test_rope.py`` (same values and gradients as Megatron's unfused RoPE, in a model too),
  ``tests/kernels/test_rope_kernels.py`` (kernel = reference, bits), the contract table (agoq.megatron.contract).

Second seam (same card, same switch): Megatron's QKV split + RoPE slot
``megatron.core.transformer.attention.apply_fused_qkv_rotary_pos_emb`` with its flag ``HAVE_FUSED_QKV_ROPE``
(module globals defined from Transformer Engine at import; undefined / False without it) and
``TransformerConfig.fused_single_qkv_rope`` (a constructor argument: self-attention then hands the unsplit QKV
output and its split sizes to the slot instead of splitting it, reshaping the query and calling RoPE on query and
key; ``Attention.forward`` asserts the slot is there). agoq.ops.rope.apply_qkv_rope does the split and both RoPEs
in one launch each way, with the values and gradients of the split path (agoq's SDPA then finds a compact value:
its copy is a no-op). Per layer and micro-batch that is 2 launches instead of ~8 (split, query reshape copy, two
RoPEs, the value copy; in backward two RoPEs and the split's concatenation), and the fused QKV output is read once.
Undo removes the slot again (it was undefined) and puts the flag back.
"""

from __future__ import annotations

import logging

import torch

from agoq.ops.rope import apply_qkv_rope, apply_rope

__all__ = ["SEAM_ROPE", "agoq_fused_apply_rotary_pos_emb", "agoq_fused_qkv_rotary_pos_emb", "provide_qkv_rope_fusion",
           "provide_rope_fusion", "qkv_rope_fusion_provider", "refuse_packed_sequences", "rope_fusion_provider"]

log = logging.getLogger("agoq.megatron.rope")
SEAM_ROPE = "rope_fusion"


def agoq_fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                                    interleaved: bool = False, start_positions=None) -> torch.Tensor:
    """Megatron's ``fused_apply_rotary_pos_emb`` (the TE wrapper's signature) by agoq.ops.rope.apply_rope:
    bshd ``t`` [s, b, n, d], ``freqs`` [s, 1, 1, r]. Refuses what it does not implement, naming the fix."""
    if interleaved:
        raise ValueError("agoq's fused RoPE implements the rotate-half form only; --rotary-interleaved needs "
                         "--rope-fusion off (Megatron's unfused RoPE) or Transformer Engine")
    if transpose_output_memory or start_positions is not None:
        raise ValueError("agoq's fused RoPE: transpose_output_memory / start_positions (inference paths) are not "
                         "implemented; use --rope-fusion off")
    return apply_rope(t, freqs)


def refuse_packed_sequences(*args, **kwargs):
    """Megatron's packed-sequence (thd) fused-RoPE slot while agoq fills the bshd one: agoq has no thd kernel."""
    raise ValueError("agoq's fused RoPE implements Megatron's bshd layout only; packed sequences (thd, cu_seqlens) "
                     "need --rope-fusion off (Megatron's unfused RoPE) or Transformer Engine")


def rope_fusion_provider() -> str:
    """Who fills Megatron's fused-RoPE slot now: "agoq", "transformer_engine" (or another) or "none"."""
    from megatron.core.models.common.embeddings import rope_utils

    return _provider_of(rope_utils.fused_apply_rotary_pos_emb, agoq_fused_apply_rotary_pos_emb)


def provide_rope_fusion() -> str:
    """Make ``TransformerConfig(apply_rope_fusion=True)`` usable: fill the empty slot with agoq's RoPE (recorded
    for undo) or keep what fills it; returns the provider (:func:`rope_fusion_provider`)."""
    from megatron.core.models.common.embeddings import rope_utils

    from agoq.megatron.install import set_module_attr

    provider = rope_fusion_provider()
    if provider == "none":
        set_module_attr(rope_utils, "fused_apply_rotary_pos_emb", agoq_fused_apply_rotary_pos_emb, seam=SEAM_ROPE)
        if rope_utils.fused_apply_rotary_pos_emb_thd is None:  # packed sequences: a refusal naming the fix
            set_module_attr(rope_utils, "fused_apply_rotary_pos_emb_thd", refuse_packed_sequences, seam=SEAM_ROPE)
        log.info("RoPE: agoq's fused kernel fills Megatron's fused_apply_rotary_pos_emb (no Transformer Engine)")
        return "agoq"
    if provider != "agoq":
        log.info("RoPE: Megatron's fused_apply_rotary_pos_emb comes from %s; agoq leaves it", provider)
    return provider


def agoq_fused_qkv_rotary_pos_emb(mixed_qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                                  qkv_split_arg_list: list, *args, **kwargs):
    """Megatron's ``apply_fused_qkv_rotary_pos_emb`` (TE's signature, as ``Attention.forward`` calls it) by
    agoq.ops.rope.apply_qkv_rope: ``mixed_qkv`` [s, b, g, (p + 2) d], frequencies [s, 1, 1, r] ->
    (query [s, b, g p, d], key, value [s, b, g, d]). Options it does not implement are refused, naming the fix."""
    if args or kwargs:
        raise ValueError(f"agoq's fused QKV RoPE takes (mixed_qkv, q_freqs, k_freqs, split_sizes) only, got extra "
                         f"arguments {args} {sorted(kwargs)}; use --rope-fusion off (Megatron's split path)")
    return apply_qkv_rope(mixed_qkv, q_freqs, k_freqs, qkv_split_arg_list)


def qkv_rope_fusion_provider() -> str:
    """Who fills Megatron's QKV split + RoPE slot now: "agoq", "transformer_engine" (or another) or "none"."""
    from megatron.core.transformer import attention

    slot = getattr(attention, "apply_fused_qkv_rotary_pos_emb", None)
    return _provider_of(slot if attention.HAVE_FUSED_QKV_ROPE else None, agoq_fused_qkv_rotary_pos_emb)


def provide_qkv_rope_fusion() -> str:
    """Make ``TransformerConfig(fused_single_qkv_rope=True)`` usable: fill the empty slot and its flag with agoq's
    op (recorded for undo) or keep what fills them; returns the provider (:func:`qkv_rope_fusion_provider`)."""
    from megatron.core.transformer import attention

    from agoq.megatron.install import set_module_attr

    provider = qkv_rope_fusion_provider()
    if provider == "none":
        set_module_attr(attention, "apply_fused_qkv_rotary_pos_emb", agoq_fused_qkv_rotary_pos_emb, seam=SEAM_ROPE,
                        allow_absent=True)  # undefined without Transformer Engine
        set_module_attr(attention, "HAVE_FUSED_QKV_ROPE", True, seam=SEAM_ROPE)
        log.info("RoPE: agoq's fused QKV split + RoPE fills Megatron's apply_fused_qkv_rotary_pos_emb")
        return "agoq"
    if provider != "agoq":
        log.info("RoPE: Megatron's apply_fused_qkv_rotary_pos_emb comes from %s; agoq leaves it", provider)
    return provider


def _provider_of(slot, ours) -> str:
    """"none" (an empty slot), "agoq" (``ours``), "transformer_engine", or the top package of what fills it."""
    if slot is None:
        return "none"
    if slot is ours:
        return "agoq"
    module = getattr(slot, "__module__", "") or ""
    return "transformer_engine" if "transformer_engine" in module else (module.split(".")[0] or "other")
