"""--exit-interval means what it means in Megatron-LM: stop at a multiple of N, so a resumed run stops too."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from agoq.train.training import exit_interval_reached  # noqa: E402


def test_a_fresh_run_stops_at_n_and_a_resumed_one_at_the_next_multiple():
    fresh = [i for i in range(1, 2500) if exit_interval_reached(i, 1000)]
    assert fresh[0] == 1000
    resumed_at = 1000  # the run's first iteration is 1001
    assert next(i for i in range(resumed_at + 1, 3500) if exit_interval_reached(i, 1000)) == 2000


@pytest.mark.parametrize("off", [None, 0])
def test_no_interval_never_stops(off):
    assert not any(exit_interval_reached(i, off) for i in range(1, 50))
