"""--log-interval N > 1: the logged line averages the interval (Megatron-LM's training_log): the loss over the updated
iterations, the step time over all of them, the last grad norm; N = 1 logs each iteration as it is."""

from __future__ import annotations

import math

import pytest

from agoq.train.training import IntervalMeter, StepResult

pytestmark = pytest.mark.megatron


def _step(loss, seconds, ok=True, grad_norm=1.0):
    return StepResult(loss=loss, grad_norm=grad_norm, update_successful=ok, seconds=seconds)


def test_interval_line_averages_updated_losses_and_all_step_times():
    meter = IntervalMeter()
    steps = [_step(4.0, 0.2), _step(float("inf"), 0.4, ok=False), _step(2.0, 0.3, grad_norm=0.5)]
    for step in steps:
        meter.add(step)
    line = meter.take(steps[-1])
    assert line.loss == 3.0  # the skipped iteration's loss is left out, as in Megatron-LM
    assert line.seconds == pytest.approx(0.3) and line.grad_norm == 0.5  # mean time; the last grad norm
    meter.add(_step(1.0, 0.1))  # the next interval starts fresh
    meter.add(_step(1.5, 0.3))
    assert meter.take(_step(1.5, 0.3)) == _step(1.25, pytest.approx(0.2))


def test_one_iteration_interval_is_the_iteration_itself_and_other_stages_have_no_loss():
    meter = IntervalMeter()
    skipped = _step(float("nan"), 0.5, ok=False)
    meter.add(skipped)
    assert meter.take(skipped) is skipped  # --log-interval 1: unchanged lines, a skipped one's loss included
    for _ in range(2):
        meter.add(_step(None, 0.2))
    assert meter.take(_step(None, 0.2)).loss is None  # not the last pipeline stage
    for _ in range(2):
        meter.add(_step(float("nan"), 0.2, ok=False))
    assert math.isnan(meter.take(_step(float("nan"), 0.2, ok=False)).loss)  # every update skipped


def test_interval_line_averages_the_host_steal_and_unknown_stays_unknown():
    """--log-json host_steal_cpu_seconds (agoq.train.hoststats): the interval's mean per step; one
    iteration whose steal could not be read makes the interval's unknown (None), never a partial mean."""
    meter = IntervalMeter()
    steps = [StepResult(loss=1.0, grad_norm=1.0, update_successful=True, seconds=0.2, steal_seconds=s)
             for s in (0.1, 0.3)]
    for step in steps:
        meter.add(step)
    assert meter.take(steps[-1]).steal_seconds == pytest.approx(0.2)
    meter.add(steps[0])
    meter.add(_step(1.0, 0.2))  # steal unknown
    assert meter.take(steps[0]).steal_seconds is None
    meter.add(steps[1])
    meter.add(steps[1])
    assert meter.take(steps[1]).steal_seconds == pytest.approx(0.3)  # a fresh interval after an unknown one


def test_interval_line_means_enqueue_sums_collections_and_keeps_the_last_threads():
    """--log-json host_enqueue_seconds: mean per step; gc_collections / gc_seconds: the interval's sums; host_threads:
    the last iteration's list (as the grad norm); an unknown enqueue time makes the interval's unknown."""
    meter = IntervalMeter()
    rows = [{"name": "python", "main": True, "cpu_seconds": 0.1, "wait_seconds": 0.0}]
    steps = [StepResult(loss=1.0, grad_norm=1.0, update_successful=True, seconds=0.2, steal_seconds=0.0,
                        enqueue_seconds=e, gc_collections=c, gc_seconds=g, threads=t)
             for e, c, g, t in ((0.1, 1, 0.01, None), (0.3, 2, 0.02, rows))]
    for step in steps:
        meter.add(step)
    line = meter.take(steps[-1])
    assert line.enqueue_seconds == pytest.approx(0.2) and line.gc_collections == 3
    assert line.gc_seconds == pytest.approx(0.03) and line.threads is rows
    meter.add(_step(1.0, 0.2))  # enqueue unknown
    meter.add(steps[0])
    line = meter.take(steps[0])
    assert line.enqueue_seconds is None and line.gc_collections is None
