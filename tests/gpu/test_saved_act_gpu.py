"""GPU paths of agoq.ops.saved_act / saved_norm / saved_swiglu: ATen's fused RMSNorm backward, fused SwiGLU backward.

The CUDA RMSNorm backward calls aten::_fused_rms_norm_backward directly (no re-entrant autograd);
autograd of F.rms_norm runs the same op on CUDA, so the gradients must be the same bits. The fused
SwiGLU backward computes in fp32 with one rounding (tolerance argued in tests/kernels/test_swiglu_kernels.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agoq.formats import parse_format
from agoq.ops.saved_norm import rmsnorm_saving_input
from agoq.ops.saved_swiglu import swiglu_saving_input
from agoq.ref.swiglu import ref_swiglu_bwd_scaled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FMT = parse_format("nf4_b64")


def _inputs(shape, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    return x, w, g


@pytest.mark.parametrize("recompute_first", [False, True], ids=["norm-only", "linear-recomputes-first"])
def test_rmsnorm_cuda_backward_bit_identical_to_autograd(recompute_first):
    x, w, g = _inputs((3, 257, 2048))
    y, stash = rmsnorm_saving_input(x, w, 1e-5, FMT, (0, "norm_in"))
    x_hat = stash.dequantized().detach().clone()  # the tensor backward will use
    if recompute_first:  # the next linear's wgrad rebuilds y first; the norm then reuses its rstd
        y_re = stash.recomputed_output()
        torch.testing.assert_close(y_re, F.rms_norm(x_hat, (2048,), w.detach(), 1e-5), rtol=0, atol=0)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    xr = x_hat.requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    ex, ew = torch.autograd.grad(F.rms_norm(xr, (2048,), wr, 1e-5), (xr, wr), g)
    assert torch.equal(gx, ex) and torch.equal(gw, ew)


def test_swiglu_saving_input_cuda_backward_matches_reference():
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(2, 129, 2 * 1536, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    gz = torch.randn(2, 129, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    z, stash = swiglu_saving_input(h, FMT, (0, "swiglu_in"))
    h_hat = stash.dequantized().detach().clone()
    (gh,) = torch.autograd.grad(z, (h,), gz)
    expected = ref_swiglu_bwd_scaled(h_hat, gz)
    err = (gh.float() - expected.float()).abs()
    assert (err <= 2.0**-7 * expected.float().abs() + 2.0**-20 * expected.float().abs().max()).all()


def test_swiglu_recompute_close_to_megatron_ops():
    """fc2's input rebuilt in backward by the fused kernel vs Megatron's silu(gate) * up on the same
    dequantized tensor: ATen rounds silu to bf16 before the product, the kernel rounds once, so they
    agree within 2 bf16 ulp."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(3, 65, 2 * 1100, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    _, stash = swiglu_saving_input(h, FMT, (0, "swiglu_in"))
    h_hat = stash.dequantized()
    gate, up = h_hat.chunk(2, dim=-1)
    expected = (F.silu(gate) * up).float()
    got = stash.recomputed_output().float()
    assert ((got - expected).abs() <= 2 * 2.0**-7 * expected.abs() + 1e-30).all()


def test_swiglu_fused_forward_is_megatron_bitwise_and_codes_reference():
    """The fused forward (agoq.kernels.swiglu_quant.swiglu_quantize) keeps Megatron's forward values and
    stores the reference's codes."""
    from agoq.ref.quant import ref_quantize

    gen = torch.Generator(device="cuda").manual_seed(3)
    h = (3 * torch.randn(2, 129, 2 * 1536, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_(True)
    z, stash = swiglu_saving_input(h, FMT, (0, "swiglu_in"))
    gate, up = h.detach().chunk(2, dim=-1)
    assert stash.from_codes, "CUDA + F % block == 0 must take the fused path"
    assert torch.equal(z, F.silu(gate) * up)
    ref = ref_quantize(h.detach(), FMT)
    assert torch.equal(stash.q.codes, ref.codes) and torch.equal(stash.q.scales, ref.scales)


def test_swiglu_fused_backward_bitwise_equal_to_unfused_path():
    """Fused backward (codes read directly) == the unfused path (dequantize, swiglu_fwd / swiglu_bwd)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    h = torch.randn(3, 65, 2 * 1088, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    gz = torch.randn(3, 65, 1088, device="cuda", generator=gen).to(torch.bfloat16)
    grads, recomputed = [], []
    for fused in (True, False):
        z, stash = swiglu_saving_input(h, FMT, (0, "swiglu_in"), fuse=fused)
        assert stash.from_codes == fused
        recomputed.append(stash.recomputed_output())
        grads.append(torch.autograd.grad(z, (h,), gz)[0])
    assert torch.equal(recomputed[0], recomputed[1]) and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("name", ["nf4_b64", "int8_b128", "int4_b64", "fp8e4m3_b128", "cint8_b32"])
def test_direct_launch_equals_triton_launch(name):
    """agoq.kernels.fastlaunch: the cached direct launch gives what Triton's own launch gives, also for
    an unaligned view and sizes whose specialization differs (not a multiple of 16, one block)."""
    from agoq.kernels import fastlaunch
    from agoq.kernels.quant import dequantize, quantize

    fmt = parse_format(name)
    base = torch.randn(4 * 4096 + 8, device="cuda").to(torch.bfloat16)
    for x in (base[: 4 * 4096], base[1 : 1 + 4097], base[:fmt.block], base[:4096]):
        outs = []
        for fast in (True, True, False):  # the first fast call may compile; the second is direct
            previous = fastlaunch.set_fast_launch(fast)
            try:
                q = quantize(x, fmt)
                outs.append((q, dequantize(q)))
            finally:
                fastlaunch.set_fast_launch(previous)
        for q, y in outs[1:]:
            assert torch.equal(q.codes, outs[0][0].codes)
            assert torch.equal(q.scales.view(torch.uint8), outs[0][0].scales.view(torch.uint8))
            assert torch.equal(y.view(torch.int16), outs[0][1].view(torch.int16))


@pytest.mark.parametrize("name", ["nf4_b64", "int8_b128", "fp8e4m3_b128"])
def test_launch_sites_equal_tritons_launch(name):
    """agoq.kernels.fastlaunch.LaunchSite (quantize, dequantize and the fused SwiGLU kernels keep one per
    format / shape / dtype / device): repeated calls launch directly, under the check mode that recomputes
    the full key per call, and give Triton's own launch's bits."""
    from agoq.kernels import fastlaunch, quant, swiglu_quant

    fmt = parse_format(name)
    h = torch.randn(3, 2 * 512, device="cuda").to(torch.bfloat16)
    gz = torch.randn(3, 512, device="cuda").to(torch.bfloat16)

    def run_all():
        q = quant.quantize(h, fmt)
        z, qh = swiglu_quant.swiglu_quantize(h, fmt)
        return [q.codes, q.scales.view(torch.uint8), quant.dequantize(q).view(torch.int16), z.view(torch.int16),
                qh.codes, swiglu_quant.dequant_swiglu_fwd(qh).view(torch.int16),
                swiglu_quant.dequant_swiglu_bwd(qh, gz).view(torch.int16)]

    previous = fastlaunch.set_fast_launch(False)
    try:
        expected = run_all()
    finally:
        fastlaunch.set_fast_launch(previous)
    checking = fastlaunch.set_check_sites(True)
    try:
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(run_all(), expected, strict=True))
    finally:
        fastlaunch.set_check_sites(checking)
    site = quant._QUANT_SITES[(fmt, h.numel(), h.dtype, h.device.index)]
    assert site.launch.direct_calls >= 2


def test_launch_site_caches_stay_within_their_bound(monkeypatch):
    """Every size brings a new launch site; the per-size caches keep at most _launch.MAX_LAUNCH_SITES
    (lowered to 4 here) and the newest site still launches directly."""
    from agoq.kernels import _launch, quant, swiglu_quant

    monkeypatch.setattr(_launch, "MAX_LAUNCH_SITES", 4)
    saved = [dict(c) for c in (quant._QUANT_SITES, quant._DEQUANT_SITES, swiglu_quant._FWD_SITES,
                              swiglu_quant._DQ_SITES)]
    try:
        for rows in range(1, 11):
            h = torch.randn(rows, 2 * 128, device="cuda").to(torch.bfloat16)
            q = quant.quantize(h, FMT)
            quant.dequantize(q)
            quant.quantize(h, FMT)  # the site's own path
            _, qh = swiglu_quant.swiglu_quantize(h, FMT)
            swiglu_quant.dequant_swiglu_fwd(qh)
        for cache in (quant._QUANT_SITES, quant._DEQUANT_SITES, swiglu_quant._FWD_SITES, swiglu_quant._DQ_SITES):
            assert 0 < len(cache) <= 4
        newest = quant._QUANT_SITES[(FMT, h.numel(), h.dtype, h.device.index)]
        assert newest.launch.direct_calls >= 1
    finally:
        for cache, before in zip((quant._QUANT_SITES, quant._DEQUANT_SITES, swiglu_quant._FWD_SITES,
                                  swiglu_quant._DQ_SITES), saved, strict=True):
            cache.clear()
            cache.update(before)
