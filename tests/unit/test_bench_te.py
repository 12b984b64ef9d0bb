"""benchmarks/bench_te.py: its baseline driver imports nothing of agoq, and its parser reads Megatron's own log."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_te", REPO / "benchmarks" / "bench_te.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_upstream_driver_is_megatron_alone():
    tree = ast.parse((REPO / "benchmarks" / "megatron_gpt_upstream.py").read_text())
    imported = {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "agoq" not in imported and "megatron" in imported


def test_timings_read_megatron_log_lines():
    bench = _bench()
    line = (" [2026-12-07 06:38:45] iteration        {i}/      10 | consumed samples:           12 | "
            "elapsed time per iteration (ms): {ms} | throughput per GPU (TFLOP/s/GPU): {tf} | "
            "learning rate: 3.0E-05 | lm loss: 1.0E+01 |")
    log = "\n".join(line.format(i=i, ms=1000.0 + i, tf=400.0 + i) for i in range(1, 11))
    got = bench.timings(log, skip=4)
    assert got["iteration_ms"] == [1000.0 + i for i in range(1, 11)]
    assert got["median_iteration_ms"] == 1007.0  # iterations 4..10
    assert got["median_tflops_per_gpu"] == 407.0


def test_rows_use_their_driver_and_the_same_model():
    bench = _bench()
    for name in bench.ROWS:
        cmd = bench.row_command(name, "1b", 10, 16, Path("/tmp/r.json"), 29500)
        driver = bench.ROWS[name][0]
        assert str(bench.UPSTREAM if driver == bench.ZERO_EDIT else driver) in cmd
        assert (cmd[cmd.index(str(bench.UPSTREAM)) - 1] == "agoq.megatron_lm") == (driver == bench.ZERO_EDIT) \
            if driver != bench.DOOR else True
        assert cmd[cmd.index("--num-layers") + 1] == "16" and "--mock-data" in cmd
        local = name.startswith(("agoq/", "local/"))
        assert ("--transformer-impl" in cmd and cmd[cmd.index("--transformer-impl") + 1] == "local") == local, name
        assert ("--bench-json" in cmd) == (driver != bench.DOOR), name


def test_8b_shape_carries_its_vocabulary_and_the_micro_batch_override():
    bench = _bench()
    cmd = bench.row_command("agoq_te/full_fp8", "8b", 10, 8, Path("/tmp/r.json"), 29500, micro_batch=1)
    assert cmd[cmd.index("--vocab-size") + 1] == "128256" and cmd[cmd.index("--hidden-size") + 1] == "4096"
    assert cmd[cmd.index("--micro-batch-size") + 1] == "1" and cmd[cmd.index("--global-batch-size") + 1] == "8"
    one_b = bench.row_command("agoq_te/full_fp8", "1b", 10, 16, Path("/tmp/r.json"), 29500)
    assert one_b[one_b.index("--vocab-size") + 1] == "32000" and one_b[one_b.index("--micro-batch-size") + 1] == "2"
