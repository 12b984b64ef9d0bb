"""agoq.megatron.ckpt.queue_server: the checkpoint writer's result queue from a standard-library process.

What Megatron's writers need of it: a put from a forked and from a spawned child arrives in the rank (the proxy
carries the rank's authkey); the launcher's stop signals leave it serving (the save they trigger needs it); it ends
when the rank closes it or dies, removing its socket; and it is not a copy of the training script (no torch in its
memory map: Megatron's own spawn of one held 739 MiB per rank, measured)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agoq.megatron.ckpt.queue_server import start_queue_server

pytestmark = [pytest.mark.megatron]


def _put(queue, value) -> None:
    queue.put({"from": value, "tensor": torch.arange(3)})  # a class the server process cannot import


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_writers_forked_and_spawned_reach_the_rank_through_the_stop_signals():
    server = start_queue_server()
    try:
        maps = Path(f"/proc/{server.process.pid}/maps").read_text()
        assert "torch" not in maps and "python" in maps  # a bare interpreter, not the script's imports
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # torchrun / slurm send these to the job
            server.process.send_signal(sig)
        time.sleep(0.3)
        assert server.process.poll() is None
        for method in ("fork", "spawn"):
            child = mp.get_context(method).Process(target=_put, args=(server.queue, method))
            child.start()
            child.join(60)
            assert child.exitcode == 0
            item = server.queue.get(timeout=10)
            assert item["from"] == method and torch.equal(item["tensor"], torch.arange(3))
        with pytest.raises(queue.Empty):  # what Megatron's writer reads after its workers (get_nowait)
            server.queue.get_nowait()
        address = server.manager.address
        assert Path(address).exists()
    finally:
        server.stop()
    assert server.process.returncode == 0 and not Path(address).exists()


PARENT = """
import sys
sys.path.insert(0, sys.argv[1])
from agoq.megatron.ckpt.queue_server import start_queue_server
server = start_queue_server()
print(server.process.pid, flush=True)
sys.stdin.read()
"""


def test_the_server_dies_with_a_killed_rank():
    root = Path(__file__).resolve().parents[2]
    rank = subprocess.Popen([sys.executable, "-c", PARENT, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        pid = int(rank.stdout.readline())
        assert not _gone(pid, within_s=0.5)
        rank.kill()  # SIGKILL: no finalizer runs in the rank
        rank.wait()
        assert _gone(pid), f"queue server {pid} outlived its rank"
    finally:
        rank.kill()


def test_a_server_that_cannot_start_is_reported(monkeypatch):
    from agoq.megatron.ckpt import queue_server

    monkeypatch.setattr(queue_server.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match=r"queue server .* did not start within 5 s \(exit 1\)"):
        queue_server.start_queue_server(timeout_s=5)
