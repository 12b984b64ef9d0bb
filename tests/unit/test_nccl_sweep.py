"""benchmarks/nccl_sweep.py without a GPU: the settings, their command lines (accepted by bench_allreduce.py's own
parser), each launch's environment, NCCL's TUNING log tally, and that a refused or dead launch is recorded in the
index (stand-in runner; torchrun is not started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.megatron._bench_scripts import load_bench_script

sweep = load_bench_script("nccl_sweep")
bench = load_bench_script("bench_allreduce")


def test_settings_cover_every_algorithm_and_protocol_per_collective_plus_the_default():
    names = [s.name for s in sweep.settings()]
    assert len(names) == len(set(names)) == 14
    for coll in ("allreduce", "reduce_scatter"):
        mine = [s for s in sweep.settings() if s.collective == coll]
        default = [s for s in mine if not s.env]
        assert [s.name for s in default] == [f"{coll}_default"] and default[0].baselines == ("symm", "window")
        combos = {(s.env["NCCL_ALGO"], s.env["NCCL_PROTO"]) for s in mine if s.env}
        assert combos == {(a, p) for a in ("Ring", "Tree") for p in ("LL", "LL128", "Simple")}
        assert all(s.baselines == () for s in mine if s.env)
    assert [s.name for s in sweep.settings(("reduce_scatter",))][:2] == ["reduce_scatter_default",
                                                                         "reduce_scatter_ring_ll"]


@pytest.mark.parametrize("name", ["allreduce_default", "reduce_scatter_tree_ll128"])
def test_command_lines_launch_the_bench_in_baseline_only_mode(name, tmp_path):
    setting = next(s for s in sweep.settings() if s.name == name)
    cmd = sweep.command(setting, 4, [16, 1024], tmp_path, warmup=3, iters=7)
    assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone"]
    assert Path(cmd[6]) == Path(bench.__file__)
    args = bench.build_parser().parse_args(cmd[7:])  # the bench accepts what the driver passes
    assert args.baseline_only and args.collectives == [setting.collective] and args.sizes_mib == [16, 1024]
    assert (args.warmup, args.iters) == (3, 7) and args.out == str(tmp_path / f"{name}.json")
    assert args.baselines == list(setting.baselines)  # [] for a swept setting: NCCL alone


def test_launch_env_replaces_the_parents_algorithm_and_adds_the_tuning_log(tmp_path):
    parent = {"PATH": "/bin", "NCCL_ALGO": "NVLS", "NCCL_PROTO": "LL", "NCCL_NVLS_ENABLE": "0"}
    ring = next(s for s in sweep.settings() if s.name == "allreduce_ring_simple")
    env = sweep.launch_env(ring, tmp_path, tuning_log=True, base=parent)
    assert (env["NCCL_ALGO"], env["NCCL_PROTO"], env["NCCL_NVLS_ENABLE"]) == ("Ring", "Simple", "0")
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "TUNING"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "allreduce_ring_simple.nccl.%h.%p.log")
    default = sweep.launch_env(sweep.settings()[0], tmp_path, tuning_log=False, base=parent)
    assert "NCCL_ALGO" not in default and "NCCL_PROTO" not in default and "NCCL_DEBUG" not in default
    assert parent["NCCL_ALGO"] == "NVLS"  # the parent's dict is not changed


def test_tuning_tally_counts_algorithms_and_symmetric_kernels():
    log = ("h:1:2 [0] NCCL INFO AllReduce: 83886080 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..31}\n"
           "h:1:2 [0] NCCL INFO AllReduce: 83886080 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..31}\n"
           "h:1:2 [0] NCCL INFO AllReduce: 4 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0}\n"
           "h:1:2 [0] NCCL INFO AllReduce [Symmetric]: 83886080 Bytes -> Kernel AllReduce_RSxLD_AGxST\n")
    t = sweep.tally_tuning(log)
    assert t["algo_proto_counts"] == {"AllReduce 83886080 RING SIMPLE": 2, "AllReduce 4 TREE LL": 1}
    assert t["symmetric_lines"] == 1 and "RSxLD" in t["symmetric_examples"][0] and not t["note"]
    assert sweep.tally_tuning("")["note"].startswith("no TUNING line")


def _fake_runner(returncode: int, report: dict | None = None, hang: bool = False):
    def run(cmd, env, cwd, capture_output, text, timeout=None):
        out = cmd[cmd.index("--out") + 1]
        if report is not None:
            Path(out).write_text(json.dumps(report))
        Path(env["NCCL_DEBUG_FILE"].replace("%h.%p", "h.1")).write_text(
            "NCCL INFO ReduceScatter: 1024 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}\n")
        if hang:
            raise subprocess.TimeoutExpired(cmd, 5, output="partial", stderr="")
        return subprocess.CompletedProcess(cmd, returncode, stdout="out\n", stderr="NCCL WARN no algorithm\n")
    return run


def test_refused_dead_and_hung_launches_are_recorded_in_the_index(tmp_path):
    setting = next(s for s in sweep.settings() if s.name == "reduce_scatter_tree_ll")
    cmd = sweep.command(setting, 2, [16], tmp_path, 1, 1)
    env = sweep.launch_env(setting, tmp_path, tuning_log=True, base={"PATH": "/bin"})
    refused = {"rows": [{"size_mib": 16, "baseline_errors": {"nccl_reduce_scatter_bf16": "DistBackendError: NCCL "
                                                                                          "error: invalid usage"}}]}
    entry = sweep.run_setting(setting, cmd, env, tmp_path, 60, runner=_fake_runner(0, refused))
    assert entry["returncode"] == 0 and entry["json"] == "reduce_scatter_tree_ll.json"
    assert entry["errors"] == {"16 MiB nccl_reduce_scatter_bf16": "DistBackendError: NCCL error: invalid usage"}
    assert entry["nccl_tuning"]["algo_proto_counts"] == {"ReduceScatter 1024 RING LL": 1}  # what NCCL really ran
    assert "NCCL WARN" in (tmp_path / "reduce_scatter_tree_ll.log").read_text()
    (tmp_path / "reduce_scatter_tree_ll.json").unlink()
    dead = sweep.run_setting(setting, cmd, env, tmp_path, 60, runner=_fake_runner(1))
    assert dead["returncode"] == 1 and dead["json"] is None and "no report written" in dead["errors"]["launch"]
    assert "NCCL WARN no algorithm" in dead["output_tail"]
    hung = sweep.run_setting(setting, cmd, env, tmp_path, 60, runner=_fake_runner(0, hang=True))
    assert hung["returncode"] == "timeout" and "TIMEOUT" in hung["output_tail"]


def test_list_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    assert sweep.main(["--nproc", "2", "--out-dir", str(tmp_path / "s"), "--list", "--only",
                       "allreduce_ring_ll128"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("NCCL_ALGO=Ring NCCL_PROTO=LL128 ") and "--baseline-only" in out[0]
    assert not (tmp_path / "s").exists()
    with pytest.raises(SystemExit):
        sweep.main(["--list", "--only", "allreduce_nvls_simple"])
