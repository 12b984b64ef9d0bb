"""agoq.kernels.smooth_swiglu_fp8 vs agoq.ref.smooth_swiglu_fp8 (Smooth-SwiGLU per token and per channel, and
the plain mode ``amax=None``: SwiGLU cast for a plain FP8 fc2, s = 1), and the ``mul`` argument of
agoq.kernels.fp8_fused's delayed cast vs agoq.ref.fp8.ref_fp8_cast_delayed_2d.

CPU: ``TRITON_INTERPRET=1 python -m pytest tests/kernels -m "not gpu"``; GPU: ``python -m pytest tests/kernels``.
Everything is compared exactly (codes as bytes, s, scale_a, amax and the new meta bit for bit):
- the amaxes and s are exact arithmetic (max of magnitudes, power-of-two rounding from the bits);
- under the interpreter, numpy's exp and the interpreter's fp32 -> fp8 conversion differ from CUDA's
  (agoq.kernels.fp8_fused's note), so the interpreter tests feed h whose SwiGLU is exact in both: gate in
  {0, 32, 64, -128} (silu = gate, or -0 through exp overflow) and up on the E4M3 grid, with power-of-two
  scales, so every product and cast is exact; random data (any rounding) is compared on GPU only.
"""

from __future__ import annotations

import os

import pytest
import torch

from agoq.ref.fp8 import FP8_DTYPES, ref_fp8_cast_delayed_2d
from agoq.ref.smooth_swiglu_fp8 import ref_smooth_swiglu_amax, ref_smooth_swiglu_cast_delayed

pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
GPU_ROUNDING = pytest.mark.gpu(reason="interpreter exp and fp32->fp8 conversion differ from CUDA's (Triton 3.8)")
# (tokens, F): one element, odd sizes, several programs in both grid dims and a partial strip, empty
SHAPES = [(1, 1), (3, 7), (70, 130), (300, 65), (0, 8)]


def _k():
    from agoq.kernels import smooth_swiglu_fp8  # imported late: TRITON_INTERPRET is read when triton is imported

    return smooth_swiglu_fp8


def _grid_h(tokens, ffn, dtype=torch.bfloat16, seed=0, up_scale=1.0):
    """h whose SwiGLU is exact everywhere: up on the E4M3 grid with |up| in [2**-3, 2**4) or 0 (after any
    power-of-two division the codes stay normal: no rounding in the cast)."""
    gen = torch.Generator().manual_seed(seed)
    gate = torch.tensor([0.0, 32.0, 64.0, -128.0])[torch.randint(0, 4, (tokens, ffn), generator=gen)]
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = vals[torch.isfinite(vals) & (((vals.abs() >= 2.0**-3) & (vals.abs() < 2.0**4)) | (vals == 0))]
    up = grid[torch.randint(0, grid.numel(), (tokens, ffn), generator=gen)] * up_scale
    return torch.cat([gate, up], dim=-1).to(dtype).to(DEVICE)


def _meta(scale=16.0, history=(3.0, 2.0, 0.0, 0.0)):
    head = [1.0 / scale, scale, 0.0, 0.0]
    return torch.tensor(head + list(history), dtype=torch.float32, device=DEVICE)


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    a, b = a.cpu(), b.cpu()
    if a.dtype in FP8_DTYPES.values():
        return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        a.nan_to_num(0.0), b.nan_to_num(0.0))


def _check_cast(h, per_token, amax=None, **layout):
    """per_token True / False: Smooth-SwiGLU with ``amax`` (default: the reference's); None: the plain mode."""
    if per_token is None:
        per_token, amax = False, None
    else:
        amax = ref_smooth_swiglu_amax(h, per_token) if amax is None else amax
    ws = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = _k().smooth_swiglu_cast_delayed(h, amax, "e4m3", _meta(), ws, per_token=per_token, **layout)
    ref = ref_smooth_swiglu_cast_delayed(h, amax, "e4m3", _meta(), ws, per_token=per_token, **layout)
    for name, a, b in zip(("out", "out_t", "new_meta", "s", "scale_a"), out, ref, strict=True):
        assert _same(a, b), name
    assert not ws.any()  # the workspace is zero again


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_token", [True, False])
def test_amax_matches_reference(shape, per_token):
    h = _grid_h(*shape)
    assert _same(_k().smooth_swiglu_amax(h, per_token), ref_smooth_swiglu_amax(h, per_token))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_token", [True, False, None])
@pytest.mark.parametrize("layout", [dict(transposed=True, t_colmajor=True), dict(), dict(rowmajor=False,
                                                                                      transposed=True)])
def test_cast_matches_reference(shape, per_token, layout):
    _check_cast(_grid_h(*shape), per_token, **layout)


@pytest.mark.parametrize("per_token", [True, False, None])
def test_cast_zeros_outliers_and_saturation(per_token):
    """All-zero rows / channels (amax 0: s = 1), an outlier 2**4 above the rest, and values past the FP8
    range at the given delayed scale (saturated, not inf); per_token None: the plain mode."""
    h = _grid_h(40, 96)
    h[5] = 0
    h[:, 96 + 7] = 0  # one up channel zero
    h[9, 96 + 3] = 2.0**8  # |z| * scale up to 64 * 16: past E4M3's 448 elsewhere
    _check_cast(h, per_token, transposed=True, t_colmajor=True)


def test_plain_cast_has_no_scale_outputs():
    """amax=None (plain SwiGLU for a plain FP8 fc2): s and scale_a are None, the codes are those of the plain
    delayed cast of Megatron's SwiGLU values (agoq.ref.fp8.ref_fp8_cast_delayed_2d of ref_megatron_glu)."""
    from agoq.ref.smooth_swiglu_fp8 import ref_megatron_glu

    h = _grid_h(70, 130)
    ws = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out, out_t, new, s, scale_a = _k().smooth_swiglu_cast_delayed(h, None, "e4m3", _meta(), ws, per_token=False,
                                                                   transposed=True)
    plain = ref_fp8_cast_delayed_2d(ref_megatron_glu(h), "e4m3", _meta(), ws, rowmajor=True, transposed=True)
    assert s is None and scale_a is None
    for a, b in zip((out, out_t, new), plain, strict=True):
        assert _same(a, b)
    with pytest.raises(ValueError, match="per_token smoothing needs its amax"):
        _k().smooth_swiglu_cast_delayed(h, None, "e4m3", _meta(), ws, per_token=True)


def test_plain_cast_nonfinite_up():
    """Plain mode: an infinite up (gate 32: silu exact) gives z = +-inf, saturated to +-448 in the codes, and the
    history push of an infinite amax makes the next scale NaN (agoq.ref.fp8: nothing silent); NaN h on GPU (the
    interpreter converts NaN to the code of 384)."""
    h = _grid_h(33, 48)
    h[4, 7], h[4, 48 + 7] = 32.0, float("inf")
    h[9, 8], h[9, 48 + 8] = 32.0, float("-inf")
    if not INTERPRET:
        h[12, 48 + 2] = float("nan")
    _check_cast(h, None, transposed=True, t_colmajor=True)


@pytest.mark.parametrize("per_token", [True, False])
def test_cast_subnormal_and_nonfinite_amax(per_token):
    """s from subnormal amaxes (pow2 ceil through the integer bits, no flush), inf (z = 0) and, on GPU, NaN
    (z NaN: codes NaN, nothing silent)."""
    h = _grid_h(24, 40)
    n = 24 if per_token else 40
    amax = ref_smooth_swiglu_amax(h, per_token).clone()
    amax[:4] = torch.tensor([2.0**-140, 3 * 2.0**-135, 2.0**-127 * 1.5, 2.0**-149])
    amax[4] = float("inf")
    if not INTERPRET:  # the interpreter converts NaN to the code of 384 (agoq.kernels.fp8_fused's note)
        amax[5] = float("nan")
    assert amax.numel() == n
    _check_cast(h, per_token, amax=amax, transposed=True, t_colmajor=True)


def test_amax_propagates_nan():
    h = _grid_h(20, 33)
    h[3, 33 + 4] = float("nan")
    for per_token in (True, False):
        got = _k().smooth_swiglu_amax(h, per_token)
        assert _same(got, ref_smooth_swiglu_amax(h, per_token)) and torch.isnan(got).any()


def test_rejects_fp32_and_odd_width():
    with pytest.raises(ValueError, match="bf16/fp16"):
        _k().smooth_swiglu_amax(torch.zeros(4, 6, device=DEVICE), True)
    with pytest.raises(ValueError, match="even"):
        _k().smooth_swiglu_amax(torch.zeros(4, 5, dtype=torch.bfloat16, device=DEVICE), True)


@pytest.mark.parametrize("shape", [(3, 7), (65, 130), (300, 70)])
@pytest.mark.parametrize("per_row", [True, False])
def test_fused_cast_mul_matches_reference(shape, per_row):
    """agoq.kernels.fp8_fused's delayed cast of x * mul (fc2's gradient times the per-token s, fc2's weight
    times the per-channel s): power-of-two multipliers on grid values, so every product is exact."""
    from agoq.kernels.fp8_fused import fp8_cast_delayed_2d

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(torch.float8_e5m2).to(torch.bfloat16).to(DEVICE)
    n = shape[0] if per_row else shape[1]
    mul = torch.exp2(torch.randint(-3, 3, (n,), generator=gen).float()).to(DEVICE)
    mul = mul.reshape(-1, 1) if per_row else mul.reshape(1, -1)
    ws = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    got = fp8_cast_delayed_2d(x, "e5m2", _meta(), ws, rowmajor=True, transposed=True, mul=mul)
    ref = ref_fp8_cast_delayed_2d(x, "e5m2", _meta(), ws, rowmajor=True, transposed=True, mul=mul)
    for a, b in zip(got, ref, strict=True):
        assert _same(a, b)


@GPU_ROUNDING
@pytest.mark.parametrize("shape", [(4096, 5632), (333, 1030)])
@pytest.mark.parametrize("per_token", [True, False, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_data_matches_reference_gpu(shape, per_token, dtype):
    gen = torch.Generator().manual_seed(2)
    h = (torch.randn(shape[0], 2 * shape[1], generator=gen) * 3).to(dtype).to(DEVICE)
    h[7, shape[1] + 11] = 300.0  # an outlier token / channel
    if per_token is not None:
        assert _same(_k().smooth_swiglu_amax(h, per_token), ref_smooth_swiglu_amax(h, per_token))
    _check_cast(h, per_token, transposed=True, t_colmajor=True)
