"""Fused rotary position embedding (RoPE), Triton: one launch for the forward and one for the backward of each
tensor, instead of the ~11 elementwise ops (and ~10 in backward) of Megatron's unfused RoPE without Transformer
Engine (docs/benchmarks/log.md, "Host cost": launches are what a small micro-batch's step waits on).

Twins of :mod:`agoq.ref.rope` (same signatures, the same roundings in the same order, so the same bits):

  rope_fwd(t [S, B, N, D], cos [S, R], sin [S, R]) -> out [S, B, N, D]   (ref_rope_fwd)
  rope_bwd(grad [S, B, N, D], cos [S, R], sin [S, R]) -> grad_t [S, B, N, D]   (ref_rope_bwd)
  qkv_rope_fwd(mixed [S, B, G, (P+2) D], cos, sin, split_sizes) -> (q [S, B, G P, D], k, v [S, B, G, D])
  qkv_rope_bwd(grad_q, grad_k, grad_v, cos, sin, split_sizes) -> grad_mixed [S, B, G, (P+2) D]

``t`` may be strided over S, B and N (Megatron's query / key are views of the fused QKV output); its last
dimension must be contiguous (else it is copied). One program per (s, b) row loads the row's cos / sin once and
walks its heads in blocks. Every product is rounded to the output dtype before the sum, and fp contraction is
off, so no FMA merges a product into the sum (tests/kernels/test_rope_kernels.py compares the bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.kernels._launch import remember_site
from agoq.kernels.fastlaunch import FastKernel, LaunchSite
from agoq.ref.rope import check_qkv_split, check_rope_args

__all__ = ["rope_fwd", "rope_bwd", "qkv_rope_fwd", "qkv_rope_bwd"]

NUM_WARPS = 4
MAX_TILE_ELEMS = 4096  # heads x head-dim elements a program holds per step (fp32: 16 KiB of registers per block)


@triton.jit
def _rounded(x, dt: tl.constexpr):
    """fp32 ``x`` rounded to ``dt`` (nearest, ties to even: ATen's cast) and back to fp32. bf16 by integer
    arithmetic on the fp32 bits: Triton's CPU interpreter truncates fp32 -> bf16 casts, and this spells the
    rounding the GPU does, so the tests compare bits under the interpreter too. NaN stays NaN."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def _rope_kernel(
    t_ptr,  # [S, B, N, D], strides (s, b, n, 1): the input (forward) or the output gradient (backward)
    cos_ptr,  # [S, R] contiguous, t's dtype
    sin_ptr,  # [S, R] contiguous, t's dtype
    out_ptr,  # [S, B, N, D] contiguous, t's dtype
    B,  # int: batch
    N,  # int: heads
    stride_s,  # int: elements between sequence positions of t
    stride_b,  # int: elements between batch entries of t
    stride_n,  # int: elements between heads of t
    D: tl.constexpr,  # head dim
    R: tl.constexpr,  # rotary dim (even, <= D)
    BLOCK_N: tl.constexpr,  # heads per step
    BLOCK_D: tl.constexpr,  # next power of two >= D
    BACKWARD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # = s * B + b
    s = row // B
    b = row - s * B
    half: tl.constexpr = R // 2
    cols = tl.arange(0, BLOCK_D)
    in_rot = cols < R
    partner = tl.where(cols < half, cols + half, cols - half)  # the other half's column (rotary columns only)
    dt = out_ptr.dtype.element_ty
    c = tl.load(cos_ptr + s * R + cols, mask=in_rot, other=0.0).to(tl.float32)
    if BACKWARD:
        sn = tl.load(sin_ptr + s * R + partner, mask=in_rot, other=0.0).to(tl.float32)
    else:
        sn = tl.load(sin_ptr + s * R + cols, mask=in_rot, other=0.0).to(tl.float32)
    first_half = (cols < half)[None, :]
    heads = tl.arange(0, BLOCK_N)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + heads
        ok = (n < N)[:, None] & (cols < D)[None, :]
        base = t_ptr + s * stride_s + b * stride_b + n[:, None].to(tl.int64) * stride_n
        x = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(base + partner[None, :], mask=ok & in_rot[None, :], other=0.0).to(tl.float32)
        direct = _rounded(x * c[None, :], dt)
        if BACKWARD:  # g_j cos_j +/- (g_partner sin_partner), the rotation's gradient rounded first
            rotated = _rounded(xp * sn[None, :], dt)
            rotated = tl.where(first_half, rotated, -rotated)
        else:  # t_j cos_j + rotate_half(t)_j sin_j, rotate_half(t)_j = -t_partner (first half), t_partner
            rotated = _rounded(tl.where(first_half, -xp, xp) * sn[None, :], dt)
        y = tl.where(in_rot[None, :], direct + rotated, x)
        if BACKWARD:
            y = y + 0.0  # -0.0 -> +0.0, as autograd's sum with the unread slice's zero gradient
        dst = out_ptr + (row * N + n[:, None].to(tl.int64)) * D + cols[None, :]
        tl.store(dst, _rounded(y, dt).to(dt), mask=ok)  # the sum rounded once; the cast is then exact


# direct launcher (agoq.kernels.fastlaunch); fp contraction off: no product may merge into the sum
_ROPE = FastKernel(_rope_kernel, num_warps=NUM_WARPS, enable_fp_fusion=False)
# (shape, strides, dtype, rotary dim, backward, CUDA index) -> LaunchSite: a layer's query / key keep their shapes,
# so every launch after the first skips Triton's binding and the key work (agoq.kernels.fastlaunch.LaunchSite)
_ROPE_SITES: dict = {}


def _site(t: torch.Tensor, rot: int, backward: bool) -> tuple[LaunchSite, tuple]:
    key = (t.shape, t.stride(), t.dtype, rot, backward, t.device.index)
    entry = _ROPE_SITES.get(key)
    if entry is None:
        s, b, n, d = t.shape
        block_d = triton.next_power_of_2(d)
        block_n = max(1, min(triton.next_power_of_2(n), MAX_TILE_ELEMS // block_d))
        tail = (b, n, t.stride(0), t.stride(1), t.stride(2), d, rot, block_n, block_d, backward)
        entry = remember_site(_ROPE_SITES, key, (LaunchSite(_ROPE, (s * b,)), tail))
    return entry


def _launch(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    rot = check_rope_args(t, cos, sin, what="grad" if backward else "t")
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if out.numel() == 0:
        return out
    if t.stride(-1) != 1:
        t = t.contiguous()
    site, tail = _site(t, rot, backward)
    site(t, cos.contiguous(), sin.contiguous(), out, *tail)
    return out


def rope_fwd(t_SBND: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Triton twin of agoq.ref.rope.ref_rope_fwd."""
    return _launch(t_SBND, cos_SR, sin_SR, backward=False)


def rope_bwd(grad_SBND: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Triton twin of agoq.ref.rope.ref_rope_bwd."""
    return _launch(grad_SBND, cos_SR, sin_SR, backward=True)


@triton.jit
def _qkv_rope_kernel(
    mixed_ptr,  # [S, B, G, (P + 2) D], strides (s, b, g, 1): forward input / backward output (then compact)
    cos_ptr,  # [S, R] contiguous
    sin_ptr,  # [S, R] contiguous
    q_ptr,  # [S, B, G P, D]: forward output (compact) / backward input (strides qs, qb, qn, 1)
    k_ptr,  # [S, B, G, D]: likewise (strides ks, kb, kg, 1)
    v_ptr,  # [S, B, G, D]: likewise (strides vs, vb, vg, 1)
    B, G,  # int: batch, query groups
    ms, mb, mg,  # int: mixed's strides over S, B, G
    qs, qb, qn, ks, kb, kg, vs, vb, vg,  # int: strides of q / k / v over S, B, heads
    P: tl.constexpr,  # query heads per group
    D: tl.constexpr,  # head dim
    R: tl.constexpr,  # rotary dim (even, <= D)
    BLOCK_H: tl.constexpr,  # heads of the mixed row per step
    BLOCK_D: tl.constexpr,  # next power of two >= D
    BACKWARD: tl.constexpr,
):
    """One program per (s, b) row walks the row's G (P + 2) heads (P query, one key, one value per group): query
    and key heads get the RoPE of _rope_kernel (forward, or its gradient), value heads are copied."""
    row = tl.program_id(0).to(tl.int64)  # = s * B + b
    s = row // B
    b = row - s * B
    half: tl.constexpr = R // 2
    cols = tl.arange(0, BLOCK_D)
    in_rot = cols < R
    partner = tl.where(cols < half, cols + half, cols - half)
    dt = mixed_ptr.dtype.element_ty
    c = tl.load(cos_ptr + s * R + cols, mask=in_rot, other=0.0).to(tl.float32)
    if BACKWARD:
        sn = tl.load(sin_ptr + s * R + partner, mask=in_rot, other=0.0).to(tl.float32)
    else:
        sn = tl.load(sin_ptr + s * R + cols, mask=in_rot, other=0.0).to(tl.float32)
    first_half = (cols < half)[None, :]
    in_head = (cols < D)[None, :]
    heads = tl.arange(0, BLOCK_H)
    for h0 in range(0, G * (P + 2), BLOCK_H):
        h = h0 + heads
        g = (h // (P + 2)).to(tl.int64)
        j = h % (P + 2)
        live = h < G * (P + 2)
        is_q, is_k = live & (j < P), live & (j == P)
        is_v = live & (j == P + 1)
        rot_head = (is_q | is_k)[:, None]
        m_off = (s * ms + b * mb + g * mg + j * D)[:, None]
        q_off = (s * qs + b * qb + (g * P + j) * qn)[:, None]
        k_off = (s * ks + b * kb + g * kg)[:, None]
        v_off = (s * vs + b * vb + g * vg)[:, None]
        ok = live[:, None] & in_head
        part = ok & rot_head & in_rot[None, :]
        if BACKWARD:  # the three gradients, one per head kind (where, not a sum: signed zeros stay)
            x = tl.where(is_q[:, None], tl.load(q_ptr + q_off + cols[None, :], mask=ok & is_q[:, None], other=0.0),
                         tl.where(is_k[:, None], tl.load(k_ptr + k_off + cols[None, :], mask=ok & is_k[:, None],
                                                         other=0.0),
                                  tl.load(v_ptr + v_off + cols[None, :], mask=ok & is_v[:, None], other=0.0)))
            xp = tl.where(is_q[:, None], tl.load(q_ptr + q_off + partner[None, :], mask=part & is_q[:, None],
                                                 other=0.0),
                          tl.load(k_ptr + k_off + partner[None, :], mask=part & is_k[:, None], other=0.0))
        else:
            x = tl.load(mixed_ptr + m_off + cols[None, :], mask=ok, other=0.0)
            xp = tl.load(mixed_ptr + m_off + partner[None, :], mask=part, other=0.0)
        x = x.to(tl.float32)
        xp = xp.to(tl.float32)
        direct = _rounded(x * c[None, :], dt)
        if BACKWARD:
            rotated = _rounded(xp * sn[None, :], dt)
            rotated = tl.where(first_half, rotated, -rotated)
        else:
            rotated = _rounded(tl.where(first_half, -xp, xp) * sn[None, :], dt)
        y = tl.where(in_rot[None, :], direct + rotated, x)
        if BACKWARD:
            y = y + 0.0  # as _rope_kernel: -0.0 -> +0.0 for query and key (autograd's sum with the unread slice)
        y = tl.where(rot_head, _rounded(y, dt), x).to(dt)  # value heads: the input as is
        if BACKWARD:
            tl.store(mixed_ptr + m_off + cols[None, :], y, mask=ok)
        else:
            tl.store(q_ptr + q_off + cols[None, :], y, mask=ok & is_q[:, None])
            tl.store(k_ptr + k_off + cols[None, :], y, mask=ok & is_k[:, None])
            tl.store(v_ptr + v_off + cols[None, :], y, mask=ok & is_v[:, None])


_QKV_ROPE = FastKernel(_qkv_rope_kernel, num_warps=NUM_WARPS, enable_fp_fusion=False)
_QKV_ROPE_SITES: dict = {}  # as _ROPE_SITES, keyed by every operand's shape and strides


def _qkv_site(mixed: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split_sizes, rot: int,
              backward: bool) -> tuple[LaunchSite, tuple]:
    key = (mixed.shape, mixed.stride(), q.stride(), k.stride(), v.stride(), mixed.dtype, tuple(split_sizes), rot,
           backward, mixed.device.index)
    entry = _QKV_ROPE_SITES.get(key)
    if entry is None:
        s, b, g, _ = mixed.shape
        p, d = split_sizes[0] // split_sizes[1], split_sizes[1]
        block_d = triton.next_power_of_2(d)
        block_h = max(1, min(triton.next_power_of_2(g * (p + 2)), MAX_TILE_ELEMS // block_d))
        tail = (b, g, *mixed.stride()[:3], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], p, d, rot, block_h,
                block_d, backward)
        entry = remember_site(_QKV_ROPE_SITES, key, (LaunchSite(_QKV_ROPE, (s * b,)), tail))
    return entry


def qkv_rope_fwd(mixed_SBGW: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor,
                 split_sizes: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of agoq.ref.rope.ref_qkv_rope_fwd (one launch)."""
    p, d = check_qkv_split(mixed_SBGW, split_sizes)
    s, b, g, _ = mixed_SBGW.shape
    rot = check_rope_args(mixed_SBGW[..., :d], cos_SR, sin_SR, what="mixed")
    if mixed_SBGW.stride(-1) != 1:
        mixed_SBGW = mixed_SBGW.contiguous()
    q = torch.empty((s, b, g * p, d), dtype=mixed_SBGW.dtype, device=mixed_SBGW.device)
    k = torch.empty((s, b, g, d), dtype=mixed_SBGW.dtype, device=mixed_SBGW.device)
    v = torch.empty_like(k)
    if q.numel():
        site, tail = _qkv_site(mixed_SBGW, q, k, v, split_sizes, rot, False)
        site(mixed_SBGW, cos_SR.contiguous(), sin_SR.contiguous(), q, k, v, *tail)
    return q, k, v


def qkv_rope_bwd(grad_q_SBND: torch.Tensor, grad_k_SBGD: torch.Tensor, grad_v_SBGD: torch.Tensor,
                 cos_SR: torch.Tensor, sin_SR: torch.Tensor, split_sizes: list) -> torch.Tensor:
    """Triton twin of agoq.ref.rope.ref_qkv_rope_bwd (one launch; the gradients may be strided over S, B, heads)."""
    s, b, g, d = grad_k_SBGD.shape
    grads = [t if t.stride(-1) == 1 else t.contiguous() for t in (grad_q_SBND, grad_k_SBGD, grad_v_SBGD)]
    grad_mixed = torch.empty((s, b, g, sum(split_sizes)), dtype=grad_k_SBGD.dtype, device=grad_k_SBGD.device)
    check_qkv_split(grad_mixed, split_sizes)
    rot = check_rope_args(grad_k_SBGD, cos_SR, sin_SR, what="grad")
    if grad_mixed.numel():
        site, tail = _qkv_site(grad_mixed, *grads, split_sizes, rot, True)
        site(grad_mixed, cos_SR.contiguous(), sin_SR.contiguous(), *grads, *tail)
    return grad_mixed
