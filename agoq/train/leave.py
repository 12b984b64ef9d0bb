"""Leaving a finished trainer process without the interpreter's teardown.

After ``main`` returns, a rank of ``scripts/pretrain_llama.py`` spent 1.3-1.7 s of CPU in Python's finalization
(measured on the tiny model, 2026-12-07: no system calls, the destruction of torch's and megatron-core's module state),
which a test tier that launches the trainer a hundred times pays a hundred times over. :func:`leave` does what a normal
exit does that has an effect outside the process -- the ``atexit`` handlers (``logging``'s flush, ``multiprocessing``'s
join of its children, W&B's) and the flush of ``sys.stdout`` / ``sys.stderr`` -- then ends the process with
``os._exit``. Objects' ``__del__`` methods do not run, so a file that relies on one loses its buffered tail: the
trainer writes every file in a ``with`` block and closes TensorBoard / W&B in ``pretrain``'s ``finally``, so nothing
it writes is open when ``main`` returns (``tests/unit/test_leave.py``; the trainer tests read runs' files back).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Run the ``atexit`` handlers, flush the standard streams, and end the process with exit status ``code``."""
    atexit._run_exitfuncs()  # noqa: SLF001 - the registered handlers, as a normal exit runs them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(code)
