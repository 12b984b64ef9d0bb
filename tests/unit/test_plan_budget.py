"""python -m agoq.plan --memory-budget: units are required below 1 MiB (a forgotten unit is not a budget)."""

import pytest


def test_a_memory_budget_without_unit_is_refused_not_read_as_bytes():
    from agoq.plan.memory import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("85899345920") == 80 * 2**30
    with pytest.raises(ValueError, match="give a unit"):
        parse_bytes("80")


@pytest.mark.parametrize("text, expected", [
    ("eightyGiB", "--memory-budget 'eightyGiB': write e.g. 80GiB"),  # was float()'s message, no flag named
    ("-5GiB", "--memory-budget '-5GiB': must be a positive size"),  # was taken: nothing fits, exit 3
    ("0GiB", "must be a positive size"),
    ("nan", "must be a positive size"),
])  # fmt: skip
def test_a_memory_budget_that_is_no_size_names_the_flag(text, expected):
    from agoq.plan.memory import parse_bytes

    with pytest.raises(ValueError) as err:
        parse_bytes(text)
    assert expected in str(err.value)


@pytest.mark.parametrize("capacity", [[], ["--capacity"]])
def test_a_bad_memory_budget_is_one_error_line_not_a_traceback(capsys, capacity):
    from agoq.plan import __main__ as plan

    argv = [*capacity, "--config", "configs/model/tiny.yaml", "--memory-budget", "80"]
    assert plan.main(argv) == 2
    assert "agoq.plan: error: --memory-budget '80' is 80 bytes; give a unit" in capsys.readouterr().err
