"""Issue 46's bf16 baselines in bench_allreduce.py (benchmarks/allreduce_baselines.py): the bus-bandwidth convention,
the guard that records a failing baseline (never swallowed, the other cases run on), the --baselines / --collectives
rules, and --baseline-only end to end on a one-rank gloo group with stand-in baselines (one raising, one wrong)."""

from __future__ import annotations

import argparse
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.megatron._bench_scripts import load_bench_script

bench = load_bench_script("bench_allreduce")
ab = sys.modules[bench.ExtraBaselines.__module__]  # the module bench_allreduce itself imported


def test_bus_bandwidth_follows_nccl_tests():
    # 1e9 bytes in 1 ms = 1000 GB/s algorithm bandwidth
    assert ab.bus_bandwidth_gbps("allreduce", 10**9, 1.0, 2) == pytest.approx(1000.0)  # x 2 (W-1)/W = 1
    assert ab.bus_bandwidth_gbps("allreduce", 10**9, 1.0, 4) == pytest.approx(1500.0)  # x 1.5
    assert ab.bus_bandwidth_gbps("reduce_scatter", 10**9, 2.0, 4) == pytest.approx(375.0)  # 500 x 0.75
    assert ab.bus_bandwidth_gbps("allgather", 10**9, 1.0, 8) == pytest.approx(875.0)
    with pytest.raises(ValueError, match="unknown collective"):
        ab.bus_factor("alltoall", 2)
    with pytest.raises(ValueError, match="> 0 ms"):
        ab.bus_bandwidth_gbps("allreduce", 1, 0.0, 2)


def test_case_bytes_are_the_full_input_and_the_gathered_output():
    assert ab.case_bytes("nccl_allreduce_fp32", 1000, 4) == 4000
    assert ab.case_bytes("symm_reduce_scatter_bf16", 1000, 4) == 2000  # the full input, not the shard
    assert ab.case_bytes("raw_int8_allgather", 1000, 4) == 4000  # W x N bytes gathered


def test_rows_get_bus_bandwidth_and_link_fraction_for_baselines_only():
    row = {"world_size": 2, "numel": 250_000_000,  # 500 MB of bf16
           "ms": {"nccl_allreduce_bf16": 2.0, "symm_reduce_scatter_bf16": 1.0, "agoq_peer_store_allreduce": 0.1},
           "device_ms": {"nccl_allreduce_bf16": 1.25}}
    ab.add_bus_bandwidth(row, link_peak_gbps=500.0)
    assert row["busbw_gbps"] == pytest.approx({"nccl_allreduce_bf16": 250.0, "symm_reduce_scatter_bf16": 250.0})
    assert row["device_busbw_gbps"] == pytest.approx({"nccl_allreduce_bf16": 400.0})
    assert row["device_link_fraction"] == pytest.approx({"nccl_allreduce_bf16": 0.8})
    assert "agoq_peer_store_allreduce" not in row["busbw_gbps"]
    bare = {"world_size": 2, "numel": 10, "ms": {"nccl_allreduce_bf16": 1.0}}
    ab.add_bus_bandwidth(bare, link_peak_gbps=None)
    assert "busbw_gbps" in bare and "link_fraction" not in bare


def test_a_guarded_baseline_that_raises_is_recorded_and_printed_and_the_others_run(capsys):
    calls = []

    def boom():
        raise RuntimeError("one_shot_all_reduce: input size must be 16-byte aligned")

    def device_fails(fn):
        if fn is late:
            raise RuntimeError("device run refused")
        return 0.5, 0.01, True

    late = lambda: calls.append("late")  # noqa: E731
    cases = {"nccl_allreduce_bf16": lambda: calls.append("nccl"), "symm_oneshot_allreduce_bf16": boom,
             "nccl_window_allreduce_bf16": late}
    out = ab.time_cases(cases, {"symm_oneshot_allreduce_bf16", "nccl_window_allreduce_bf16"}, lambda: None,
                        lambda fn: (fn(), 1.0)[1], device_fails)
    assert out["ms"] == {"nccl_allreduce_bf16": 1.0}  # the window case's single-call time went with its failure
    assert out["device_ms"] == {"nccl_allreduce_bf16": 0.5}
    assert out["errors"] == {"symm_oneshot_allreduce_bf16": "RuntimeError: one_shot_all_reduce: input size must be "
                                                            "16-byte aligned",
                             "nccl_window_allreduce_bf16": "RuntimeError: device run refused"}
    err = capsys.readouterr().err
    assert "baseline symm_oneshot_allreduce_bf16 FAILED" in err and "16-byte aligned" in err and "[rank 0]" in err
    with pytest.raises(RuntimeError, match="16-byte"):  # an unguarded case (agoq's, NCCL's in a full run) raises
        ab.time_cases({"agoq": boom}, set(), lambda: None, lambda fn: (fn(), 1.0)[1])


def test_a_kind_whose_setup_fails_is_recorded_and_its_cases_reported_not_run(monkeypatch, capsys):
    def no_symm(*_):
        raise AttributeError("module 'torch.distributed._symmetric_memory' has no attribute 'empty'")

    monkeypatch.setattr(ab, "_SymmBuffers", no_symm)
    extras = ab.ExtraBaselines(["symm"], group=None, max_numel=16, device=torch.device("cpu"),
                               collectives=("allreduce",))
    assert extras.cases(16) == {}
    assert set(extras.setup_errors) == {"symm_setup"} and "no attribute 'empty'" in extras.setup_errors["symm_setup"]
    not_run = extras.not_run()
    assert set(not_run) == {"symm_oneshot_allreduce_bf16", "symm_twoshot_allreduce_bf16"}  # the RS was not asked
    assert all(v.startswith("not run: symm setup failed") for v in not_run.values())
    assert "symm_setup FAILED" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown"):
        ab.ExtraBaselines(["multimem"], None, 16, torch.device("cpu"))


def _args(*argv: str) -> argparse.Namespace:
    parser = bench.build_parser()
    args = parser.parse_args(list(argv))
    args.device = "cpu" if args.smoke else "cuda"
    bench.resolve_baseline_args(args, parser)
    return args


def test_baseline_flags_default_by_link_and_refuse_what_cannot_run():
    assert _args().baselines == ["symm", "window"] and _args().collectives == ("allreduce", "reduce_scatter")
    assert _args("--link", "socket").baselines == [] and _args("--smoke").baselines == []
    assert _args("--baselines").baselines == []  # no value: none
    assert _args("--baseline-only", "--collectives", "reduce_scatter").collectives == ("reduce_scatter",)
    for argv in (["--smoke", "--baselines", "symm"], ["--link", "socket", "--baselines", "window"],
                 ["--collectives", "allreduce"]):
        with pytest.raises(SystemExit):
            _args(*argv)


class _StandIn:
    """Stand-in 'symm' buffers on CPU: the one-shot raises, the two-shot is a correct all-reduce, the reduce-scatter
    writes zeros (a wrong result)."""

    def __init__(self, group, max_numel, device):
        self.buf = torch.zeros(max_numel, dtype=torch.bfloat16)
        self.shard = torch.zeros(max_numel, dtype=torch.bfloat16)

    def cases(self, numel):
        def refused():
            raise RuntimeError("two_shot_all_reduce: Not implemented for world_size=1")

        return {"symm_oneshot_allreduce_bf16": refused,
                "symm_twoshot_allreduce_bf16": lambda: dist.all_reduce(self.buf[:numel]),
                "symm_reduce_scatter_bf16": lambda: self.shard[:numel].zero_()}

    def results(self, numel):
        return {"symm_oneshot_allreduce_bf16": (self.buf[:numel], True),
                "symm_twoshot_allreduce_bf16": (self.buf[:numel], True),
                "symm_reduce_scatter_bf16": (self.shard[:numel], False)}

    def load(self, x16):
        self.buf[: x16.numel()].copy_(x16)

    def close(self):
        pass


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_baseline_only_rows_time_check_and_record_every_baseline(one_rank_group, monkeypatch):
    monkeypatch.setattr(ab, "_SymmBuffers", _StandIn)
    args = _args("--smoke", "--baseline-only")
    args.baselines, args.warmup, args.iters, args.cycles_per_ms = ["symm"], 1, 2, 0.0
    numel = bench.gradient_numel(1, 1, args.format)
    args.extras = ab.ExtraBaselines(args.baselines, one_rank_group, numel, torch.device("cpu"), args.collectives)
    row = bench.bench_size(1, args.format, torch.device("cpu"), args)
    assert row["baseline_only"] and row["numel"] == numel == 262144
    assert set(row["ms"]) == {"nccl_allreduce_bf16", "nccl_reduce_scatter_bf16", "symm_twoshot_allreduce_bf16",
                              "symm_reduce_scatter_bf16"}
    assert row["baseline_errors"] == {"symm_oneshot_allreduce_bf16": "RuntimeError: two_shot_all_reduce: Not "
                                                                     "implemented for world_size=1"}
    check = row["baseline_check"]
    assert check["symm_twoshot_allreduce_bf16"]["ok"] and check["nccl_allreduce_bf16"]["ok"]
    assert check["nccl_reduce_scatter_bf16"]["ok"]
    assert not check["symm_reduce_scatter_bf16"]["ok"]  # zeros: 100 % error
    assert check["symm_reduce_scatter_bf16"]["rel_l2_err_vs_fp32"] == pytest.approx(1.0)
    assert "symm_oneshot_allreduce_bf16" not in check
    lines = bench.baseline_lines(row)
    assert any("BASELINE FAILED symm_oneshot_allreduce_bf16" in line for line in lines)
    assert any("BASELINE CHECK FAILED" in line and "symm_reduce_scatter_bf16" in line for line in lines)


def _one_rank_fails(rank: int, world: int) -> dict:
    """A guarded case that raises on rank 1 before its collective while rank 0 enters it (gloo: rank 0's host
    waits for a peer that never comes)."""
    baselines = load_bench_script("allreduce_baselines")

    def case():
        if rank == 1:
            raise RuntimeError("op refused on this rank only")
        dist.all_reduce(torch.ones(4))

    out = baselines.time_cases({"one_sided": case}, {"one_sided"}, lambda: None, lambda fn: fn() or 1.0,
                               watchdog=baselines.StallWatchdog(3.0))
    if rank == 1:  # goes on with its next cases (here: stays alive; a rank that exits resets gloo's connection)
        time.sleep(15)
    return out["errors"]


def test_a_case_failing_on_one_rank_ends_the_waiting_rank_instead_of_hanging():
    """Rank 1 records its failure and returns; rank 0, stuck in the collective, is ended by the stall watchdog with
    exit 3 within seconds (gloo's own timeout is 30 minutes, the GPU step's limit 10)."""
    from agoq.testing.dist import RankError, spawn_ranks

    with pytest.raises(RankError) as exc:
        spawn_ranks(2, _one_rank_fails, timeout_s=60)
    text = str(exc.value)
    assert "rank 0 exited with code 3 before reporting a result" in text
    assert "did not finish within" not in text  # ended by the watchdog, not by the test's own limit


def test_the_watchdog_stays_quiet_for_cases_that_end():
    baselines = load_bench_script("allreduce_baselines")
    fired = []
    watchdog = baselines.StallWatchdog(0.5, exit_fn=fired.append)
    for _ in range(3):
        with watchdog.case("quick"):
            pass
    time.sleep(1.0)
    assert fired == []
    with watchdog.case("slow"):
        time.sleep(1.0)
    assert fired == [baselines.STALL_EXIT]
