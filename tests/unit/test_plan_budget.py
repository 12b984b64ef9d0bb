"""python -m agoq.plan --memory-budget: units are required below 1 MiB (a forgotten unit is not a budget)."""

import pytest


def test_a_memory_budget_without_unit_is_refused_not_read_as_bytes():
    from agoq.plan.memory import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("85899345920") == 80 * 2**30
    with pytest.raises(ValueError, match="give a unit"):
        parse_bytes("80")
