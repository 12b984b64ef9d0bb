"""benchmarks/bench_te.py: its baseline driver imports nothing of agoq, and its parser reads Megatron's own log."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

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


# -- the multi-GPU suites (benchmarks/te_layouts.py) ------------------------------------------------------------------

def _layouts():
    return _bench().te_layouts


def _flag(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_suite_rows_layouts_multiply_to_their_gpus_and_run_as_data_parallel_users_do():
    bench, layouts = _bench(), _layouts()
    assert set(layouts.SUITES) == {"dp_1b", "dp2_pp2_3b", "eqmem_8b", "cp_16k"}
    for suite in layouts.SUITES.values():
        for name, row in suite.items():
            cmd = bench.layout_command(row, 20, Path("/tmp/r.json"), 29500)
            sizes = [int(_flag(cmd, f) or 1) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                                       "--context-parallel-size")]
            assert sizes[0] * sizes[1] * sizes[2] * row.dp == row.nproc == int(_flag(cmd, "--nproc-per-node")), name
            assert ("--overlap-grad-reduce" in cmd) == (row.dp > 1) and "--ddp-bucket-size" not in cmd, name
            assert ("--use-distributed-optimizer" in cmd) >= (row.dp > 1), name
            assert len([w for w in cmd if w.startswith("--")]) == len({w for w in cmd if w.startswith("--")}), name
            assert ("--sequence-parallel" in cmd) == (sizes[0] > 1), name
            assert str(bench.UPSTREAM) in cmd and ("agoq.megatron_lm" in cmd) == (row.side == "agoq"), name
            assert ("--grad-reduce-in-bf16" in cmd) == name.endswith("bf16_reduce"), name
            assert ("socket" in name) == (layouts.row_env(row).get("NCCL_NET") == "Socket"), name
            assert (layouts.row_env(row).get("CUDA_DEVICE_MAX_CONNECTIONS") == "1") == (sizes[0] > 1 or sizes[2] > 1)
            micro, glob = int(_flag(cmd, "--micro-batch-size")), int(_flag(cmd, "--global-batch-size"))
            assert glob % (micro * row.dp) == 0, name


def test_suite_shapes_and_sequences():
    bench, layouts = _bench(), _layouts()
    dp = layouts.SUITES["dp_1b"]
    assert {r.nproc for r in dp.values()} == {2, 4} and {r.dp for r in dp.values()} == {2, 4}
    three = bench.layout_command(layouts.SUITES["dp2_pp2_3b"]["dp2_pp2_3b/te_fp8/bf16_reduce"], 20, Path("/r"), 1)
    assert _flag(three, "--hidden-size") == "3072" and _flag(three, "--num-layers") == "28"
    assert _flag(three, "--vocab-size") == "128256" and _flag(three, "--pipeline-model-parallel-size") == "2"
    assert _flag(three, "--fp8-recipe") == "delayed"
    eight = layouts.SUITES["eqmem_8b"]
    assert {r.nproc for r in eight.values()} == {4} and {r.side for r in eight.values()} == {"megatron", "agoq"}
    assert all(r.base.endswith("fp8") or "fp8_delayed" in r.base for r in eight.values())
    assert all(layouts.row_env(r)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" for r in eight.values())
    cp2 = bench.layout_command(layouts.SUITES["cp_16k"]["cp_16k/cp2/agoq_te/full"], 20, Path("/r"), 1)
    cp1 = bench.layout_command(layouts.SUITES["cp_16k"]["cp_16k/cp1/agoq_te/full"], 20, Path("/r"), 1)
    assert _flag(cp2, "--seq-length") == _flag(cp2, "--max-position-embeddings") == "16384"
    assert _flag(cp2, "--context-parallel-size") == "2" and "--context-parallel-size" not in cp1
    # the twins differ in the GPUs and the CP size only: same data, seed, batch and flags otherwise
    strip = {"--context-parallel-size", "2", "--nproc-per-node", "1"}
    assert [w for w in cp2 if w not in strip] == [w for w in cp1 if w not in strip]


def _row(name, side, tokens, peak_gib, rc=0, losses=(1.0,)):
    return {"name": name, "side": side, "tokens_per_s": tokens, "returncode": rc, "losses": list(losses),
            "peak_allocated_bytes": None if peak_gib is None else int(peak_gib * 2**30), "layout": {},
            "planner": {"not_modelled": "x"}}


def test_equal_memory_picks_each_sides_fastest_fitting_row_and_the_ratio():
    layouts = _layouts()
    rows = [_row("m/fast_big", "megatron", 100.0, 70.0), _row("m/slow_small", "megatron", 60.0, 30.0),
            _row("m/oom", "megatron", None, None, rc=1, losses=()),
            _row("a/fast", "agoq", 90.0, 35.0), _row("a/fastest_big", "agoq", 140.0, 59.0),
            _row("a/crashed_fast", "agoq", 500.0, 10.0, rc=1)]
    table = {e["budget_gib"]: e for e in layouts.equal_memory(rows, budgets_gib=(20.0, 40.0, 60.0, 77.89))}
    assert table[20.0]["megatron"] is None and table[20.0]["agoq"] is None and "ratio" not in table[20.0]
    assert table[40.0]["megatron"]["name"] == "m/slow_small" and table[40.0]["agoq"]["name"] == "a/fast"
    assert table[40.0]["ratio"] == 1.5 and table[40.0]["met"] is True
    assert table[60.0]["agoq"]["name"] == "a/fastest_big" and table[60.0]["ratio"] == 140.0 / 60.0
    assert table[77.89]["megatron"]["name"] == "m/fast_big" and table[77.89]["ratio"] == 1.4
    assert table[77.89]["agoq"]["peak_gib"] == 59.0
    assert layouts.equal_memory(rows, budgets_gib=(80.0,), target=1.5)[0]["met"] is False


def test_cp_losses_compare_each_cp2_row_with_its_cp1_twin():
    layouts = _layouts()
    assert layouts.cp_twin("cp_16k/cp2/agoq_te/full") == "cp_16k/cp1/agoq_te/full"
    assert layouts.cp_twin("cp_16k/cp1/agoq_te/full") is None and layouts.cp_twin("dp2_1b/te_fp8/x") is None
    rows = [_row("cp_16k/cp1/agoq_te/full", "agoq", 1.0, 20.0, losses=(10.0, 5.0, 2.0)),
            _row("cp_16k/cp2/agoq_te/full", "agoq", 1.0, 11.0, losses=(10.0, 5.5, 1.9, 1.0)),
            _row("cp_16k/cp2/te/bf16", "megatron", 1.0, 11.0, losses=(10.0,))]  # its twin did not run
    (entry,) = layouts.cp_losses(rows)
    assert entry["row"] == "cp_16k/cp2/agoq_te/full" and entry["iterations"] == [4, 3]
    assert entry["max_abs_diff"] == pytest.approx(0.5) and entry["max_rel_diff"] == pytest.approx(0.1)
    assert entry["last"] == [1.9, 2.0] and entry["twin_peak_allocated_bytes"] == 20 * 2**30


def test_cp_is_not_modelled_by_the_planner_and_says_so(tmp_path):
    """The CP rows' note stands only while agoq.plan has no context-parallel term: this fails once it has one."""
    bench, layouts = _bench(), _layouts()
    plan = Path(bench.REPO) / "agoq" / "plan"
    assert not any("context_parallel" in f.read_text() for f in plan.glob("*.py"))
    row = layouts.SUITES["cp_16k"]["cp_16k/cp2/agoq_te/full"]
    assert bench.planner_prediction([], row) == {"not_modelled": layouts.CP_NOT_MODELLED}
    twin = layouts.SUITES["cp_16k"]["cp_16k/cp1/agoq_te/full"]
    predicted = bench.planner_prediction(bench.layout_command(twin, 20, tmp_path / "r.json", 1), twin)
    assert predicted["predicted_activation_bytes"] > 0 and predicted["predicted_peak_bytes"] > \
        predicted["predicted_persistent_bytes"]
    dp = layouts.SUITES["dp_1b"]["dp2_1b/agoq_te/full"]
    refused = bench.planner_prediction(bench.layout_command(dp, 20, tmp_path / "r.json", 1), dp)
    assert "--dp 2" in refused["not_modelled"] and "predicted_peak_bytes" not in refused


def test_layout_row_reads_every_ranks_peak_and_each_stages(tmp_path, monkeypatch):
    """run_layout_row on a stand-in command: the row's peak is the largest rank's, each stage's is its ranks' max."""
    bench, layouts = _bench(), _layouts()
    row = layouts.SUITES["dp2_pp2_3b"]["dp2_pp2_3b/te_fp8/fp32_reduce"]
    record = tmp_path / "dp2_pp2_3b_te_fp8_fp32_reduce.json"
    peaks = {0: 30, 1: 31, 2: 20, 3: 22}  # ranks 0-1 stage 0, 2-3 stage 1 (Megatron's order: dp before pp)

    def fake_run(command, env, cwd, capture_output, text, timeout):
        assert "NCCL_NET" not in env  # the NVLink row: no socket stand-in
        for rank, gib in peaks.items():
            Path(f"{record}.rank{rank}").write_text(json.dumps(
                {"rank": rank, "pp_stage": rank // 2, "tp_rank": 0, "dp_rank": rank % 2, "cp_rank": 0,
                 "peak_allocated_bytes": gib * 2**30, "peak_reserved_bytes": (gib + 1) * 2**30}))
        record.write_text(json.dumps({"iterations": [11.0, 9.0], "peak_allocated_bytes": 22 * 2**30,
                                      "peak_reserved_bytes": 23 * 2**30}))
        log = "\n".join(f" iteration {i}/ 20 | elapsed time per iteration (ms): 1000.0 |" for i in range(1, 21))
        return subprocess.CompletedProcess(command, 0, log, "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    Path(f"{record}.rank9").write_text("stale")  # a previous run's file is removed first
    args = argparse.Namespace(iters=20, row_timeout=10, skip=4)
    out = bench.run_layout_row("dp2_pp2_3b/te_fp8/fp32_reduce", row, args, 29500, tmp_path)
    assert out["peak_allocated_bytes"] == 31 * 2**30 and out["stage_peaks_bytes"] == [31 * 2**30, 22 * 2**30]
    assert [r["rank"] for r in out["rank_peaks"]] == [0, 1, 2, 3] and out["losses"] == [11.0, 9.0]
    assert out["tokens_per_s"] == 16 * 4096 and out["tokens_per_s_per_gpu"] == 16 * 4096 / 4
    assert out["layout"] == {"tp": 1, "pp": 2, "cp": 1, "dp": 2} and "not_modelled" in out["planner"]
    summary = bench.summarize([out])
    assert summary["planner_error"] == {out["name"]: out["planner"]["not_modelled"]}


def test_suite_selection_by_gpus_and_refusals():
    bench = _bench()
    parse = bench.argparse.ArgumentParser()
    for flag, default in (("--suite", None), ("--nproc", None), ("--rows", None)):
        parse.add_argument(flag, default=default, nargs="*" if flag == "--rows" else None,
                           type=int if flag == "--nproc" else str)
    two = bench._rows_to_run(parse.parse_args(["--suite", "dp_1b", "--nproc", "2"]))
    assert two and {row.nproc for _, row in two} == {2}
    with pytest.raises(SystemExit, match="without --suite"):
        bench._rows_to_run(parse.parse_args(["--nproc", "2"]))
    with pytest.raises(SystemExit, match="not in --suite"):
        bench._rows_to_run(parse.parse_args(["--suite", "cp_16k", "--rows", "te/bf16"]))
