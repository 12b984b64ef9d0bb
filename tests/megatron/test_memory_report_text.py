"""agoq.train.memory_report's measured stage text: the memory outside PyTorch's allocator (a GPU reading) is said
beside the planner's reserve for it; a CPU reading has no such field and says nothing of it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.megatron


def test_the_stage_text_names_the_outside_memory_and_the_planners_reserve():
    from agoq.plan.headroom import OUTSIDE_ALLOCATOR_GIB
    from agoq.train.memory_report import _format_breakdown

    held = {"weights_gib": 1.0, "grads_gib": 0.5, "optimizer_gib": 2.0, "peak_gib": 5.0}
    gpu = _format_breakdown({**held, "outside_allocator_gib": 1.75})
    assert gpu.startswith(" (weights 1.00 + grads 0.50 + optimizer 2.00 GiB; activations and temporaries at peak "
                          "<= 1.50 GiB)")
    assert gpu.endswith(f" | outside PyTorch's allocator 1.75 GiB (the planner reserves {OUTSIDE_ALLOCATOR_GIB})")
    assert "outside" not in _format_breakdown(held)
    assert _format_breakdown({"outside_allocator_gib": 0.5}).startswith(" | outside PyTorch's allocator 0.50 GiB")
