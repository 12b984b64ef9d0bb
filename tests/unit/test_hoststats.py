"""agoq.megatron.train.hoststats: the hypervisor's steal time per step from /proc/stat (the 8th value of the "cpu"
line, USER_HZ ticks), None where it cannot be read; and the logged interval's mean of it."""

from __future__ import annotations

import os

import pytest

from agoq.megatron.train import hoststats

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
