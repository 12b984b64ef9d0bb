"""Megatron-LM's --manual-gc in agoq's trainer (agoq.train.manual_gc): the automatic collector off while
training and back on after (also on an exception), full collections every --manual-gc-interval steps and around
evaluations unless --no-manual-gc-eval, nothing at all without --manual-gc."""

from __future__ import annotations

import gc

import pytest

from agoq.train.manual_gc import ManualGC


@pytest.fixture
def collections(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    return calls


def _collected_after(policy: ManualGC, n: int, collections: list) -> list[int]:
    """The iterations among 1..n after which ``policy`` collected (``collections``: the recorded gc.collect calls)."""
    out = []
    for it in range(1, n + 1):
        before = len(collections)
        policy.after_step(it)
        if len(collections) > before:
            out.append(it)
    return out


def test_training_turns_the_collector_off_and_back_on(collections):
    assert gc.isenabled()
    with ManualGC(enabled=True).training():
        assert not gc.isenabled() and len(collections) == 1  # one full collection first
    assert gc.isenabled()
    with pytest.raises(RuntimeError), ManualGC(enabled=True).training():
        raise RuntimeError("a failed step")
    assert gc.isenabled()  # restored on the way out
    with ManualGC().training():  # without --manual-gc: untouched
        assert gc.isenabled()
    assert len(collections) == 2


def test_collections_at_the_interval_and_around_evaluations(collections):
    assert _collected_after(ManualGC(enabled=True, interval=3), 10, collections) == [3, 6, 9]
    assert _collected_after(ManualGC(enabled=True, interval=0), 10, collections) == []  # 0: not between steps
    assert _collected_after(ManualGC(enabled=False, interval=3), 10, collections) == []
    del collections[:]
    with ManualGC(enabled=True).evaluation():
        assert len(collections) == 1
    assert len(collections) == 2
    with ManualGC(enabled=True, around_eval=False).evaluation(), ManualGC().evaluation():
        pass
    assert len(collections) == 2


def test_the_start_up_line_says_the_schedule():
    assert ManualGC().describe() is None
    assert "full collection every 50 steps; before and after each evaluation" in ManualGC(True, 50).describe()
    assert "not between steps (--manual-gc-interval 0); not around evaluations" in ManualGC(True, 0, False).describe()
