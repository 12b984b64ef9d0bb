"""agoq.kernels.swiglu.swiglu_bwd vs agoq.ref.swiglu.ref_swiglu_bwd_scaled (and the reference vs autograd).

Tolerance: kernel and reference both compute in fp32 and round once to the output dtype; they differ
in ``exp`` (a few fp32 ulp), so the outputs agree within one output-dtype ulp of the value, plus an
absolute floor of 2**-20 x max|ref| for values near silu''s zero crossing (gate ~ -1.28), where the
factor 1 + gate(1 - sigmoid) cancels. The CPU interpreter truncates fp32 -> bf16 casts (one more ulp).
"""

import os

import pytest
import torch

from agoq.ref.swiglu import ref_swiglu, ref_swiglu_bwd_scaled, ref_swiglu_scaled

pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
SHAPES = [(1, 2), (3, 14), (2, 3, 2 * 1030), (0, 8)]  # one element pair, odd F, tail past one block, empty
GPU_SHAPES = [(4096, 2 * 5632), (2, 2048, 2 * 14336)]
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}


def _scale(mode: str, shape: tuple, gen: torch.Generator):
    ffn = shape[-1] // 2
    if mode == "none":
        return None
    if mode == "per_token":
        return torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float()).to(DEVICE)
    return torch.exp2(torch.randint(-3, 4, (ffn,), generator=gen).float()).to(DEVICE)


def _inputs(shape, dtype, seed=0, outliers=False):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(shape, generator=gen) * 3
    if outliers and h.numel():
        h.view(-1)[:: max(1, h.numel() // 5)] = torch.tensor(90.0)  # exp(-90) underflows towards 0
        h.view(-1)[1 :: max(1, h.numel() // 7)] = torch.tensor(-90.0)  # exp(+90) ~ 1e39: inf in fp32
    gz = torch.randn((*shape[:-1], shape[-1] // 2), generator=gen)
    return h.to(dtype).to(DEVICE), gz.to(dtype).to(DEVICE), gen


def _check_close(out: torch.Tensor, ref: torch.Tensor):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    ulps = 2 if INTERPRET and out.dtype == torch.bfloat16 else 1
    floor = 2.0**-20 * (r.abs().max().item() if r.numel() else 0.0)
    bound = ulps * ULP[out.dtype] * r.abs() + floor
    bad = (o - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off; worst {(o - r).abs().max().item():.3g}"


def _run(shape, dtype, mode, outliers=False):
    from agoq.kernels.swiglu import swiglu_bwd, swiglu_fwd

    h, gz, gen = _inputs(shape, dtype, outliers=outliers)
    s = _scale(mode, shape, gen)
    _check_close(swiglu_bwd(h, gz, s), ref_swiglu_bwd_scaled(h, gz, s))
    _check_close(swiglu_fwd(h, s), ref_swiglu_scaled(h, s))


@pytest.mark.parametrize("mode", ["none", "per_token", "per_channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_bwd_matches_reference(shape, dtype, mode):
    _run(shape, dtype, mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_bwd_outliers(dtype):
    _run((4, 2 * 600), dtype, "none", outliers=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_swiglu_bwd_llama_shapes(shape):
    _run(shape, torch.bfloat16, "per_token")


def test_swiglu_fwd_nan_propagates_and_rejects_odd_width():
    from agoq.kernels.swiglu import swiglu_fwd

    h, _, _ = _inputs((2, 8), torch.float32)
    h[0, 5] = float("nan")  # up column 1 of row 0
    out = swiglu_fwd(h)
    assert out[0, 1].isnan() and out[0, 0].isfinite() and out[1].isfinite().all()
    with pytest.raises(ValueError, match="odd last dim"):
        swiglu_fwd(h[:, :7])


def test_swiglu_bwd_nan_propagates():
    from agoq.kernels.swiglu import swiglu_bwd

    h, gz, _ = _inputs((2, 8), torch.float32)
    h[0, 1] = float("nan")  # gate column 1 of row 0 -> both halves of that column
    gz[1, 2] = float("inf")
    out = swiglu_bwd(h, gz)
    assert out[0, 1].isnan() and out[0, 5].isnan()
    assert not out[1, 2].isfinite() and not out[1, 6].isfinite()
    assert out[0, 0].isfinite() and out[1, 0].isfinite()


def test_swiglu_bwd_rejects_bad_shapes():
    from agoq.kernels.swiglu import swiglu_bwd

    h, gz, _ = _inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        swiglu_bwd(h, gz[:, :3])
    with pytest.raises(ValueError, match="neither per-token"):
        swiglu_bwd(h, gz, torch.ones(3, device=h.device))
    with pytest.raises(ValueError, match="float32"):
        swiglu_bwd(h, gz, torch.ones(4, dtype=torch.float16, device=h.device))


@pytest.mark.parametrize("mode", ["none", "per_token", "per_channel"])
def test_reference_matches_autograd_fp64(mode):
    """The reference against autograd of z = swiglu(h) / s in float64 (an independent derivation)."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, 2 * 9, generator=gen, dtype=torch.float64)
    gz = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    s = {"none": None, "per_token": torch.full((5, 1), 2.0), "per_channel": torch.full((9,), 0.5)}[mode]
    hh = h.clone().requires_grad_(True)
    z = ref_swiglu(hh) if s is None else ref_swiglu(hh) / s.double()
    (expected,) = torch.autograd.grad(z, hh, gz)
    torch.testing.assert_close(ref_swiglu_bwd_scaled(h, gz, s), expected, rtol=1e-12, atol=1e-12)
