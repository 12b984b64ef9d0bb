"""agoq.kernels.rope vs agoq.ref.rope: the same bits (every product rounded, then the sum; fp contraction off),
forward and backward, on odd shapes, strided inputs (query / key are views of the fused QKV output), a rotary
dim below the head dim, zeros (signed), outliers and non-finite values. The reference itself is compared with
Megatron's unfused RoPE in tests/megatron/test_rope.py."""

import math
import os

import pytest
import torch

from agoq.ref.rope import ref_rope_bwd, ref_rope_fwd

pytestmark = [pytest.mark.kernels]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# (S, B, N, D, R): one position, odd heads, head dim not a power of two, partial rotary dim, batch > 1
SHAPES = [(1, 1, 1, 2, 2), (5, 2, 3, 8, 8), (7, 1, 5, 24, 16), (3, 3, 33, 64, 64), (0, 1, 2, 8, 8)]
GPU_SHAPES = [(4096, 1, 32, 64, 64), (2048, 2, 8, 128, 128)]


def _freqs(s: int, rot: int, offset: int = 0) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    ang = torch.outer(torch.arange(offset, offset + s, dtype=torch.float32), inv)
    return torch.cat((ang, ang), dim=-1)


def _trig(s, rot, dtype):
    f = _freqs(s, rot)
    return torch.cos(f).to(dtype).to(DEVICE), torch.sin(f).to(dtype).to(DEVICE)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.float32: torch.int32}.get(x.dtype, torch.int16))


def _same_bits(out, ref):
    """Bit for bit (the sign of zero included); a NaN matches any NaN (its sign and payload are the hardware's)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    out, ref = out.cpu(), ref.cpu()
    assert torch.equal(out.isnan(), ref.isnan())
    keep = ~out.isnan()
    differ = int((_bits(out)[keep] != _bits(ref)[keep]).sum())
    assert differ == 0, f"{differ} elements differ"


def _strided(shape, dtype, gen, special=False):
    """A [S, B, N, D] view of a wider buffer (as Megatron's query inside the fused QKV output)."""
    s, b, n, d = shape
    buf = torch.randn((s, b, n + 3, d), generator=gen) * 4
    if special and buf.numel():
        flat = buf.view(-1)
        flat[:: max(1, flat.numel() // 9)] = 0.0
        flat[1 :: max(1, flat.numel() // 11)] = -0.0
        flat[2 :: max(1, flat.numel() // 13)] = 6.0e4
        # subnormal in fp32 and bf16 (zero in fp16); Triton 3.8's CPU interpreter converts bf16 subnormals wrongly
        # (a load of -1.0e-39 reads -4.4e-39), so there bf16 gets a small normal value and the GPU test the subnormal
        flat[3 :: max(1, flat.numel() // 17)] = -1.0e-30 if INTERPRET and dtype == torch.bfloat16 else -1.0e-39
    if special and buf.numel() > 40:
        buf.view(-1)[5] = math.inf
        buf.view(-1)[23] = math.nan
    return buf.to(dtype).to(DEVICE)[:, :, 1 : n + 1, :]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("special", [False, True])
def test_rope_kernels_match_reference_bits(shape, dtype, special):
    from agoq.kernels.rope import rope_bwd, rope_fwd

    s, b, n, d, rot = shape
    gen = torch.Generator().manual_seed(sum(shape))
    t = _strided((s, b, n, d), dtype, gen, special)
    g = _strided((s, b, n, d), dtype, gen, special)
    cos, sin = _trig(s, rot, dtype)
    assert t.stride(2) == d and (t.stride(1) != n * d or b == 1)  # heads strided inside a wider row
    _same_bits(rope_fwd(t, cos, sin), ref_rope_fwd(t, cos, sin))
    _same_bits(rope_bwd(g, cos, sin), ref_rope_bwd(g, cos, sin))
    _same_bits(rope_fwd(t.contiguous(), cos, sin), ref_rope_fwd(t, cos, sin))


def test_rope_kernel_copies_a_strided_last_dim_and_refuses_bad_shapes():
    from agoq.kernels.rope import rope_fwd

    gen = torch.Generator().manual_seed(3)
    t = _strided((4, 1, 2, 8), torch.bfloat16, gen).transpose(2, 3)  # last dim stride != 1, now [4, 1, 8, 2]
    cos, sin = _trig(4, 2, torch.bfloat16)
    _same_bits(rope_fwd(t, cos, sin), ref_rope_fwd(t, cos, sin))
    with pytest.raises(ValueError, match="even rotary_dim"):
        rope_fwd(t, *_trig(4, 4, torch.bfloat16))  # rotary dim 4 > head dim 2
    with pytest.raises(ValueError, match="dtype"):
        rope_fwd(t, *_trig(4, 2, torch.float32))
    with pytest.raises(ValueError, match="bshd"):
        rope_fwd(t[0], cos, sin)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels at a model's size need a GPU")
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_rope_kernels_match_reference_bits_gpu_sizes(shape):
    """At a model's sizes, with every launch site checking its contract (the full launch key recomputed per call):
    the second and later calls of a shape launch directly, with the same bits."""
    from agoq.kernels import rope
    from agoq.kernels.fastlaunch import set_check_sites

    previous = set_check_sites(True)
    try:
        for _ in range(3):
            test_rope_kernels_match_reference_bits(shape, torch.bfloat16, special=True)
    finally:
        set_check_sites(previous)
    assert sum(site.direct_calls for site, _ in rope._ROPE_SITES.values()) > 0


# (S, B, G, P, D, R): Megatron's fused QKV output [S, B, G, (P + 2) D]: one group, GQA with odd groups, MHA (P = 1),
# a partial rotary dim, head dim not a power of two
QKV_SHAPES = [(1, 1, 1, 1, 2, 2), (5, 2, 3, 4, 8, 8), (7, 1, 2, 3, 24, 16), (3, 2, 5, 1, 64, 64), (0, 1, 2, 2, 8, 8)]
QKV_GPU_SHAPES = [(4096, 1, 8, 4, 64, 64), (2048, 2, 4, 2, 128, 128)]


def _permuted_grad(shape, dtype, gen, special):
    """An [S, B, H, D] gradient laid out [B, H, S, D] in memory (SDPA's backward through agoq's permutes)."""
    s, b, h, d = shape
    return _strided((b, h, s, d), dtype, gen, special).contiguous().permute(2, 0, 1, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", QKV_SHAPES)
@pytest.mark.parametrize("special", [False, True])
def test_qkv_rope_kernels_match_reference_bits(shape, dtype, special):
    """The QKV split + RoPE kernel = the reference (Megatron's split, reshape, RoPE per tensor, value copied) in
    both directions, with the gradients strided as SDPA's backward hands them and signed zeros kept."""
    from agoq.kernels.rope import qkv_rope_bwd, qkv_rope_fwd
    from agoq.ref.rope import ref_qkv_rope_bwd, ref_qkv_rope_fwd

    s, b, g, p, d, rot = shape
    split = [p * d, d, d]
    gen = torch.Generator().manual_seed(sum(shape) + 7)
    mixed = _strided((s, b, g, (p + 2) * d), dtype, gen, special)  # groups strided inside a wider row
    cos, sin = _trig(s, rot, dtype)
    for out, ref in zip(qkv_rope_fwd(mixed, cos, sin, split), ref_qkv_rope_fwd(mixed, cos, sin, split), strict=True):
        _same_bits(out, ref)
    grads = [_permuted_grad((s, b, h, d), dtype, gen, special) for h in (g * p, g, g)]
    _same_bits(qkv_rope_bwd(*grads, cos, sin, split), ref_qkv_rope_bwd(*grads, cos, sin, split))
    contiguous = [t.contiguous() for t in grads]
    _same_bits(qkv_rope_bwd(*contiguous, cos, sin, split), ref_qkv_rope_bwd(*grads, cos, sin, split))


def test_qkv_rope_reference_is_split_then_rope_and_refuses_bad_splits():
    """The reference's query / key are agoq's RoPE of Megatron's split views; value is the split view's values."""
    from agoq.kernels.rope import qkv_rope_fwd
    from agoq.ref.rope import ref_qkv_rope_fwd

    s, b, g, p, d = 6, 2, 3, 2, 8
    mixed = torch.randn(s, b, g, (p + 2) * d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    cos, sin = _trig(s, d, torch.bfloat16)
    q, k, v = ref_qkv_rope_fwd(mixed, cos.cpu(), sin.cpu(), [p * d, d, d])
    query, key, value = torch.split(mixed, [p * d, d, d], dim=3)
    assert torch.equal(q, ref_rope_fwd(query.reshape(s, b, g * p, d), cos.cpu(), sin.cpu()))
    assert torch.equal(k, ref_rope_fwd(key, cos.cpu(), sin.cpu())) and torch.equal(v, value)
    assert not torch.equal(q, query.reshape(s, b, g * p, d))  # the rotation did something
    with pytest.raises(ValueError, match=r"split sizes \[P\*D, D, D\]"):
        qkv_rope_fwd(mixed.to(DEVICE), cos, sin, [p * d, d, d + 1])
    with pytest.raises(ValueError, match=r"split sizes \[P\*D, D, D\]"):
        qkv_rope_fwd(mixed.to(DEVICE), cos, sin, [p * d + 1, d, d])
    with pytest.raises(ValueError, match=r"split sizes \[P\*D, D, D\]"):  # no query heads: k / v would be unwritten
        qkv_rope_fwd(mixed[..., p * d:].to(DEVICE), cos, sin, [0, d, d])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels at a model's size need a GPU")
@pytest.mark.parametrize("shape", QKV_GPU_SHAPES)
def test_qkv_rope_kernels_match_reference_bits_gpu_sizes(shape):
    """At a ~1B / 8B layer's sizes, with every launch site checking its contract."""
    from agoq.kernels import rope
    from agoq.kernels.fastlaunch import set_check_sites

    previous = set_check_sites(True)
    try:
        for _ in range(3):
            test_qkv_rope_kernels_match_reference_bits(shape, torch.bfloat16, special=True)
    finally:
        set_check_sites(previous)
    assert sum(site.direct_calls for site, _ in rope._QKV_ROPE_SITES.values()) > 0
