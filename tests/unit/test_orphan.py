"""agoq.train.orphan: a process whose parent (the launcher) dies ends by itself with EXIT_ORPHANED and a line
naming the gone launcher; while the parent lives, the watch does nothing; and only torchrun's ranks are watched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from agoq.train.environment import launched_by_torchrun
from agoq.train.orphan import EXIT_ORPHANED, LauncherWatch

WORKER = textwrap.dedent("""
    import time
    from agoq.train.orphan import LauncherWatch
    LauncherWatch(rank=3, poll_s=0.1).start()
    print("watching", flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_rank_whose_launcher_is_killed_ends_itself(tmp_path):
    err = tmp_path / "worker.err"
    launcher = textwrap.dedent(f"""
        import subprocess, sys
        worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], stdout=subprocess.PIPE, text=True,
                                  stderr=open({str(err)!r}, "w"))
        assert worker.stdout.readline().strip() == "watching"
        print(worker.pid, flush=True)
        worker.wait()
    """)
    middle = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    worker = int(middle.stdout.readline())
    time.sleep(0.5)
    assert _alive(worker)  # the launcher lives: the watch leaves its rank alone
    middle.send_signal(signal.SIGKILL)  # as a killed torchrun agent: its child is reparented, not signalled
    middle.wait()
    deadline = time.monotonic() + 20
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the orphaned rank is still running"
    line = err.read_text()
    assert f"rank 3: the launcher (pid {middle.pid}) is gone; ending this rank (exit {EXIT_ORPHANED})" in line


def test_the_watch_calls_back_once_on_a_changed_parent_and_stops_on_request(monkeypatch):
    calls = []
    watch = LauncherWatch(rank=0, poll_s=0.01, on_orphaned=calls.append)
    monkeypatch.setattr(os, "getppid", lambda: watch.parent + 1)
    watch.start()
    watch._thread.join(timeout=5)
    assert calls == [watch.parent] and not watch._thread.is_alive()
    quiet = LauncherWatch(rank=0, poll_s=0.01, on_orphaned=calls.append)
    monkeypatch.setattr(os, "getppid", lambda: quiet.parent)
    quiet.start()
    quiet.stop()
    quiet._thread.join(timeout=5)
    assert calls == [watch.parent] and not quiet._thread.is_alive()


def test_only_ranks_torchrun_started_are_watched():
    assert launched_by_torchrun({"TORCHELASTIC_RUN_ID": "none", "RANK": "0"})
    assert not launched_by_torchrun({"RANK": "0", "WORLD_SIZE": "1"})  # python / srun directly: nohup must work


def test_expandable_segments_is_read_from_pytorchs_allocator_setting():
    from agoq.train.environment import expandable_segments

    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True"})
    assert not expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments({})
