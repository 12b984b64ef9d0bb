"""agoq.train.hoststats: the hypervisor's steal time per step from /proc/stat (the 8th value of the "cpu"
line, USER_HZ ticks), None where it cannot be read; and the logged interval's mean of it."""

from __future__ import annotations

import os

import pytest

from agoq.train import hoststats

HZ = os.sysconf("SC_CLK_TCK")


def _stat(tmp_path, line: str):
    path = tmp_path / "stat"
    path.write_text(line + "\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return str(path)


def test_steal_is_the_eighth_value_of_the_cpu_line(tmp_path):
    path = _stat(tmp_path, f"cpu  100 0 50 9000 10 0 3 {7 * HZ} 0 0")
    assert hoststats.cpu_steal_seconds(path) == pytest.approx(7.0)
    before = hoststats.cpu_steal_seconds(path)
    _stat(tmp_path, f"cpu  120 0 60 9100 10 0 3 {9 * HZ} 0 0")
    assert hoststats.steal_since(before, path) == pytest.approx(2.0)


def test_unreadable_or_short_stat_gives_none(tmp_path):
    assert hoststats.cpu_steal_seconds(str(tmp_path / "missing")) is None
    short = _stat(tmp_path, "cpu  100 0 50 9000 10 0 3")  # kernels before 2.6.11: no steal field
    assert hoststats.cpu_steal_seconds(short) is None
    assert hoststats.steal_since(None, short) is None


@pytest.mark.skipif(not os.path.exists(hoststats.PROC_STAT), reason="Linux only")
def test_this_host_reads_a_steal_time():
    value = hoststats.cpu_steal_seconds()
    assert value is not None and value >= 0.0


def _task(root, tid: int, name: str, on_cpu_ns: int, wait_ns: int):
    task = root / str(tid)
    task.mkdir(exist_ok=True)
    (task / "schedstat").write_text(f"{on_cpu_ns} {wait_ns} 12\n")
    (task / "comm").write_text(name + "\n")


def test_threads_since_lists_main_first_then_the_busiest_with_cpu_and_wait_seconds(tmp_path):
    """schedstat's first two values are ns on a CPU and ns runnable-but-waiting (proc(5)); a thread born inside the
    step counts from zero; the main thread leads whatever its CPU time; the list is cut at ``limit``."""
    _task(tmp_path, 10, "python", 1_000_000_000, 0)
    _task(tmp_path, 11, "pt_autograd_0", 0, 0)
    _task(tmp_path, 12, "idle", 5_000_000_000, 0)
    before = hoststats.thread_times(str(tmp_path))
    assert before[11] == ("pt_autograd_0", 0.0, 0.0)
    _task(tmp_path, 10, "python", 1_250_000_000, 30_000_000)
    _task(tmp_path, 11, "pt_autograd_0", 400_000_000, 1_000_000)
    _task(tmp_path, 13, "pin_memory", 100_000_000, 0)  # new in the step
    rows = hoststats.threads_since(before, 10, str(tmp_path), limit=3)
    assert [r["name"] for r in rows] == ["python", "pt_autograd_0", "pin_memory"]
    assert rows[0] == {"name": "python", "main": True, "cpu_seconds": 0.25, "wait_seconds": 0.03}
    assert rows[1]["cpu_seconds"] == pytest.approx(0.4) and rows[2]["cpu_seconds"] == pytest.approx(0.1)
    assert hoststats.threads_since(None, 10, str(tmp_path)) is None
    assert hoststats.thread_times(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not os.path.exists(hoststats.PROC_TASKS), reason="Linux only")
def test_this_process_reads_its_main_thread_or_says_none():
    """Where schedstat is readable the calling thread is found by its OS id; some kernels lack it (None)."""
    tid = hoststats.main_thread_id()
    times = hoststats.thread_times()
    if os.path.exists(f"{hoststats.PROC_TASKS}/{tid}/schedstat"):
        assert times is not None and tid in times and times[tid][1] > 0.0  # this thread has run
    else:
        assert times is None


def test_gc_meter_counts_collections_only_while_installed():
    import gc
    meter = hoststats.GCMeter().install()
    try:
        gc.collect()
        gc.collect()
    finally:
        meter.remove()
    count, seconds = meter.reading()
    assert count == 2 and seconds > 0.0
    gc.collect()
    assert meter.reading()[0] == 2 and meter not in gc.callbacks
