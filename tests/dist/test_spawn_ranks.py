"""agoq.testing.dist.spawn_ranks reports every failed rank, not only rank 0's: when one rank dies, its peers'
collectives fail with a disconnection, and rank 0's report alone hid the cause (CI, 2026-11-27: "Connection reset
by peer" on rank 0 of tests/megatron/test_layouts.py, rank 1's own error not shown)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed

from agoq.testing.dist import RankError, spawn_ranks

pytestmark = [pytest.mark.dist]

TIMEOUT_S = 15  # the launch's limit: longer than 4 ranks' start-up on 2 busy cores (~5 s), far below HANG_S
HANG_S = 600


def _rank_fails(rank: int, world_size: int, how: dict) -> int:
    # every rank past spawn_ranks' process-group set-up first: a rank killed while another was still connecting
    # made that one fail inside gloo's connectFullMesh instead of with its own cause (CI, 2026-11-27 13:15)
    torch.distributed.barrier()
    what = how.get(rank)
    if what == "raise":
        raise ValueError(f"the cause, on rank {rank}")
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "hang":
        time.sleep(HANG_S)
    return rank * 10


def test_every_failed_rank_is_reported_with_its_own_cause():
    # one launch (process start-up dominates on 2 cores): rank 0 succeeds, rank 1 raises, rank 2 is killed,
    # rank 3 hangs past the limit
    with pytest.raises(RankError) as err:
        spawn_ranks(4, _rank_fails, args=({1: "raise", 2: "kill", 3: "hang"},), timeout_s=TIMEOUT_S)
    text = str(err.value)
    assert text.startswith(f"ranks [3] did not finish within {TIMEOUT_S} s")
    assert "rank 1 failed" in text and "the cause, on rank 1" in text
    assert f"rank 2 was killed by signal {int(signal.SIGKILL)} before reporting a result" in text
    assert "rank 0" not in text  # a rank that reported its result is not listed
