"""agoq.train.leave: the trainer's exit without the interpreter's teardown still runs the atexit handlers, flushes
buffered standard output and error, and ends with the given status -- what a normal exit does that has an effect
outside the process. (That every file the trainer writes is complete after it: the trainer tests that read a run's
files back, e.g. tests/megatron/test_wandb_trainer.py, test_resume.py, test_tensorboard.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("status", [0, 2])
def test_leave_runs_atexit_handlers_flushes_streams_and_keeps_the_status(tmp_path, status):
    marker = tmp_path / "atexit.txt"
    child = textwrap.dedent(f"""
        import atexit, sys
        from agoq.train.leave import leave
        atexit.register(lambda: open({str(marker)!r}, "w").write("handler ran"))
        class Noisy:
            def __del__(self):
                print("destructor ran")
        keep = Noisy()
        sys.stdout.write("buffered out, no newline")
        sys.stderr.write("buffered err")
        leave({status})
        print("after leave")
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == status
    assert marker.read_text() == "handler ran"
    assert done.stdout == "buffered out, no newline"  # flushed; no teardown (the destructor did not print), no return
    assert done.stderr == "buffered err"
