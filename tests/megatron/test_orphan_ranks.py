"""scripts/pretrain_llama.py under torchrun: when the torchrun agent is killed outright (SIGKILL: no signal reaches
the ranks), its two gloo ranks end within seconds -- at least one through agoq.train.orphan's watch, its peer through
the watch or gloo's closed connection -- instead of waiting on a dead rendezvous store; two ranks orphaned this way
sat 28 minutes on 2026-12-07. ~25 s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agoq.testing.procs import PRETRAIN_SCRIPT, REPO_ROOT, TINY_CONFIG, child_env, torchrun_command
from agoq.train.orphan import EXIT_ORPHANED

pytestmark = [pytest.mark.megatron, pytest.mark.dist]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) counts as ended
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_end_when_the_torchrun_agent_is_killed(tmp_path):
    out = tmp_path / "out.txt"
    args = ["--config", str(TINY_CONFIG), "--train-iters", "100000", "--log-interval", "1"]
    with open(out, "w") as sink:
        agent = subprocess.Popen(torchrun_command(2, PRETRAIN_SCRIPT, args), stdout=sink, stderr=subprocess.STDOUT,
                                 env=child_env(), cwd=REPO_ROOT)
    ranks = []
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"^iteration\s+2/", out.read_text(), re.MULTILINE) and time.monotonic() < deadline:
            assert agent.poll() is None, out.read_text()[-3000:]
            time.sleep(0.5)
        ranks = _children(agent.pid)
        assert len(ranks) == 2, (ranks, out.read_text()[-2000:])
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 30
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, ranks)), f"ranks {ranks} still running 30 s after their launcher was killed"
        # the watch ends a rank; its peer may end first on the watch or on gloo's "connection closed by peer"
        text = out.read_text()
        assert text.count(f"is gone; ending this rank (exit {EXIT_ORPHANED})") >= 1, text[-2000:]
    finally:
        for pid in [agent.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
