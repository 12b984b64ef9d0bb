"""bench_allreduce.py's device-time ratios and the target line judged on them (the GPU-only timing itself runs on
the device plans; its rows are plain dicts, checked here)."""

from __future__ import annotations

import pytest

from tests.megatron._bench_scripts import load_bench_script

bench = load_bench_script("bench_allreduce")

NCCL_MS = {"nccl_allreduce_fp32": 1.0, "nccl_allreduce_bf16": 0.5, "nccl_reduce_scatter_fp32": 0.6,
           "nccl_reduce_scatter_bf16": 0.3}


def _row(size_mib: int, store_ar_ms: float, owners_ms: float) -> dict:
    dev = dict(NCCL_MS, agoq_peer_store_allreduce=store_ar_ms, agoq_peer_store_reduce_to_owners=owners_ms)
    return {"size_mib": size_mib, "device_ms": dev, "device_speedups": bench.device_speedups(dev)}


def test_device_speedups_are_nccl_over_agoq_for_the_cases_that_ran():
    sp = bench.device_speedups(dict(NCCL_MS, agoq_peer_store_allreduce=0.25, agoq_peer_store_reduce_to_owners=0.2))
    assert sp["store_ar_vs_allreduce_fp32"] == pytest.approx(4.0)
    assert sp["store_ar_vs_allreduce_bf16"] == pytest.approx(2.0)
    assert sp["store_owners_vs_reduce_scatter_fp32"] == pytest.approx(3.0)
    assert sp["store_owners_vs_reduce_scatter_bf16"] == pytest.approx(1.5)
    assert "fp32_input_ar_vs_allreduce_fp32" not in sp  # its agoq case did not run


def test_device_target_line_names_each_reduction_and_the_sizes_it_misses():
    # 64 MiB: AR 2.5x / 1.25x meets >= 2x / 1.1x; owners 0.6/0.35 = 1.71x misses 2x.
    # 256 MiB: AR 0.5/0.4 = 2.5x / 1.25x misses 1.3x bf16; owners 0.6/0.2 = 3x / 1.5x meets.
    # 16 MiB is below every target and is not judged.
    rows = [_row(16, 5.0, 5.0), _row(64, 0.4, 0.35), _row(256, 0.4, 0.2)]
    line = bench.device_target_line(rows)
    assert line == ("device time: store all-reduce missed at sizes (MiB) [256]; "
                    "store to owners missed at sizes (MiB) [64]")
    met = bench.device_target_line([_row(64, 0.2, 0.1), _row(1024, 0.2, 0.1)])
    assert met == "device time: store all-reduce targets met; store to owners targets met"


def test_device_target_line_says_when_no_size_was_judged():
    # the socket link / --no-peer (no store cases on device time) or only sizes below 64 MiB: nothing to judge,
    # which must not read as "targets met"
    no_store = {"size_mib": 256, "device_ms": dict(NCCL_MS), "device_speedups": bench.device_speedups(dict(NCCL_MS))}
    for rows in ([no_store], [_row(16, 0.01, 0.01)]):
        assert bench.device_target_line(rows).startswith("device time: no size judged")
