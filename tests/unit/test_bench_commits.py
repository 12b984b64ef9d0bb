"""benchmarks/bench_commits.py's verdict: the speed ratio of the last checkout to the first and whether every run of
a variant, from every checkout and round, produced the same losses and gradient norms."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_commits", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_commits.py")
bench_commits = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_commits)


def _run(tree, tokens, losses, norms=(1.0, 0.5), variant="agoq_full", peak=2.0):
    return {"variant": variant, "tree": tree, "tokens_per_s": tokens, "peak_gib": peak, "losses": list(losses),
            "grad_norms": list(norms), "returncode": 0}


def test_identical_traces_give_the_median_ratio_and_a_true_verdict():
    rows = [_run("old", 100.0, (3.0, 2.5)), _run("new", 110.0, (3.0, 2.5)),
            _run("old", 120.0, (3.0, 2.5)), _run("new", 100.0, (3.0, 2.5), peak=2.5)]
    entry = bench_commits.summarise(rows, ["old", "new"])["agoq_full"]
    assert entry["old"]["tokens_per_s"] == 110.0 and entry["new"]["tokens_per_s"] == 105.0
    assert entry["speed_ratio"] == pytest.approx(105.0 / 110.0, abs=1e-4)
    assert entry["new"]["peak_gib"] == 2.5
    assert entry["losses_and_grad_norms_identical"] is True


@pytest.mark.parametrize("changed", ["loss", "grad_norm", "round"])
def test_one_differing_value_anywhere_makes_the_verdict_false(changed):
    rows = [_run("old", 100.0, (3.0, 2.5)), _run("new", 100.0, (3.0, 2.5)), _run("old", 100.0, (3.0, 2.5))]
    if changed == "loss":
        rows[1] = _run("new", 100.0, (3.0, 2.5000001))
    elif changed == "grad_norm":
        rows[1] = _run("new", 100.0, (3.0, 2.5), norms=(1.0, 0.50001))
    else:
        rows[2] = _run("old", 100.0, (3.0, 2.4))
    assert bench_commits.summarise(rows, ["old", "new"])["agoq_full"]["losses_and_grad_norms_identical"] is False


def test_a_run_without_iterations_is_not_called_identical():
    rows = [_run("old", None, ()), _run("new", None, ())]
    entry = bench_commits.summarise(rows, ["old", "new"])["agoq_full"]
    assert entry["losses_and_grad_norms_identical"] is False and "speed_ratio" not in entry
