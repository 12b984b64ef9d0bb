"""Rotary position embedding as one autograd node with one kernel each way (agoq.kernels.rope on CUDA, the
reference agoq.ref.rope elsewhere): the values and gradients of Megatron's unfused RoPE (mscale 1,
non-interleaved, bshd) bit for bit, in 2 launches per tensor and step instead of ~21
(docs/benchmarks/log.md, "Host cost").

``cos`` / ``sin`` of the frequencies are computed as Megatron computes them (``torch.cos(freqs).to(t.dtype)``)
once per frequency tensor and kept while that tensor lives unchanged (Megatron's ``RotaryEmbedding`` returns the
same cached tensor for every layer and step): :class:`_TrigCache`. The node keeps them as context attributes,
not saved tensors: they are constants shared by every layer, not activations, so no saved-tensor hook (agoq's
quantized saves, a meter, an offload) sees them. Inside a CUDA-graph capture the cache is neither read nor filled:
the graph computes cos / sin from its own frequency input (a replay then follows that input's values, and the
graph's private pool owns what it allocates); under torch.compile the reference's plain ops run (the compiler fuses
them).

:func:`apply_qkv_rope` is the same RoPE with Megatron's QKV split in the same node (one launch each way for
query, key and value together: ``TransformerConfig.fused_single_qkv_rope``, agoq.megatron.rope): the values of
Megatron's split, query reshape, RoPE of query and key, and the compact value agoq's SDPA makes; the gradient of
the fused QKV output as autograd assembles it through those ops (agoq.ref.rope, "QKV split + RoPE").

Shape legend: S = sequence, B = batch, N = heads, G = query groups, P = query heads per group (N = G P),
D = head dim, W = (P + 2) D, R = rotary dim (even, <= D).
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.function import once_differentiable

from agoq.ops.dispatch import qkv_rope_ops, rope_ops
from agoq.ref.rope import ref_qkv_rope_fwd, ref_rope_fwd

__all__ = ["apply_qkv_rope", "apply_rope", "rope_trig", "clear_trig_cache"]

_MAX_TRIG_ENTRIES = 8  # distinct live frequency tensors (one per sequence length / offset in use)


def _trig(freqs_S11R: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [S, R] as Megatron's unfused RoPE computes them (``(torch.cos(freqs) * mscale).to(dtype)`` with
    mscale 1: the product is exact, so it is left out)."""
    flat = freqs_S11R.reshape(freqs_S11R.shape[0], freqs_S11R.shape[-1])
    return torch.cos(flat).to(dtype), torch.sin(flat).to(dtype)


class _TrigCache:
    """(cos, sin) [S, R] in a dtype per live frequency tensor, valid while it is the same object at the same
    version (an in-place change bumps ``_version``)."""

    def __init__(self):
        self._entries: dict = {}  # (id(freqs), dtype) -> (weakref(freqs), version, cos, sin)

    def get(self, freqs_S11R: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # a graph capture computes cos / sin itself; an inference tensor has no version counter to validate against
        uncached = torch.is_inference(freqs_S11R) or (freqs_S11R.is_cuda and torch.cuda.is_current_stream_capturing())
        key = (id(freqs_S11R), dtype)
        entry = None if uncached else self._entries.get(key)
        if entry is not None and entry[0]() is freqs_S11R and entry[1] == freqs_S11R._version:
            return entry[2], entry[3]
        with torch.no_grad():
            cos, sin = _trig(freqs_S11R, dtype)
        if not uncached:
            self._entries = {k: e for k, e in self._entries.items() if e[0]() is not None}
            if len(self._entries) >= _MAX_TRIG_ENTRIES:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = (weakref.ref(freqs_S11R), freqs_S11R._version, cos, sin)
        return cos, sin

    def clear(self) -> None:
        self._entries.clear()


_TRIG = _TrigCache()


def rope_trig(freqs_S11R: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of ``freqs`` [S, 1, 1, R] as [S, R] in ``dtype``, cached per live frequency tensor."""
    return _TRIG.get(freqs_S11R, dtype)


def clear_trig_cache() -> None:
    _TRIG.clear()


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t_SBND, cos_SR, sin_SR):
        fwd, _ = rope_ops(t_SBND.device)
        ctx.cos, ctx.sin = cos_SR, sin_SR  # shared constants, not saved activations (module docstring)
        return fwd(t_SBND, cos_SR, sin_SR)

    @staticmethod
    @once_differentiable  # the kernel's gradient has no graph of its own: a double backward raises, not drops terms
    def backward(ctx, grad_SBND):
        _, bwd = rope_ops(grad_SBND.device)
        return bwd(grad_SBND, ctx.cos, ctx.sin), None, None


def _check_freqs(t_SBND: torch.Tensor, freqs: torch.Tensor) -> None:
    if freqs.dim() != 4 or freqs.shape[1:3] != (1, 1) or freqs.shape[0] != t_SBND.shape[0]:
        raise ValueError(f"agoq RoPE: frequencies must be [seq={t_SBND.shape[0]}, 1, 1, rotary_dim] (Megatron's "
                         f"RotaryEmbedding for bshd), got {tuple(freqs.shape)}; per-batch frequencies (mRoPE) "
                         "need Megatron's unfused RoPE (--rope-fusion off)")
    if freqs.requires_grad:
        raise ValueError("agoq RoPE: the frequencies require grad; agoq's fused RoPE treats them as constants "
                         "(--rope-fusion off for trainable frequencies)")


def apply_rope(t_SBND: torch.Tensor, freqs_S11R: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t`` [S, B, N, D] with frequencies [S, 1, 1, R] (fp32): Megatron's unfused values and gradients
    (module docstring), as one autograd node."""
    _check_freqs(t_SBND, freqs_S11R)
    if torch.compiler.is_compiling():
        return ref_rope_fwd(t_SBND, *_trig(freqs_S11R, t_SBND.dtype))
    cos_SR, sin_SR = rope_trig(freqs_S11R, t_SBND.dtype)
    return _RoPE.apply(t_SBND, cos_SR, sin_SR)


class _QKVRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed_SBGW, cos_SR, sin_SR, split_sizes):
        fwd, _ = qkv_rope_ops(mixed_SBGW.device)
        ctx.cos, ctx.sin, ctx.split = cos_SR, sin_SR, split_sizes  # constants (module docstring)
        return fwd(mixed_SBGW, cos_SR, sin_SR, split_sizes)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q_SBND, grad_k_SBGD, grad_v_SBGD):
        _, bwd = qkv_rope_ops(grad_k_SBGD.device)
        return bwd(grad_q_SBND, grad_k_SBGD, grad_v_SBGD, ctx.cos, ctx.sin, ctx.split), None, None, None


def apply_qkv_rope(mixed_SBGW: torch.Tensor, freqs_q: torch.Tensor, freqs_k: torch.Tensor,
                   split_sizes: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query [S, B, N, D], key [S, B, G, D], value [S, B, G, D]) from Megatron's fused QKV output ``mixed`` [S, B, G,
    W] and its ``qkv_split_arg_list`` [P D, D, D], RoPE on query and key with frequencies [S, 1, 1, R] (self-attention:
    the same tensor for both), as one autograd node."""
    _check_freqs(mixed_SBGW, freqs_q)  # the split sizes are checked by the kernel / reference it calls
    if freqs_k is not freqs_q:  # Megatron's self-attention passes one tensor twice; comparing values would sync
        raise ValueError("agoq's fused QKV RoPE takes one frequency tensor for query and key (self-attention); "
                         "separate ones need --rope-fusion off")
    split = list(split_sizes)
    if torch.compiler.is_compiling():
        return ref_qkv_rope_fwd(mixed_SBGW, *_trig(freqs_q, mixed_SBGW.dtype), split)
    cos_SR, sin_SR = rope_trig(freqs_q, mixed_SBGW.dtype)
    return _QKVRoPE.apply(mixed_SBGW, cos_SR, sin_SR, split)
