"""Reference rotary position embedding (RoPE, non-interleaved "rotate half" form), plain PyTorch: the executable
spec of agoq's fused RoPE (:mod:`agoq.kernels.rope`, :mod:`agoq.ops.rope`).

Layout as Megatron's training path (``megatron.core.models.common.embeddings.rope_utils``, bshd): ``t`` is
[S, B, N, D] (sequence, batch, heads, head dim), ``cos`` / ``sin`` are [S, R] in ``t``'s dtype (R = the rotary
dim, even, R <= D: the frequencies' cos / sin, cast once), and

  out[..., :R] = t[..., :R] * cos + rotate_half(t[..., :R]) * sin,   rotate_half([x1 | x2]) = [-x2 | x1]
  out[..., R:] = t[..., R:]

with every product and the sum rounded to ``t``'s dtype, in that order: the values of Megatron's unfused
``_apply_rotary_pos_emb_bshd`` (mscale 1), bit for bit (tests/megatron/test_rope.py compares it).

The backward is what autograd computes through Megatron's unfused ops, written out (the same roundings):

  grad_t[..., j]  = (g_j * cos_j) + (g_{j+R/2} * sin_{j+R/2})        for j < R/2
  grad_t[..., j]  = (g_j * cos_j) - (g_{j-R/2} * sin_{j-R/2})        for R/2 <= j < R
  grad_t[..., R:] = g[..., R:]

each product rounded, then the sum; autograd then adds the zero gradient of the slice the op did not read (so a
-0.0 comes out as +0.0), which :func:`ref_rope_bwd` reproduces with ``+ 0.0``. Non-finite values propagate.

Scaled RoPE (LLaMA-3.1 / 3.2 / 3.3, ``rope_type: llama3``) changes only the inverse frequencies the cos / sin
come from, never the rotation: :func:`ref_llama3_inv_freq` is its executable spec. Megatron applies it in
``RotaryEmbedding`` (``rope_scaling=True``) and hands the resulting frequencies to the fused kernel like any others.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LLAMA3_ROPE_FIXED", "ROPE_DTYPES", "ref_inv_freq", "ref_llama3_inv_freq", "ref_rope_fwd", "ref_rope_bwd",
           "check_rope_args", "check_qkv_split", "ref_qkv_rope_fwd", "ref_qkv_rope_bwd"]

ROPE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # training dtypes; the kernel's products are exact in fp32


# LLaMA-3's frequency bands, as every released LLaMA-3.1 / 3.2 / 3.3 config.json has them and as megatron-core 0.19.2
# hard-codes them (the defaults of RotaryEmbedding._apply_scaling, which GPTModel cannot set): only ``factor`` is a
# model setting there (``rope_scaling_factor``). agoq.megatron.model checks Megatron's defaults against these.
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def ref_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """Plain RoPE's fp32 inverse frequencies ``base ** (-2i / rotary_dim)``, i < rotary_dim / 2, rounded as Megatron's
    RotaryEmbedding and transformers' default RoPE round them (``1 / base ** (2i / rotary_dim)``)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return 1.0 / (base ** exponents)


def ref_llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_max_position_embeddings: int) -> torch.Tensor:
    """LLaMA-3's scaled inverse frequencies (``rope_type: llama3``) from plain ones (fp32 in, fp32 out).

    With L = ``original_max_position_embeddings`` and wavelength w = 2 pi / f of each frequency f: w < L /
    ``high_freq_factor`` (fast) keeps f; w > L / ``low_freq_factor`` (slow) becomes f / ``factor``; in between f
    blends the two, ``(1 - a) f / factor + a f`` with a = (L / w - low) / (high - low). Rounded as megatron-core's
    and transformers' implementations round it (each operation in fp32, in this order), so the bits agree
    (tests/megatron/test_rope.py compares all three)."""
    if not factor > 0 or not high_freq_factor > low_freq_factor > 0 or original_max_position_embeddings <= 0:
        raise ValueError(f"llama3 RoPE scaling needs factor > 0, high_freq_factor > low_freq_factor > 0 and "
                         f"original_max_position_embeddings > 0; got factor {factor}, low_freq_factor "
                         f"{low_freq_factor}, high_freq_factor {high_freq_factor}, original_max_position_embeddings "
                         f"{original_max_position_embeddings}")
    wavelength = 2 * math.pi / inv_freq
    slow = wavelength > original_max_position_embeddings / low_freq_factor
    fast = wavelength < original_max_position_embeddings / high_freq_factor
    base = torch.where(slow, inv_freq / factor, inv_freq)  # the slow band divided; the blend starts from this too
    alpha = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - alpha) * base / factor + alpha * base
    return torch.where(slow | fast, base, blended)


def check_rope_args(t_SBND: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor, what: str = "t") -> int:
    """Raise unless the shapes and dtypes fit (see the module docstring); returns R."""
    if t_SBND.dim() != 4:
        raise ValueError(f"agoq RoPE: {what} must be [seq, batch, heads, head_dim] (Megatron's bshd layout), "
                         f"got shape {tuple(t_SBND.shape)}")
    s, _, _, d = t_SBND.shape
    rot = cos_SR.shape[-1] if cos_SR.dim() == 2 else -1
    if cos_SR.shape != (s, rot) or sin_SR.shape != (s, rot) or rot % 2 or not 0 < rot <= d:
        raise ValueError(f"agoq RoPE: cos / sin must be [seq={s}, rotary_dim] with an even rotary_dim <= head_dim "
                         f"{d}; got {tuple(cos_SR.shape)} and {tuple(sin_SR.shape)}")
    if t_SBND.dtype not in ROPE_DTYPES:
        allowed = ", ".join(map(str, ROPE_DTYPES))
        raise ValueError(f"agoq RoPE: {what} is {t_SBND.dtype}; the fused RoPE takes {allowed} (the kernel computes "
                         "in fp32); use --rope-fusion off for other dtypes")
    if cos_SR.dtype != t_SBND.dtype or sin_SR.dtype != t_SBND.dtype:
        raise ValueError(f"agoq RoPE: cos / sin must be in {what}'s dtype {t_SBND.dtype} (Megatron casts them), got "
                         f"{cos_SR.dtype} / {sin_SR.dtype}")
    return rot


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def ref_rope_fwd(t_SBND: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t`` (a new contiguous tensor; see the module docstring)."""
    rot = check_rope_args(t_SBND, cos_SR, sin_SR)
    cos, sin = cos_SR[:, None, None, :], sin_SR[:, None, None, :]
    t_rot, t_pass = t_SBND[..., :rot], t_SBND[..., rot:]
    out = (t_rot * cos) + (_rotate_half(t_rot) * sin)
    return torch.cat((out, t_pass), dim=-1).contiguous()


def ref_rope_bwd(grad_SBND: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`ref_rope_fwd` with respect to ``t`` for the output gradient ``grad`` (cos / sin are
    constants: no gradient)."""
    rot = check_rope_args(grad_SBND, cos_SR, sin_SR, what="grad")
    half = rot // 2
    cos, sin = cos_SR[:, None, None, :], sin_SR[:, None, None, :]
    g_rot = grad_SBND[..., :rot]
    g_sin = g_rot * sin  # rounded once, as autograd's MulBackward
    from_rotation = torch.cat((g_sin[..., half:], -g_sin[..., :half]), dim=-1)
    grad_rot = (g_rot * cos) + from_rotation
    return torch.cat((grad_rot, grad_SBND[..., rot:]), dim=-1).contiguous() + 0.0


# --------------------------------------------------------------------------- QKV split + RoPE ----
# Megatron's self-attention without its split (TransformerConfig.fused_single_qkv_rope): the fused QKV output
# mixed [S, B, G, (P + 2) D] (G query groups, P = query heads per group) becomes query [S, B, G P, D] and key /
# value [S, B, G, D], RoPE applied to query and key, all three compact. The values are those of Megatron's split
# path (torch.split along the last dim, query reshaped to heads, RoPE per tensor) followed by agoq's SDPA, which
# makes value compact (agoq.megatron.attention); the gradient of mixed is the concatenation of the three
# gradients, as autograd's split backward computes it, each through its own op's backward (RoPE's for query and
# key, the identity of the split / reshape / copy for value).

def check_qkv_split(mixed_SBGW: torch.Tensor, split_sizes: list) -> tuple[int, int]:
    """(P, D): query heads per group and head dim of Megatron's ``qkv_split_arg_list`` [P D, D, D] for ``mixed``
    [S, B, G, (P + 2) D]; raise unless they fit."""
    if len(split_sizes) != 3 or split_sizes[1] != split_sizes[2] or min(split_sizes) <= 0 \
            or split_sizes[0] % split_sizes[1] or mixed_SBGW.dim() != 4 or mixed_SBGW.shape[-1] != sum(split_sizes):
        raise ValueError(f"agoq QKV RoPE: expected Megatron's split sizes [P*D, D, D] of a [seq, batch, groups, "
                         f"(P + 2) * D] QKV output, got {list(split_sizes)} for shape {tuple(mixed_SBGW.shape)}")
    return split_sizes[0] // split_sizes[1], split_sizes[1]


def ref_qkv_rope_fwd(mixed_SBGW: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor,
                     split_sizes: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query [S, B, G P, D] with RoPE, key [S, B, G, D] with RoPE, value [S, B, G, D]), all compact."""
    p, d = check_qkv_split(mixed_SBGW, split_sizes)
    s, b, g, _ = mixed_SBGW.shape
    query, key, value = torch.split(mixed_SBGW, list(split_sizes), dim=3)
    query = query.reshape(s, b, g * p, d)  # Megatron's reshape(s, b, -1, d), spelt out for S * B = 0
    return ref_rope_fwd(query, cos_SR, sin_SR), ref_rope_fwd(key, cos_SR, sin_SR), value.contiguous()


def ref_qkv_rope_bwd(grad_q_SBND: torch.Tensor, grad_k_SBGD: torch.Tensor, grad_v_SBGD: torch.Tensor,
                     cos_SR: torch.Tensor, sin_SR: torch.Tensor, split_sizes: list) -> torch.Tensor:
    """Gradient of :func:`ref_qkv_rope_fwd` with respect to ``mixed`` [S, B, G, (P + 2) D] (compact)."""
    s, b, g, _ = grad_k_SBGD.shape
    grad_q = ref_rope_bwd(grad_q_SBND, cos_SR, sin_SR).reshape(s, b, g, split_sizes[0])
    return torch.cat((grad_q, ref_rope_bwd(grad_k_SBGD, cos_SR, sin_SR), grad_v_SBGD), dim=3).contiguous()
