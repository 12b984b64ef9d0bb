"""agoq.kernels.swiglu_quant (SwiGLU fused with quantize / dequantize of fc1's output) vs agoq.ref.swiglu_quant.

Tolerances:
- codes and scales: identical (integers; NaN scales of non-finite blocks compared as NaN), the same
  contract as agoq.kernels.quant;
- z of swiglu_quantize: bitwise on GPU (the kernel reproduces ATen's silu and product, see the kernel's
  docstring); the CPU interpreter truncates fp32 -> bf16 and uses numpy's exp: within 2 output ulp;
- dequant_swiglu_fwd / _bwd: as agoq.kernels.swiglu vs its reference (fp32 math, exp differs by a few
  fp32 ulp: one output ulp, two in the interpreter, plus 2**-20 x max|ref| near silu''s zero crossing).
  NaN / Inf positions must match exactly (a non-finite block dequantizes to NaN).
"""

import os

import pytest
import torch

from agoq.formats import parse_format
from agoq.ref.quant import ref_dequantize
from agoq.ref.swiglu_quant import ref_dequant_swiglu_bwd, ref_dequant_swiglu_fwd, ref_swiglu_quantize

pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)
# fp8 quantize is GPU-only (the interpreter's fp32 -> fp8 cast does not round ties to even)
FORMATS = ["nf4_b64", "int8_b128", "int4_b64", "int6_b64_sp2", "cint8_b32", "int4_b32_s16"] + (
    ["fp8e4m3_b128"] if DEVICE == "cuda" else [])
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}


def _ffn(fmt, tiles):
    """An FFN width that is a multiple of the block: ``tiles`` tiles of the kernel plus one block."""
    from agoq.kernels.swiglu_quant import TILE_ELEMS

    return tiles * TILE_ELEMS + fmt.block if tiles else fmt.block


def _h(lead, ffn, dtype, kind, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn((*lead, 2 * ffn), generator=gen) * 3
    flat = h.view(-1, 2 * ffn)
    if kind == "outliers":
        flat[:, ::97] = 90.0  # exp(-90) underflows; silu = x
        flat[:, 5::101] = -90.0  # exp(90) is inf in fp32: silu = -0
        flat[0, 7] = 3e4
    elif kind == "zeros":
        flat[0] = 0.0  # all-zero blocks: scale 0, codes of 0
    elif kind == "nonfinite":
        flat[0, 3] = float("nan")
        flat[-1, ffn + 1] = float("inf")  # an up block
        flat[-1, 2] = float("-inf")  # a gate block
    return h.to(dtype).to(DEVICE)


def _same_codes(q, r):
    assert torch.equal(q.codes, r.codes), "codes differ"
    a, b = q.scales, r.scales
    if a.dtype.is_floating_point:
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), "scales differ"
    else:
        assert torch.equal(a, b), "scales differ"


def _close(out, ref, ulps):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    assert torch.equal(o.isnan(), r.isnan()), "NaN positions differ"
    fin = torch.isfinite(r)
    assert torch.equal(o[~fin & ~r.isnan()], r[~fin & ~r.isnan()]), "Inf values differ"
    o, r = o[fin], r[fin]
    floor = 2.0**-20 * (r.abs().max().item() if r.numel() else 0.0)
    bad = (o - r).abs() > ulps * ULP[out.dtype] * r.abs() + floor
    assert not bad.any(), f"{int(bad.sum())} elements off; worst {(o - r).abs().max().item():.3g}"


CASES = [((1,), 0), ((3,), 1), ((2, 3), 0)] + ([((5,), 2)] if DEVICE == "cuda" else [])  # rows x (tiles + 1 block)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("lead,tiles", CASES, ids=[f"{c[0]}x{c[1]}" for c in CASES])
@pytest.mark.parametrize("kind", ["normal", "outliers", "zeros", "nonfinite"])
def test_swiglu_quantize_codes_exact_and_z_megatron(name, lead, tiles, kind):
    from agoq.kernels.swiglu_quant import swiglu_quantize

    fmt = parse_format(name)
    h = _h(lead, _ffn(fmt, tiles), torch.bfloat16, kind)
    z, q = swiglu_quantize(h, fmt)
    z_ref, q_ref = ref_swiglu_quantize(h, fmt)
    _same_codes(q, q_ref)
    assert q.shape == h.shape and q.dtype == h.dtype and q.fmt == fmt
    if DEVICE == "cuda":
        assert torch.equal(z.isnan(), z_ref.isnan()) and torch.equal(z[~z.isnan()], z_ref[~z_ref.isnan()])
    else:
        _close(z, z_ref, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu_quantize_other_dtypes(dtype):
    from agoq.kernels.swiglu_quant import swiglu_quantize

    fmt = parse_format("int8_b128")
    h = _h((3,), _ffn(fmt, 1), dtype, "normal")
    z, q = swiglu_quantize(h, fmt)
    z_ref, q_ref = ref_swiglu_quantize(h, fmt)
    _same_codes(q, q_ref)
    _close(z, z_ref, 0 if DEVICE == "cuda" else 2)


def _scale(mode, lead, ffn, seed=3):
    gen = torch.Generator().manual_seed(seed)
    if mode == "none":
        return None
    shape = (*lead, 1) if mode == "per_token" else (ffn,)
    return torch.exp2(torch.randint(-3, 4, shape, generator=gen).float()).to(DEVICE)


DQ_CASES = [(n, "none") for n in ("nf4_b64", "int8_b128", "int4_b64", "cint8_b32", "int6_b64_sp2")] + [
    ("nf4_b64", "per_token"), ("int8_b128", "per_channel")]


@pytest.mark.parametrize("name,mode", DQ_CASES)
@pytest.mark.parametrize("lead,tiles", CASES, ids=[f"{c[0]}x{c[1]}" for c in CASES])
@pytest.mark.parametrize("kind", ["normal", "nonfinite"])
def test_dequant_swiglu_fwd_bwd_match_reference(name, mode, lead, tiles, kind):
    from agoq.kernels.quant import quantize
    from agoq.kernels.swiglu_quant import dequant_swiglu_bwd, dequant_swiglu_fwd

    fmt = parse_format(name)
    ffn = _ffn(fmt, tiles)
    h = _h(lead, ffn, torch.bfloat16, kind, seed=1)
    q = quantize(h, fmt)
    gen = torch.Generator().manual_seed(2)
    gz = torch.randn((*lead, ffn), generator=gen).to(torch.bfloat16).to(DEVICE)
    s = _scale(mode, lead, ffn)
    if INTERPRET:  # the interpreter truncates the dequantized bf16 values: compare at the kernel's own point
        from agoq.kernels.quant import dequantize
        from agoq.ref.swiglu import ref_swiglu_bwd_scaled, ref_swiglu_scaled

        h_hat = dequantize(q)
        _close(dequant_swiglu_fwd(q, s), ref_swiglu_scaled(h_hat, s), 2)
        _close(dequant_swiglu_bwd(q, gz, s), ref_swiglu_bwd_scaled(h_hat, gz, s), 2)
    else:
        _close(dequant_swiglu_fwd(q, s), ref_dequant_swiglu_fwd(q, s), 1)
        _close(dequant_swiglu_bwd(q, gz, s), ref_dequant_swiglu_bwd(q, gz, s), 1)


def test_dequant_swiglu_equals_unfused_kernels_bitwise():
    """Same dequantized bits, same swiglu expressions: the fused backward kernels give exactly what
    dequantize followed by agoq.kernels.swiglu gives."""
    from agoq.kernels.quant import dequantize, quantize
    from agoq.kernels.swiglu import swiglu_bwd, swiglu_fwd
    from agoq.kernels.swiglu_quant import dequant_swiglu_bwd, dequant_swiglu_fwd

    fmt = parse_format("nf4_b64")
    h = _h((4,), _ffn(fmt, 1), torch.bfloat16, "outliers")
    q = quantize(h, fmt)
    gz = torch.randn((4, h.shape[-1] // 2)).to(torch.bfloat16).to(DEVICE)
    h_hat = dequantize(q)
    assert torch.equal(dequant_swiglu_fwd(q), swiglu_fwd(h_hat))
    assert torch.equal(dequant_swiglu_bwd(q, gz), swiglu_bwd(h_hat, gz))
    if not INTERPRET:
        assert torch.equal(h_hat, ref_dequantize(q))


def test_fusable_rule_and_errors():
    from agoq.kernels.swiglu_quant import dequant_swiglu_fwd, fusable, swiglu_quantize

    fmt = parse_format("int8_b128")
    h = _h((2,), 128, torch.bfloat16, "normal")
    assert fusable(h, fmt)
    assert not fusable(_h((2,), 96, torch.bfloat16, "normal"), fmt)  # F not a multiple of the block
    assert not fusable(h[:, :128], fmt)  # not contiguous
    assert not fusable(h, parse_format("int8_b128_sr"))  # stochastic rounding
    assert not fusable(h, parse_format("bf16"))
    with pytest.raises(ValueError, match="not fusable"):
        swiglu_quantize(_h((2,), 96, torch.bfloat16, "normal"), fmt)
    from agoq.kernels.quant import quantize

    with pytest.raises(ValueError, match="not fusable"):
        dequant_swiglu_fwd(quantize(_h((2,), 96, torch.bfloat16, "normal"), fmt))


@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth-per-token"])
def test_saving_input_fused_path_end_to_end(monkeypatch, smooth):
    """agoq.ops.saved_swiglu on the fused path (forced on the interpreter's CPU tensors): forward values,
    exact bytes, fc2's recomputed input and the gradient equal the unfused kernels' (same tensor
    dequantized), and the quantized copy is released after backward."""
    from agoq.kernels.quant import dequantize
    from agoq.kernels.swiglu import swiglu_bwd, swiglu_fwd
    from agoq.kernels.swiglu_quant import fusable
    from agoq.ops import saved_act, saved_swiglu
    from agoq.ref.swiglu import smooth_scale_per_token

    monkeypatch.setattr(saved_swiglu, "_swiglu_fused",
                        lambda h, fmt, offset, fuse=True: fuse and not offset and fusable(h, fmt))
    fmt = parse_format("nf4_b64")
    h = _h((3, 2), _ffn(fmt, 1), torch.bfloat16, "outliers").requires_grad_(True)
    gz = torch.randn((3, 2, h.shape[-1] // 2)).to(torch.bfloat16).to(DEVICE)
    counter = saved_act.SavedBytesCounter()
    if smooth:
        z, s, stash = saved_swiglu.smooth_swiglu_saving_input(h, lambda t, glu: smooth_scale_per_token(t), fmt,
                                                              (1, "mlp.swiglu_input"), counter)
        _close(z, saved_swiglu._smoothed(saved_swiglu.swiglu_reference(h.detach()), s), 0)
    else:
        s = None
        z, stash = saved_swiglu.swiglu_saving_input(h, fmt, (1, "mlp.swiglu_input"), counter)
        _close(z, saved_swiglu.swiglu_reference(h.detach()), 0 if DEVICE == "cuda" else 2)
    assert stash.from_codes and stash.output_ptr == z.data_ptr()
    assert counter.packed == {(1, "mlp.swiglu_input"): fmt.storage_bytes(h.numel())}
    h_hat = dequantize(stash.q)
    assert torch.equal(stash.recomputed_output(), swiglu_fwd(h_hat, s))
    (gh,) = torch.autograd.grad(z, (h,), gz)
    assert torch.equal(gh, swiglu_bwd(h_hat, gz, s))
    assert stash.q is None
    del stash, h_hat
    assert counter.live == 0
