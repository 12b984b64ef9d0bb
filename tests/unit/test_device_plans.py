"""benchmarks/device: the per-machine GPU plans and the detached runner. On the CPU: every suite, test path and
script a plan names exists (a typo fails here, not minutes into a GPU lease), the step runner records exit codes
and time limits and runs only the steps asked for, and detach.sh starts a plan once, polls it and copies its
results."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agoq.testing.procs import REPO_ROOT
from tests.megatron._bench_scripts import load_bench_script

DEVICE = REPO_ROOT / "benchmarks" / "device"
PLANS = ("x1.sh", "x2.sh", "x4.sh", "x4_lanes.sh", "x8.sh", "te4.sh")
LANES = "x4_lanes.sh"  # runs other plans' steps side by side (sub_plan)


def _plan_text(plan: str) -> str:
    return (DEVICE / plan).read_text().replace("\\\n", " ")  # continued lines as one


@pytest.mark.parametrize("script", [*PLANS, "common.sh", "detach.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(DEVICE / script)], check=True)


def _own_steps(text: str) -> list[str]:
    """The steps a plan defines (`step NAME LIMIT ...`), in order."""
    return re.findall(r"^\s*step (\w+) \d+ ", text, flags=re.M)


@pytest.mark.parametrize("plan", PLANS)
def test_every_suite_test_path_and_script_a_plan_names_exists(plan):
    # te4.sh's --suite is benchmarks/bench_te.py's (benchmarks/te_layouts.py), every other plan's bench_pretrain.py's
    suites = load_bench_script("te_layouts" if plan == "te4.sh" else "bench_pretrain").SUITES
    text = _plan_text(plan)
    named = re.findall(r"--suite (\S+)", text)
    assert set(named) <= set(suites), set(named) - set(suites)
    paths = [p for p, glob in re.findall(r"(?<![\w/])((?:tests|benchmarks|scripts)/[\w./:\[\]-]+)(\*?)", text)
             if not glob]
    assert paths
    assert [p for p in paths if not (REPO_ROOT / p.split("::")[0]).exists()] == []
    steps = _own_steps(text)
    assert len(set(steps)) == len(steps)  # names select steps: no two alike
    listed = re.findall(r"^#   ([\w-]+)  ", text, flags=re.M)  # the header's step table, in order
    assert listed == steps


def test_lanes_name_only_steps_their_sub_plans_have():
    text = _plan_text(LANES)
    calls = re.findall(r'sub_plan (\S+) (?:"[^"]*" )?(x\d\.sh) ([\w "$]+?)(?:;|$)', text, flags=re.M)
    assert {plan for _, plan, _ in calls} == {"x1.sh", "x2.sh", "x4.sh"}
    for _, plan, names in calls:
        names = set(names.replace('"$suite"', "").split())
        assert names <= set(_own_steps(_plan_text(plan))), (plan, names)
    looped = re.search(r"for suite in ([\w ]+);", text).group(1).split()
    assert set(looped) <= set(_own_steps(_plan_text("x4.sh")))


def _lanes_calls(tmp_path: Path, steps: list[str]) -> tuple[list[str], list[str]]:
    """x4_lanes.sh with a stand-in interpreter that logs its GPUs and arguments: (the calls, the steps.tsv rows)."""
    stub = tmp_path / "python"
    stub.write_text('#!/usr/bin/env bash\n[ "$1" = -c ] && exit 0\n'
                    f'echo "${{CUDA_VISIBLE_DEVICES:-all}} $*" >> {tmp_path}/calls\n')
    stub.chmod(0o755)
    bin_dir = tmp_path / "bin"  # torchrun stands in the same way (the reductions launch through it)
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/usr/bin/env bash\necho "${{CUDA_VISIBLE_DEVICES:-all}} $*" >> '
                                      f'{tmp_path}/calls\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = {**os.environ, "AGOQ_RESULTS": str(tmp_path / "results"), "PYTHON": str(stub),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", str(DEVICE / LANES), *steps], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [r.split("\t")[0] for r in (tmp_path / "results" / "steps.tsv").read_text().splitlines()]
    return (tmp_path / "calls").read_text().splitlines(), rows


def test_lanes_run_each_asked_step_on_its_own_gpus_in_its_phase(tmp_path):
    """The alone-phase timings run one after another before the lanes, each lane's steps see only their own GPUs,
    the 4-GPU steps see every GPU and come last, and steps nobody asked for do not run."""
    calls, rows = _lanes_calls(tmp_path, ["allreduce", "allreduce4", "eager_pp2", "profile_pp2", "allreduce_socket",
                                          "gpu_tier", "e2e", "e2e4", "capacity_4gpu"])

    def what(line: str) -> str:  # the bench suite, the reduction's link, or the first test path
        words = line.split()
        if "--suite" in words:
            return words[words.index("--suite") + 1]
        if "benchmarks/bench_step_profile.py" in words:
            return "profile " + words[words.index("--nproc-per-node") + 1]
        if "benchmarks/bench_allreduce.py" in words:
            return "socket" if "socket" in words else f"nvlink x{words[words.index('--nproc-per-node') + 1]}"
        return next(w for w in words if w.startswith("tests/"))
    gpus = {what(line): line.split()[0] for line in calls}
    assert gpus == {"nvlink x2": "0,1", "nvlink x4": "0,1,2,3", "graphs_pp2": "0,1", "profile 2": "0,1",
                    "socket": "0,1", "tests/gpu": "0", "tests/e2e/test_peer_store_multigpu.py": "2,3",
                    "tests/e2e/test_layouts_multigpu.py::test_four_gpu_layouts_train_like_pp1": "all",
                    "capacity_4gpu": "0,1,2,3"}, calls
    assert rows[:4] == ["allreduce", "allreduce4", "eager_pp2", "profile_pp2"]  # alone, in this order
    assert sorted(rows[4:7]) == ["allreduce_socket", "e2e", "gpu_tier"]  # the lanes
    assert rows.index("allreduce_socket") < rows.index("gpu_tier")  # lane A: one after the other
    assert rows[7:] == ["e2e4", "capacity_4gpu"]  # the 4-GPU steps wait for the lanes


def test_lanes_run_the_4gpu_suites_only_when_named(tmp_path):
    _, rows = _lanes_calls(tmp_path, [])
    assert "capacity_4gpu" not in rows and "equal_memory_8b_pp4" not in rows
    assert {"allreduce", "allreduce4", "eager_pp2", "allreduce_socket", "e2e", "e2e4"} <= set(rows)


def _run_steps(tmp_path: Path, asked: str, body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AGOQ_RESULTS": str(tmp_path / "results"), "PYTHON": sys.executable}
    script = f'source "{DEVICE / "common.sh"}" {asked}\n{body}\n'
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_step_runner_records_exit_codes_limits_and_runs_only_the_steps_asked_for(tmp_path):
    body = "step ok 20 true\nstep fails 20 false\nstep slow 1 sleep 30\nstep skipped 20 true\n"
    proc = _run_steps(tmp_path, "ok fails slow", body)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("\t") for line in (tmp_path / "results" / "steps.tsv").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in rows] == [("ok", "0"), ("fails", "1"), ("slow", "124")]
    assert int(rows[2][2]) < 15  # the limit stopped it, not the sleep
    every = _run_steps(tmp_path / "all", "", body)
    assert every.returncode == 0 and "== skipped: exit 0" in every.stdout


def test_detach_starts_the_plan_once_polls_it_and_copies_its_results(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "benchmarks" / "device").mkdir(parents=True)
    for name in ("detach.sh", "common.sh"):
        shutil.copy(DEVICE / name, repo / "benchmarks" / "device" / name)
    # a plan that counts its own starts, writes a JSON in a subfolder and a step log, then waits for a go file
    (repo / "benchmarks" / "device" / "fake.sh").write_text(
        'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"\n'
        'echo start >> "$AGOQ_RESULTS/starts"\n'
        'step first 20 bash -c \'mkdir -p "$AGOQ_RESULTS/sub"; echo "{\\"x\\": 1}" > "$AGOQ_RESULTS/sub/r.json"; '
        'echo line-of-first\'\n'
        f'step second 60 bash -c \'until [ -f {tmp_path}/go ]; do sleep 0.2; done\'\n')
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "AGOQ_DETACH_ROOT": str(root), "OUT": str(out), "PYTHON": sys.executable}
    detach = ["bash", str(repo / "benchmarks" / "device" / "detach.sh"), "fake.sh"]
    first = subprocess.run(detach + ["3"], env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == 75 and "still running" in first.stdout, first.stdout + first.stderr
    assert (root / "repo" / "benchmarks" / "device" / "fake.sh").exists()
    (tmp_path / "go").touch()
    poll = subprocess.run(["bash", str(root / "repo" / "benchmarks" / "device" / "detach.sh"), "fake.sh", "30"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert poll.returncode == 0 and "finished" in poll.stdout, poll.stdout + poll.stderr
    assert (root / "results" / "starts").read_text() == "start\n"  # the poll did not start it again
    assert (out / "sub" / "r.json").read_text() == '{"x": 1}\n'
    assert "line-of-first" in (out / "logs" / "first.tail").read_text()
    assert [r.split("\t")[:2] for r in (out / "steps.tsv").read_text().splitlines()] == [["first", "0"],
                                                                                          ["second", "0"]]


def test_reports_name_the_commit_from_git_or_from_an_exported_trees_marker(tmp_path):
    from agoq.testing.procs import COMMIT_FILE, source_commit

    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", source_commit())  # this checkout
    assert source_commit(tmp_path) == "unknown"  # no git, no marker
    (tmp_path / COMMIT_FILE).write_text("0123abc\n")
    assert source_commit(tmp_path) == "0123abc"
    # a copy whose own .git lags behind the tree carried into it: the carried marker names the tree
    lagging = tmp_path / "copy"
    lagging.mkdir()
    git = ["git", "-C", str(lagging), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (lagging / "f.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "f.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "old"], check=True)
    (lagging / "f.py").write_text("x = 2\n")
    assert source_commit(lagging).endswith("+dirty")
    (lagging / COMMIT_FILE).write_text("feedbee\n")
    assert source_commit(lagging) == "feedbee"
