"""agoq.ops.fp8_scaling: recipe validation and the delayed-scaling amax history (CPU)."""

from __future__ import annotations

import pytest
import torch

from agoq.ops.fp8_linear import fp8_cast_ops
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState, current_scale
from agoq.ref.fp8 import fp8_amax, fp8_scale_from_amax, ref_fp8_cast_2d

DELAYED = FP8Recipe(scaling="delayed", amax_history_len=3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"granularity": "block"}, "granularity"),
        ({"scaling": "late"}, "scaling"),
        ({"granularity": "row", "scaling": "delayed"}, "current"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"margin": -1}, "margin"),
    ],
)
def test_recipe_rejects_bad_values_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8Recipe(**kwargs)


def test_state_requires_delayed_recipe():
    with pytest.raises(ValueError, match="scaling_state=None"):
        FP8ScalingState(FP8Recipe())


def test_delayed_scale_bootstraps_then_uses_history_max():
    state = FP8ScalingState(DELAYED)
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25]
    used = [state.scale_and_record("x", torch.tensor([a, -a / 2])) for a in amaxes]
    expect = [fp8_scale_from_amax(torch.tensor(a), "e4m3") for a in (2.0, 2.0, 8.0, 8.0, 8.0)]
    for got, want in zip(used, expect, strict=True):
        assert torch.equal(got, want)
    # after the 5th record the window (len 3) holds 0.25, 0.5, 1.0: the 8.0 has aged out
    assert torch.equal(state.amax_history("x"), torch.tensor([0.25, 0.5, 1.0]))
    assert torch.equal(state.scale("x"), fp8_scale_from_amax(torch.tensor(1.0), "e4m3"))
    assert state.num_updates == {"x": 5, "w": 0, "g": 0}


def test_gradient_slot_uses_e5m2_range():
    state = FP8ScalingState(DELAYED)
    state.scale_and_record("g", torch.tensor([4.0]))
    assert torch.equal(state.scale("g"), torch.tensor(57344.0 / 4.0))
    with pytest.raises(ValueError, match="slot"):
        state.scale_and_record("y", torch.tensor([1.0]))


def test_update_replaces_buffers_so_saved_scales_stay_valid():
    state = FP8ScalingState(DELAYED)
    first = state.scale_and_record("w", torch.tensor([1.0]))
    before = first.clone()
    state.scale_and_record("w", torch.tensor([100.0]))
    state.scale_and_record("w", torch.tensor([100.0]))
    assert torch.equal(first, before)


def test_state_dict_round_trip_keeps_history_and_counters():
    state = FP8ScalingState(DELAYED)
    for a in (3.0, 5.0):
        state.scale_and_record("x", torch.tensor([a]))
    sd = state.state_dict()
    assert set(sd) == {"meta_x", "meta_w", "meta_g", "_extra_state"}  # workspaces are not state
    assert sd["meta_x"].shape == (4 + 3,)  # [scale_inv, scale, 0, 0, history (3)]
    other = FP8ScalingState(DELAYED)
    other.load_state_dict(sd)
    assert other.num_updates == state.num_updates
    x = torch.tensor([0.1])
    assert torch.equal(other.scale_and_record("x", x), state.scale_and_record("x", x))


def test_state_on_wrong_device_raises():
    state = FP8ScalingState(DELAYED, device="meta")
    with pytest.raises(ValueError, match="move the state"):
        state.scale_and_record("x", torch.ones(2))


def test_current_scale_per_row_and_margin():
    x = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    s = current_scale(x, "x", FP8Recipe(margin=1), dim=1)
    assert torch.equal(s, torch.tensor([[448.0 / 2 / 2], [448.0 / 0.5 / 2]]))
    p = current_scale(x, "g", FP8Recipe(pow2_scales=True))
    assert torch.equal(p, torch.tensor(16384.0))  # 57344 / 2 = 28672 -> 2**14


def test_cast_bootstraps_then_casts_with_the_previous_scale():
    """FP8ScalingState.cast (the fused path's host side, here with the reference ops): the first call
    uses the tensor's own amax, later calls the history's scale; returned scales are views of a meta
    the state no longer writes."""
    state = FP8ScalingState(DELAYED)
    ops = fp8_cast_ops(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=gen) * a for a in (1.0, 4.0, 0.5)]
    held = []
    for i, x in enumerate(xs):
        out, out_t, scale, inv = state.cast("x", x, ops, rowmajor=True, transposed=True)
        want = fp8_scale_from_amax(fp8_amax(xs[0] if i == 0 else torch.stack(xs[:i])), "e4m3")
        assert torch.equal(scale, want) and torch.equal(inv, want.reciprocal())
        ref_out, ref_out_t, _ = ref_fp8_cast_2d(x, "e4m3", want, rowmajor=True, transposed=True)
        assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8))
        assert torch.equal(out_t.view(torch.uint8), ref_out_t.view(torch.uint8))
        held.append((scale, scale.clone()))
    for view, copy in held:
        assert torch.equal(view, copy)
    assert torch.equal(state.amax_history("x"), torch.stack([fp8_amax(x) for x in reversed(xs)]))
    assert state.num_updates["x"] == 3


def test_meta_pool_rows_are_fresh_aligned_and_never_rewritten():
    """FP8ScalingState.cast_meta writes each next meta into an unused row of a pool (META_POOL_ROWS at
    a time): over more casts than one pool holds, every meta the casts used keeps its values (no row
    is written twice), every row is 16-byte aligned with scale_inv at its start, and the scale_inv
    handed out is element 0 of the meta the cast used; the history matches the plain reference."""
    from agoq.ops.fp8_scaling import META_POOL_ROWS

    state = FP8ScalingState(DELAYED)
    ops = fp8_cast_ops(torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=gen) * (1 + i % 7) for i in range(2 * META_POOL_ROWS + 3)]
    held, ptrs = [], set()
    for i, x in enumerate(xs):
        _, _, meta, inv = state.cast_meta("g", x, ops, True, False)
        assert inv.dim() == 0 and inv.data_ptr() == meta.data_ptr() and torch.equal(inv, meta[0])
        # the first cast bootstraps (current scaling: its own [scale_inv, scale, 0, 0, amax])
        assert meta.data_ptr() % 16 == 0 and meta.shape == (4 + (DELAYED.amax_history_len if i else 1),)
        held.append((meta, meta.clone()))
        ptrs.add(meta.data_ptr())
    assert len(ptrs) == len(xs)  # a new meta every time (the bootstrap's and the initial buffers included)
    for meta, copy in held:
        assert torch.equal(meta, copy)
    assert torch.equal(state.amax_history("g"), torch.stack([fp8_amax(x) for x in reversed(xs[-3:])]))


def test_moving_the_state_drops_its_meta_pools():
    state = FP8ScalingState(DELAYED)
    ops = fp8_cast_ops(torch.device("cpu"))
    for _ in range(3):
        state.cast_meta("x", torch.ones(4, 16), ops, True, False)
    assert state._pools
    state.to("cpu")
    assert not state._pools and not state._invs


def test_state_with_a_meta_pool_deep_copies():
    import copy

    state = FP8ScalingState(DELAYED)
    ops = fp8_cast_ops(torch.device("cpu"))
    for _ in range(3):
        state.cast_meta("x", torch.ones(4, 16), ops, True, False)
    other = copy.deepcopy(state)
    assert torch.equal(other.meta("x"), state.meta("x")) and other.num_updates == state.num_updates
    other.cast_meta("x", torch.ones(4, 16) * 2, ops, True, False)
    assert not torch.equal(other.meta("x"), state.meta("x"))  # the copy has its own pool
