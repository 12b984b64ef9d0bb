"""agoq.ref.fp8: casts against an independent E4M3/E5M2 grid oracle; simulated FP8 linear error bounds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agoq.formats import FP8_MAX
from agoq.ref.fp8 import (
    FP8_DTYPES,
    fp8_amax,
    fp8_scale_from_amax,
    ref_fp8_cast,
    ref_fp8_linear,
    ref_fp8_linear_bwd,
    ref_fp8_qdq,
)
from agoq.testing.numerics import FP8_FLOORS_DB, sqnr_db

MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
EXP_BIAS = {"e4m3": 7, "e5m2": 15}


def _grid(variant: str) -> torch.Tensor:
    """All finite non-negative values of the format, built from the bit layout (not from torch's cast)."""
    m, bias = MANTISSA_BITS[variant], EXP_BIAS[variant]
    vals = [k * 2.0 ** (1 - bias - m) for k in range(2**m)]  # subnormals (and 0)
    e = 1
    while True:
        for k in range(2**m):
            v = (1 + k / 2**m) * 2.0 ** (e - bias)
            if v > FP8_MAX[variant]:
                return torch.tensor(vals, dtype=torch.float64)
            vals.append(v)
        e += 1


@pytest.mark.parametrize("variant", ["e4m3", "e5m2"])
def test_ref_fp8_cast_is_saturating_round_to_nearest_on_the_grid(variant):
    grid = _grid(variant)
    assert grid[-1].item() == FP8_MAX[variant]
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(20000, generator=gen, dtype=torch.float64) * 2 - 1) * FP8_MAX[variant] * 1.2
    x = torch.cat([x, grid, -grid, (grid[1:] + grid[:-1]) / 2]).float()  # + exact midpoints (ties)
    got = ref_fp8_cast(x, torch.tensor(1.0), variant).double()
    a = x.double().abs().clamp(max=FP8_MAX[variant])
    idx = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    nearest = torch.where(a - lo < hi - a, lo, hi)
    tie = (a - lo) == (hi - a)
    # ties to even: the even code is the one whose mantissa LSB is 0, i.e. an even grid index
    nearest = torch.where(tie, torch.where((idx - 1) % 2 == 0, lo, hi), nearest)
    assert torch.equal(got.abs(), nearest)
    assert torch.equal(torch.sign(got[nearest > 0]), torch.sign(x.double()[nearest > 0]))


def test_fp8_scale_from_amax_rules():
    amax = torch.tensor([0.0, 1.0, 448.0, 3.0, float("inf"), float("nan")])
    s = fp8_scale_from_amax(amax, "e4m3")
    assert s[0] == 1.0 and s[1] == 448.0 and s[2] == 1.0
    assert s[3] == torch.tensor(448.0 / 3.0)
    assert math.isnan(s[4]) and math.isnan(s[5])
    p = fp8_scale_from_amax(amax[1:4], "e4m3", pow2=True)
    assert torch.equal(p, torch.tensor([256.0, 1.0, 128.0]))  # largest 2**k <= 448 / amax
    assert fp8_scale_from_amax(torch.tensor(1.0), "e5m2", margin=2) == 57344.0 / 4
    with pytest.raises(ValueError, match="e4m3"):
        fp8_scale_from_amax(amax, "e3m4")


def test_ref_fp8_cast_nan_scale_propagates():
    out = ref_fp8_cast(torch.ones(4), torch.tensor(float("nan")), "e4m3")
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("variant", ["e4m3", "e5m2"])
def test_ref_fp8_qdq_meets_floor(variant):
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    floor = FP8_FLOORS_DB[variant][0]
    assert sqnr_db(x, ref_fp8_qdq(x, variant)) >= floor


def _rows_with_spread(m=64, k=128, seed=0, decades=6):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * 10 ** torch.linspace(-decades / 2, decades / 2, m)[:, None]


def test_rowwise_qdq_handles_row_magnitude_spread_per_tensor_does_not():
    """Rows spanning 1e6 in magnitude: per-tensor E4M3 pushes small rows under 2**-9 (flushed), row
    scaling keeps every row at the E4M3 floor. SQNR is measured per row, worst row reported."""
    x = _rows_with_spread()
    per_row_tensor = min(sqnr_db(r, q) for r, q in zip(x, ref_fp8_qdq(x, "e4m3"), strict=True))
    per_row_row = min(sqnr_db(r, q) for r, q in zip(x, ref_fp8_qdq(x, "e4m3", dim=1), strict=True))
    assert per_row_row >= FP8_FLOORS_DB["e4m3"][0] - 1.0  # 128-sample rows: 1 dB sampling margin
    assert per_row_tensor < 5.0


# Error model for y = Q(x) Q(w)^T: the two quantization noises are independent of each other and of
# the signal, and a GEMM sums products, so relative noise powers add: SQNR ~ -10 log10(sum 10^(-F/10)).
def _combined_floor_db(*floors_db: float, margin_db: float = 1.0) -> float:
    return -10 * math.log10(sum(10 ** (-f / 10) for f in floors_db)) - margin_db


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_ref_fp8_linear_vs_fp32_linear_error_bounds(granularity):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 128, generator=gen, requires_grad=True)
    w = (torch.randn(96, 128, generator=gen) / math.sqrt(128)).requires_grad_()
    g = torch.randn(2, 64, 96, generator=gen)
    y = ref_fp8_linear(x, w, granularity)
    y.backward(g)
    x32, w32 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y32 = F.linear(x32, w32)
    y32.backward(g)
    e4, e5 = FP8_FLOORS_DB["e4m3"][0], FP8_FLOORS_DB["e5m2"][0]
    assert sqnr_db(y32, y) >= _combined_floor_db(e4, e4)  # x and w in E4M3
    assert sqnr_db(x32.grad, x.grad) >= _combined_floor_db(e5, e4)  # g in E5M2, w in E4M3
    assert sqnr_db(w32.grad, w.grad) >= _combined_floor_db(e5, e4)  # g in E5M2, x in E4M3


def test_ref_fp8_linear_tensor_backward_reuses_forward_scales():
    """With given (delayed) scales the backward must use the forward's x / w scales: a deliberately
    small x scale (amax assumed 64x too large) changes dw exactly as ref_fp8_linear_bwd predicts."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen, requires_grad=True)
    w = torch.randn(48, 64, generator=gen)
    x_scale = fp8_scale_from_amax(fp8_amax(x) * 64, "e4m3")
    w_scale = fp8_scale_from_amax(fp8_amax(w), "e4m3")
    w.requires_grad_()
    y = ref_fp8_linear(x, w, "tensor", x_scale, w_scale)
    g = torch.randn_like(y)
    y.backward(g)
    dx, dw = ref_fp8_linear_bwd(g, x.detach(), w.detach(), "tensor", x_scale, w_scale)
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw)
    _, dw_current = ref_fp8_linear_bwd(g, x.detach(), w.detach(), "tensor")
    assert not torch.equal(dw, dw_current)


def test_ref_fp8_linear_row_rejects_scales():
    with pytest.raises(ValueError, match="current scaling"):
        ref_fp8_linear(torch.ones(16, 16), torch.ones(16, 16), "row", x_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="granularity"):
        ref_fp8_linear(torch.ones(16, 16), torch.ones(16, 16), "block")


def test_fp8_dtypes_are_torch_ocp_formats():
    assert torch.finfo(FP8_DTYPES["e4m3"]).max == FP8_MAX["e4m3"]
    assert torch.finfo(FP8_DTYPES["e5m2"]).max == FP8_MAX["e5m2"]


# ------------------------------------------------------------- the twins of agoq.kernels.fp8 ----
def test_ref_fp8_amax_2d_against_brute_force():
    from agoq.ref.fp8 import ref_fp8_amax_2d

    x = torch.randn(7, 5)
    x[2, 3] = -40.0
    assert ref_fp8_amax_2d(x).item() == 40.0
    rows, cols = ref_fp8_amax_2d(x, rowcol=True)
    assert torch.equal(rows, torch.tensor([max(abs(v) for v in r) for r in x.tolist()]))
    assert torch.equal(cols, torch.tensor([max(abs(v) for v in c) for c in x.t().tolist()]))
    empty_rows, empty_cols = ref_fp8_amax_2d(torch.zeros(3, 0), rowcol=True)
    assert torch.equal(empty_rows, torch.zeros(3)) and empty_cols.shape == (0,)
    assert ref_fp8_amax_2d(torch.zeros(0, 4)).item() == 0.0


def test_ref_fp8_cast_2d_layouts_and_scales():
    from agoq.ref.fp8 import ref_fp8_cast_2d

    x = torch.randn(6, 10) * 50
    s = torch.tensor(2.5)
    out, out_t, amax = ref_fp8_cast_2d(x, "e4m3", s, rowmajor=True, transposed=True, record_amax=True)
    assert torch.equal(out.view(torch.uint8), ref_fp8_cast(x, s, "e4m3").view(torch.uint8))
    assert out_t.is_contiguous() and torch.equal(out_t.view(torch.uint8), out.view(torch.uint8).t())
    assert amax == x.abs().max()
    s_rows, s_cols = torch.rand(6, 1) + 0.5, torch.rand(1, 10) + 0.5
    out, out_t, amax = ref_fp8_cast_2d(x, "e5m2", s_rows, s_cols, rowmajor=True, transposed=True)
    assert amax is None
    assert torch.equal(out.float(), ref_fp8_cast(x, s_rows, "e5m2").float())
    assert torch.equal(out_t.float(), ref_fp8_cast(x, s_cols, "e5m2").float().t())
    with pytest.raises(ValueError, match="scale_t is required"):
        ref_fp8_cast_2d(x, "e4m3", s_rows, transposed=True)


def test_ref_fp8_history_update_pushes_newest_first_and_scales_from_the_max():
    from agoq.ref.fp8 import ref_fp8_history_update

    history = torch.tensor([2.0, 8.0, 1.0])
    new, scale, scale_inv = ref_fp8_history_update(history, torch.tensor(4.0), "e4m3")
    assert scale_inv == scale.reciprocal()
    assert new.tolist() == [4.0, 2.0, 8.0] and history.tolist() == [2.0, 8.0, 1.0]  # oldest dropped, not in place
    assert scale == fp8_scale_from_amax(torch.tensor(8.0), "e4m3")
    _, scale, _ = ref_fp8_history_update(history, torch.tensor(float("nan")), "e4m3")
    assert torch.isnan(scale)  # a NaN amax is never silently forgotten while it is in the window
