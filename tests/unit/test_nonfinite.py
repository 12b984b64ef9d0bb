"""agoq.ops.nonfinite.nonfinite_in: NaN/Inf found in any slice, tails included, without a host sync."""

from __future__ import annotations

import pytest
import torch

from agoq.ops import nonfinite
from agoq.ops.nonfinite import nonfinite_in


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 9, 10, 24])  # first slice, last element of a slice, next slice, tail
def test_finds_a_nonfinite_value_in_any_slice(monkeypatch, bad, where):
    monkeypatch.setattr(nonfinite, "NONFINITE_CHECK_SLICE", 10)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(25).to(dtype)
        assert not bool(nonfinite_in(x))
        x[where] = bad
        assert bool(nonfinite_in(x)), (dtype, where)


def test_accumulates_into_found_and_handles_empty():
    assert nonfinite_in(torch.empty(0)) is None
    found = nonfinite_in(torch.tensor([1.0, float("nan")]))
    assert bool(nonfinite_in(torch.ones(3), found))  # an earlier buffer's finding is kept
    assert not bool(nonfinite_in(torch.ones(3), nonfinite_in(torch.zeros(2))))
    assert nonfinite_in(torch.ones(3)).shape == ()


def test_planner_models_the_same_slice():
    from agoq.plan import peak

    assert peak.NONFINITE_CHECK_SLICE == nonfinite.NONFINITE_CHECK_SLICE
