"""slurm/: the batch script's per-node commands for 2 nodes x 8 GPUs, signal forwarding and requeue, host lists.

The real ``slurm/pretrain.sbatch`` and ``slurm/node.sh`` run under bash with stand-ins for srun,
scontrol, mkdir and torchrun (``scripts/slurm_dryrun.py``); no Slurm, no torchrun, no GPU.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

_spec = importlib.util.spec_from_file_location("slurm_dryrun", REPO_ROOT / "scripts" / "slurm_dryrun.py")
dryrun = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dryrun)

JOB_ID = 31337
ENV = {
    "PATH": "/usr/bin:/bin",
    "CONFIG": "configs/model/llama3-8b.yaml",
    "SAVE_DIR": "/shared/ckpt/8b",
    "POLICY": "configs/policy/int8.yaml",
    "DATA_PATH": "0.3 /data/a 0.7 /data/b",
    "TOKENIZER": "/data/tokenizer.model",
    "EXTRA_ARGS": "--log-interval 5 --train-iters 100",
    "NCCL_SOCKET_IFNAME": "ib0",
}
NODE_LINE = re.compile(r"^\[node (\d+) (\S+)\] (.*)$")


def _run(env=ENV, **kw):
    return dryrun.dry_run(2, 8, nodelist="gpu[01-02]", job_id=JOB_ID, env=dict(env), **kw)


def _node_commands(output: str) -> dict[int, tuple[str, list[str]]]:
    """node id -> (host, argv) of each printed torchrun command."""
    found = {}
    for line in output.splitlines():
        match = NODE_LINE.match(line)
        if match and match.group(3).startswith("env "):
            found[int(match.group(1))] = (match.group(2), shlex.split(match.group(3)))
    return found


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_two_nodes_by_eight_gpus_commands():
    result = _run()
    assert result.returncode == 0, result.stdout
    nodes = _node_commands(result.stdout)
    assert sorted(nodes) == [0, 1], result.stdout
    expected_port = str(20000 + JOB_ID % 20000)  # the template's default MASTER_PORT
    train_args = ["--config", "configs/model/llama3-8b.yaml", "--save", "/shared/ckpt/8b", "--load",
                  "/shared/ckpt/8b", "--agoq-policy", "configs/policy/int8.yaml", "--data-path", "0.3", "/data/a",
                  "0.7", "/data/b", "--tokenizer-model", "/data/tokenizer.model", "--log-interval", "5",
                  "--train-iters", "100"]
    for node_id, host in ((0, "gpu01"), (1, "gpu02")):
        got_host, argv = nodes[node_id]
        assert got_host == host
        torchrun = argv.index("torchrun")
        env = dict(item.split("=", 1) for item in argv[1:torchrun])
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert env["NCCL_SOCKET_IFNAME"] == "ib0"  # the user's NCCL knobs reach every node
        cmd = argv[torchrun:]
        assert _flag(cmd, "--nnodes") == "2"
        assert _flag(cmd, "--nproc-per-node") == "8"
        assert _flag(cmd, "--rdzv-backend") == "c10d"
        assert _flag(cmd, "--rdzv-endpoint") == f"gpu01:{expected_port}"  # first node hosts the store
        assert _flag(cmd, "--rdzv-id") == str(JOB_ID)
        script = cmd.index("scripts/pretrain_llama.py")
        assert cmd[script + 1:] == train_args
    srun = next(line for line in result.stdout.splitlines() if line.startswith("[dry-run] srun "))
    assert "--nodes=2" in srun and "--ntasks-per-node=1" in srun and "slurm/node.sh" in srun
    assert "[dry-run] mkdir -p /shared/ckpt/8b" in result.stdout
    assert "requeue" not in result.stdout  # no signal: the job ends, nothing requeued


def test_node_count_and_gpus_follow_the_allocation():
    result = dryrun.dry_run(3, 4, nodelist="n[7-9]", job_id=5, env=dict(ENV))
    nodes = _node_commands(result.stdout)
    assert [nodes[i][0] for i in range(3)] == ["n7", "n8", "n9"]
    for _, argv in nodes.values():
        assert _flag(argv, "--nnodes") == "3" and _flag(argv, "--nproc-per-node") == "4"
        assert _flag(argv, "--rdzv-endpoint") == "n7:20005"


@pytest.mark.parametrize("mode", dryrun.SIGNAL_MODES)
def test_time_limit_signal_reaches_every_training_process_and_requeues(mode):
    result = _run(simulate_signal=mode)
    out = result.stdout
    assert result.returncode == 0, out
    assert "agoq: got SIGUSR1" in out  # the batch shell's trap ran
    for node_id, host in ((0, "gpu01"), (1, "gpu02")):
        assert f"[node {node_id} {host}] training process: got SIGUSR1" in out, out
        # torchrun survived the signal and reports its workers' clean exit
        assert f"[node {node_id} {host}] torchrun: training processes exited with 0" in out, out
    assert out.count("relaying SIGUSR1") == 2  # slurm/node.sh forwarded on both nodes
    assert f"[dry-run] scontrol requeue {JOB_ID}" in out


def test_signal_relay_works_without_procps():
    """No pkill on PATH (minimal images): slurm/node.sh falls back to /proc/<pid>/task/*/children."""
    result = _run(env={**ENV, "PATH": "/nonexistent"}, simulate_signal="task")
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("training process: got SIGUSR1") == 2, result.stdout


def test_requeue_stops_at_max_requeues():
    result = _run(env={**ENV, "MAX_REQUEUES": "3"}, simulate_signal="task", restart_count=3)
    assert "not requeueing" in result.stdout and "scontrol requeue" not in result.stdout


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"CONFIG": None}, "set CONFIG="),
        ({"SAVE_DIR": None}, "set SAVE_DIR="),
        ({"CONFIG": "configs/model/nope.yaml"}, "file not found"),
        ({"TOKENIZER": None}, "also set TOKENIZER"),
        ({"DATA_PATH": None}, "TOKENIZER=/data/tokenizer.model is used only with DATA_PATH"),
        ({"NNODES": "4"}, "NNODES=4 but the allocation has 2 nodes"),
    ],
)
def test_bad_inputs_stop_before_srun_with_the_fix(change, message):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    result = _run(env=env)
    assert result.returncode != 0
    assert message in result.stdout
    assert "[dry-run] srun" not in result.stdout


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("gpu[01-02]", ["gpu01", "gpu02"]),
        ("node7", ["node7"]),
        ("a[1-3,7],b05", ["a1", "a2", "a3", "a7", "b05"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("r[1-2]-g[1-2]", ["r1-g1", "r1-g2", "r2-g1", "r2-g2"]),
    ],
)
def test_expand_nodelist(spec, hosts):
    assert dryrun.expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu[01-02", "gpu[2-1]", "gpu[a-b]", "a,,b", "x[[1]]"])
def test_expand_nodelist_rejects_malformed_lists(spec):
    with pytest.raises(ValueError, match="node list"):
        dryrun.expand_nodelist(spec)


def test_dry_run_rejects_a_nodelist_of_the_wrong_length():
    with pytest.raises(ValueError, match="names 3 hosts but --nodes is 2"):
        dryrun.dry_run(2, 8, nodelist="g[1-3]", env=dict(ENV))


def test_scripts_pass_bash_syntax_check():
    import subprocess

    for name in ("pretrain.sbatch", "node.sh", "launch.sh"):
        subprocess.run(["bash", "-n", str(REPO_ROOT / "slurm" / name)], check=True)
