"""agoq.kernels.fp8_fused vs agoq.ref.fp8: delayed-scaling casts with the history push fused in, and
current-scaling casts with the scale computed in the kernel.

CPU: ``TRITON_INTERPRET=1 python -m pytest tests/kernels -m "not gpu"``; GPU: ``python -m pytest tests/kernels``.
As in test_fp8_kernels.py, the interpreter tests feed values on the FP8 grid with power-of-two scales
(no conversion needs rounding); arbitrary data is compared on GPU only. The meta vectors (history,
scale, inverse scale) are exact arithmetic and compared exactly everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from agoq.ref.fp8 import ref_fp8_cast_current_2d, ref_fp8_cast_delayed_2d

pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
GPU_CODES = pytest.mark.gpu(reason="interpreter fp32->fp8 conversion does not round correctly (Triton 3.8)")

# odd sizes, one tile, several programs in both grid dimensions (4 tiles of 64 rows per program),
# a partial last strip, sides that are multiples of 16 (vectorised code), empty tensors
SHAPES = [(1, 1), (3, 7), (64, 64), (65, 130), (300, 70), (512, 192), (0, 5), (5, 0)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
VARIANTS = ["e4m3", "e5m2"]
LAYOUTS = [dict(rowmajor=True, transposed=True), dict(rowmajor=True, transposed=False),
           dict(rowmajor=False, transposed=True)]


def _k():
    from agoq.kernels import fp8_fused  # imported late: TRITON_INTERPRET is read when triton is imported

    return fp8_fused


def _grid_x(shape, variant, dtype, seed=0):
    """Values on the FP8 grid with |v| in [2**-3, 2**4) (3 significant bits: exact in every dtype)."""
    from agoq.ref.fp8 import FP8_DTYPES

    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPES[variant]).float()
    keep = torch.isfinite(vals) & (((vals.abs() >= 2.0**-3) & (vals.abs() < 2.0**4)) | (vals == 0))
    grid = vals[keep]
    g = grid[torch.randint(0, grid.numel(), shape, generator=torch.Generator().manual_seed(seed))]
    return g.to(dtype).to(DEVICE)


def _meta(history, scale):
    """[scale_inv, scale, 0, 0, history] (agoq.kernels.fp8_fused)."""
    head = torch.tensor([1.0 / scale, scale, 0.0, 0.0], dtype=torch.float32)
    return torch.cat([head, torch.tensor(history, dtype=torch.float32)]).to(DEVICE)


def _equal_nan(a, b):
    a, b = a.cpu(), b.cpu()
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _assert_codes(got, ref):
    for a, b in zip(got[:2], ref[:2], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
            assert torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()), "codes differ"


# ------------------------------------------------------------------------------------ delayed ----
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_delayed_cast_on_grid_equals_ref(shape, variant, dtype, layout):
    x = _grid_x(shape, variant, dtype, seed=shape[0])
    meta = _meta([3.0, 40.0, 0.5, 7.0], 8.0)  # the cast uses meta[1] = 8 (x * 8 stays on the grid)
    ws = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    before = meta.clone()
    got = _k().fp8_cast_delayed_2d(x, variant, meta, ws, margin=1, **layout)
    ref = ref_fp8_cast_delayed_2d(x.cpu(), variant, meta.cpu(), ws.cpu(), margin=1, **layout)
    _assert_codes(got, ref)
    assert got[2].shape == (8,) and _equal_nan(got[2], ref[2])
    assert torch.equal(meta, before), "meta is read-only (a pending backward may hold a view of it)"
    assert torch.equal(ws.cpu(), torch.zeros(2, dtype=torch.int32)), "workspace must be zero again"


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("length", [1, 2, 16])
def test_delayed_history_push_over_calls_equals_ref(pow2, length):
    """Several calls threading meta through: the history shifts, the scale follows max |history|."""
    k = _k()
    meta = torch.zeros(4 + length, device=DEVICE)
    meta[:2] = 1.0
    meta_r = meta.cpu().clone()
    ws = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for step, amp in enumerate((1.0, 0.25, 4.0, 0.5)):
        x = _grid_x((130, 96), "e5m2", torch.bfloat16, seed=step) * amp
        _, _, meta = k.fp8_cast_delayed_2d(x, "e5m2", meta, ws, pow2=pow2, rowmajor=False, transposed=False)
        _, _, meta_r = ref_fp8_cast_delayed_2d(x.cpu(), "e5m2", meta_r, ws.cpu(), pow2=pow2, rowmajor=False,
                                               transposed=False)
        assert _equal_nan(meta, meta_r), step
    assert meta.cpu()[4] == x.float().abs().max().cpu()  # the newest amax first
    assert meta.cpu()[2:4].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_delayed_nan_or_inf_amax_gives_nan_scale(special):
    x = _grid_x((70, 33), "e4m3", torch.float32)
    x[5, 7] = special
    meta, ws = _meta([1.0, 2.0], 4.0), torch.zeros(2, dtype=torch.int32, device=DEVICE)
    _, _, new = _k().fp8_cast_delayed_2d(x, "e4m3", meta, ws, rowmajor=False)
    _, _, new_r = ref_fp8_cast_delayed_2d(x.cpu(), "e4m3", meta.cpu(), ws.cpu(), rowmajor=False)
    assert _equal_nan(new, new_r) and torch.isnan(new.cpu()[:2]).all()  # NaN scale: nothing silent
    assert _equal_nan(new.cpu()[4], torch.tensor(special))  # the amax itself is recorded
    assert torch.equal(ws.cpu(), torch.zeros(2, dtype=torch.int32))


def test_delayed_argument_errors_name_the_fix():
    k = _k()
    x = torch.zeros(4, 4, device=DEVICE)
    ws = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="4 \\+ L"):
        k.fp8_cast_delayed_2d(x, "e4m3", torch.ones(4, device=DEVICE), ws)
    with pytest.raises(ValueError, match="workspace"):
        k.fp8_cast_delayed_2d(x, "e4m3", torch.ones(5, device=DEVICE), torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="variant"):
        k.fp8_cast_delayed_2d(x, "e2m1", torch.ones(5, device=DEVICE), ws)


# ------------------------------------------------------------------------------------ current ----
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_current_cast_on_grid_equals_ref(shape, variant, dtype, layout):
    """pow2 scales: x * scale stays on the grid (exact in the interpreter)."""
    x = _grid_x(shape, variant, dtype, seed=shape[1])
    got = _k().fp8_cast_current_2d(x, variant, 1, True, **layout)
    ref = ref_fp8_cast_current_2d(x.cpu(), variant, 1, True, **layout)
    _assert_codes(got, ref)
    assert got[2].shape == (5,) and got[2].dtype == torch.float32 and _equal_nan(got[2], ref[2])


def test_current_scale_of_zeros_is_one_and_nan_propagates():
    k = _k()
    _, _, meta = k.fp8_cast_current_2d(torch.zeros(32, 48, device=DEVICE), "e4m3")
    assert meta.cpu().tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]  # [scale_inv, scale, 0, 0, amax]
    x = torch.ones(32, 48, device=DEVICE)
    x[3, 3] = float("nan")
    _, _, meta = k.fp8_cast_current_2d(x, "e5m2", rowmajor=False)
    assert torch.isnan(meta.cpu()[[0, 1, 4]]).all()


# ------------------------------------------------------------------- arbitrary data: GPU only ----
@GPU_CODES
@pytest.mark.parametrize("shape", [(3, 7), (65, 130), (1024, 2048), (2049, 517), (8192, 1024)])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_fused_casts_codes_equal_ref_gpu(shape, variant, dtype, pow2):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen)
    x.view(-1)[:: max(1, x.numel() // 5)] *= 300.0  # outliers: the delayed scale below saturates them
    x = x.to(dtype).to(DEVICE)
    got = _k().fp8_cast_current_2d(x, variant, 0, pow2, rowmajor=True, transposed=True)
    _assert_codes(got, ref_fp8_cast_current_2d(x.cpu(), variant, 0, pow2, rowmajor=True, transposed=True))
    assert _equal_nan(got[2], ref_fp8_cast_current_2d(x.cpu(), variant, 0, pow2)[2])
    meta = _meta([2.0, 1.0, 9.0], 3.0 if not pow2 else 4.0)
    ws = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    got = _k().fp8_cast_delayed_2d(x, variant, meta, ws, 0, pow2, rowmajor=True, transposed=True)
    ref = ref_fp8_cast_delayed_2d(x.cpu(), variant, meta.cpu(), ws.cpu(), 0, pow2, rowmajor=True, transposed=True)
    _assert_codes(got, ref)
    assert _equal_nan(got[2], ref[2]) and torch.equal(ws.cpu(), torch.zeros(2, dtype=torch.int32))
    assert torch.equal(got[0].view(torch.uint8).t().cpu(), got[1].view(torch.uint8).cpu())
