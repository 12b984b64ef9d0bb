"""Print the exact per-node commands of ``slurm/pretrain.sbatch`` without Slurm (``slurm/launch.sh --dry-run``).

The real batch script runs under bash with a fake allocation: ``SLURM_*`` variables for N nodes, and
stand-ins for ``srun``, ``scontrol``, ``mkdir`` and ``torchrun`` first on ``PATH``. The ``srun`` stand-in
runs ``slurm/node.sh`` once per node with that node's ``SLURM_NODEID`` / ``SLURMD_NODENAME``; the
``torchrun`` stand-in prints its command line, prefixed by ``env`` and the communication variables
(NCCL_*, GLOO_*, TORCH_*, CUDA_*, OMP_NUM_THREADS, AGOQ_CACHE), and starts nothing. Nothing is written
(``mkdir`` is only printed). Your environment (CONFIG, SAVE_DIR, POLICY, DATA_PATH, TOKENIZER,
EXTRA_ARGS, NCCL_*...) is passed on as sbatch would.

``--simulate-signal step|task`` also plays Slurm's time-limit warning: the batch shell gets SIGUSR1, its
trap forwards it to ``srun``, which signals every node, each node's training process (a stand-in,
a child of the torchrun stand-in) reports it, and the batch script requeues the job (``scontrol
requeue`` is printed). ``step``: srun signals every process of the step, as Slurm's proctrack plugins
do (torchrun must survive it); ``task``: only the task, ``slurm/node.sh``, which must relay it.

    NNODES=2 GPUS_PER_NODE=8 CONFIG=configs/model/llama3-8b.yaml SAVE_DIR=ckpt/8b \
        python scripts/slurm_dryrun.py --nodes 2 --gpus-per-node 8 --nodelist 'gpu[01-02]'
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SBATCH = REPO_ROOT / "slurm" / "pretrain.sbatch"
FAKE_TOOLS = ("srun", "scontrol", "torchrun", "mkdir")
SHOWN_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "CUDA_")
SHOWN_ENV_NAMES = ("OMP_NUM_THREADS", "AGOQ_CACHE")
SIGNAL_MODES = ("step", "task")
HANDSHAKE_TIMEOUT_S = 30.0  # stand-ins wait this long for each other; a hang would mean a broken trap
POLL_S = 0.02
_BRACKET = re.compile(r"\[([^\]]*)\]")


# ---- Slurm host lists -------------------------------------------------------------------------------

def _split_top_level(spec: str) -> list[str]:
    """Split on commas outside brackets: 'a[1-2,4],b' -> ['a[1-2,4]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"node list {spec!r}: unbalanced or nested brackets")
        if char == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"node list {spec!r}: unbalanced brackets")
    parts.append(spec[start:])
    return parts


def _expand_range_set(body: str, spec: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (zero padding kept, as Slurm does)."""
    values = []
    for item in body.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"node list {spec!r}: bad range {item!r} (expected N or N-M)")
        if hi and int(hi) < int(lo):
            raise ValueError(f"node list {spec!r}: range {item!r} runs backwards")
        width = len(lo)
        values += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
    return values


def expand_nodelist(spec: str) -> list[str]:
    """Expand a Slurm host list as ``scontrol show hostnames`` does: 'gpu[01-02],cpu7' -> gpu01 gpu02 cpu7."""
    hosts = []
    for part in _split_top_level(spec.strip()):
        if not part:
            raise ValueError(f"node list {spec!r}: empty entry")
        pieces = _BRACKET.split(part)  # text, range, text, range, ..., text
        choices = [[p] if i % 2 == 0 else _expand_range_set(p, spec) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def default_nodelist(num_nodes: int) -> str:
    return "node01" if num_nodes == 1 else f"node[01-{num_nodes:02d}]"


# ---- the stand-ins ----------------------------------------------------------------------------------

def _say(text: str) -> None:
    print(text, flush=True)


def _fake_scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"] and len(argv) == 3:
        for host in expand_nodelist(argv[2]):
            _say(host)
        return 0
    if argv[:1] == ["requeue"] and len(argv) == 2:
        _say(f"[dry-run] scontrol requeue {argv[1]}")
        return 0
    _say(f"[dry-run] scontrol {shlex.join(argv)}: not simulated")
    return 2


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"dry run: no {what} within {HANDSHAKE_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)


def _fake_srun(argv: list[str]) -> int:
    split = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    options, command = argv[:split], argv[split:]
    hosts = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    _say("[dry-run] " + shlex.join(["srun", *options, *command]))
    procs = []
    for node_id, host in enumerate(hosts):
        env = dict(os.environ, SLURM_NODEID=str(node_id), SLURMD_NODENAME=host, SLURM_PROCID=str(node_id),
                   SLURM_LOCALID="0", SLURM_STEP_NUM_NODES=str(len(hosts)))
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    if os.environ.get("AGOQ_DRYRUN_SIGNAL"):
        _play_time_limit_warning(procs, len(hosts), os.environ["AGOQ_DRYRUN_SIGNAL"])
    outputs = [proc.communicate(timeout=HANDSHAKE_TIMEOUT_S)[0] for proc in procs]
    for output in outputs:
        sys.stdout.write(output)
    return max(proc.returncode for proc in procs)


def _play_time_limit_warning(procs: list, num_nodes: int, mode: str) -> None:
    """Slurm's --signal=B:USR1 to the batch shell; its trap must come back to us (srun) to forward it."""
    ready_dir = Path(os.environ["AGOQ_DRYRUN_DIR"])
    _wait_for(lambda: len(list(ready_dir.glob("ready-*"))) == num_nodes, "training processes ready")
    received = []

    def forward(signum, _frame):
        received.append(signum)
        name = signal.Signals(signum).name
        if mode == "step":  # as Slurm's proctrack plugins do: every process of each task
            _say(f"[dry-run] srun: got {name}, signalling every process of the step")
            for proc in procs:
                os.killpg(proc.pid, signum)
        else:
            _say(f"[dry-run] srun: got {name}, signalling the task on each node (slurm/node.sh)")
            for proc in procs:
                os.kill(proc.pid, signum)

    signal.signal(signal.SIGUSR1, forward)
    _say("[dry-run] slurm: time-limit warning, SIGUSR1 to the batch shell")
    os.kill(os.getppid(), signal.SIGUSR1)
    _wait_for(lambda: received, "SIGUSR1 forwarded by the batch shell's trap")


_WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
open(sys.argv[1], "w").close()
deadline = time.monotonic() + float(sys.argv[3])
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
# A real process spends minutes saving; duplicates of the signal (Slurm's and node.sh's relay) land
# meanwhile. This one exits at once, so it ignores them: Python resets its handlers at shutdown.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
print(f"{sys.argv[2]} training process: " + ("got SIGUSR1: saves a checkpoint and exits" if got
      else "no SIGUSR1 arrived"), flush=True)
sys.exit(0 if got else 3)
"""


def _fake_torchrun(argv: list[str]) -> int:
    node, host = os.environ.get("SLURM_NODEID", "?"), os.environ.get("SLURMD_NODENAME", "?")
    prefix = f"[node {node} {host}]"
    shown = [f"{k}={os.environ[k]}" for k in sorted(os.environ)
             if k.startswith(SHOWN_ENV_PREFIXES) or k in SHOWN_ENV_NAMES]
    _say(f"{prefix} " + shlex.join(["env", *shown, "torchrun", *argv]))
    if not os.environ.get("AGOQ_DRYRUN_SIGNAL"):
        return 0
    ready = Path(os.environ["AGOQ_DRYRUN_DIR"]) / f"ready-{node}"
    worker = subprocess.run([sys.executable, "-c", _WORKER, str(ready), prefix, str(HANDSHAKE_TIMEOUT_S)],
                            check=False)
    _say(f"{prefix} torchrun: training processes exited with {worker.returncode}")
    return worker.returncode


def _fake_mkdir(argv: list[str]) -> int:
    _say("[dry-run] " + shlex.join(["mkdir", *argv]))
    return 0


def fake_main(tool: str, argv: list[str]) -> int:
    return {"srun": _fake_srun, "scontrol": _fake_scontrol, "torchrun": _fake_torchrun,
            "mkdir": _fake_mkdir}[tool](argv)


# ---- the driver -------------------------------------------------------------------------------------

def _write_fake_bin(bin_dir: Path) -> None:
    """One /bin/sh wrapper per tool; ``exec`` keeps the process id, which the signal relay relies on."""
    me = shlex.quote(str(Path(__file__).resolve()))
    for tool in FAKE_TOOLS:
        path = bin_dir / tool
        path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {me} --fake {tool} "$@"\n')
        path.chmod(0o755)


def dry_run(num_nodes: int, gpus_per_node: int, *, nodelist: str | None = None, job_id: int = 4242,
            restart_count: int = 0, simulate_signal: str | None = None, env: dict | None = None,
            sbatch: Path = SBATCH) -> subprocess.CompletedProcess:
    """Run the batch script under the fake Slurm; returns bash's exit status and its output (stdout+stderr)."""
    if simulate_signal not in (None, *SIGNAL_MODES):
        raise ValueError(f"simulate_signal {simulate_signal!r}: choose one of {SIGNAL_MODES}")
    nodelist = nodelist or default_nodelist(num_nodes)
    hosts = expand_nodelist(nodelist)
    if len(hosts) != num_nodes:
        raise ValueError(f"--nodelist {nodelist!r} names {len(hosts)} hosts but --nodes is {num_nodes}")
    base = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="agoq-dryrun-") as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        _write_fake_bin(bin_dir)
        child_env = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "SRUN_"))}
        child_env.update(
            PATH=f"{bin_dir}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}",
            SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="agoq-pretrain", SLURM_JOB_NODELIST=nodelist,
            SLURM_NNODES=str(num_nodes), SLURM_JOB_NUM_NODES=str(num_nodes), SLURM_GPUS_ON_NODE=str(gpus_per_node),
            SLURM_SUBMIT_DIR=str(REPO_ROOT), SLURM_RESTART_COUNT=str(restart_count), AGOQ_DRYRUN_DIR=tmp,
            AGOQ_DRYRUN_SIGNAL=simulate_signal or "",
        )
        bash = shutil.which("bash") or "/bin/bash"  # looked up here: the job's PATH may not hold it
        return subprocess.run([bash, str(sbatch)], cwd=REPO_ROOT, env=child_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=4 * HANDSHAKE_TIMEOUT_S, check=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--fake"]:  # a stand-in called by the batch script (see _write_fake_bin)
        return fake_main(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("NNODES", "2")))
    parser.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("GPUS_PER_NODE", "8")))
    parser.add_argument("--nodelist", default=None, help="Slurm host list, e.g. 'gpu[01-02]' (default node[01-N])")
    parser.add_argument("--job-id", type=int, default=4242)
    parser.add_argument("--restart-count", type=int, default=0, help="SLURM_RESTART_COUNT (0: first run)")
    parser.add_argument("--simulate-signal", choices=SIGNAL_MODES, default=None,
                        help="also play the time-limit warning (SIGUSR1 forwarded, checkpoint, requeue); "
                             "step: srun signals every process of the step, task: only slurm/node.sh")
    args = parser.parse_args(argv)
    try:
        result = dry_run(args.nodes, args.gpus_per_node, nodelist=args.nodelist, job_id=args.job_id,
                         restart_count=args.restart_count, simulate_signal=args.simulate_signal)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(result.stdout)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
