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


def _traced(tree, losses, norms):
    return _run(tree, 100.0, losses, norms=norms)


@pytest.mark.parametrize("case, verdict", [
    ("runs_of_one_checkout_differ_first", "within the run-to-run spread"),
    ("checkouts_differ_first", "differs earlier than runs of one checkout do"),
    ("one_checkout_is_deterministic", "differs beyond the run-to-run spread"),
])
def test_differing_checkouts_are_judged_against_two_runs_of_one(case, verdict):
    base = (3.0, 2.5, 2.0)
    if case == "runs_of_one_checkout_differ_first":  # old's two runs part at iteration 1, the checkouts at 2
        rows = [_traced("old", base, (1, 1, 1)), _traced("old", (3.0, 2.6, 2.0), (1, 1, 1)),
                _traced("new", (3.0, 2.5, 2.1), (1, 1, 1))]
    elif case == "checkouts_differ_first":  # the checkouts part at iteration 0, runs of old only at 2
        rows = [_traced("old", base, (1, 1, 1)), _traced("old", (3.0, 2.5, 2.2), (1, 1, 1)),
                _traced("new", base, (0.9, 1, 1))]
    else:
        rows = [_traced("old", base, (1, 1, 1)), _traced("old", base, (1, 1, 1)), _traced("new", base, (1, 1, 1.5))]
    spread = bench_commits.summarise(rows, ["old", "new"])["agoq_full"]["spread"]
    assert spread["verdict"].startswith(verdict), spread
    assert spread["within_checkout"]["pairs"] == 1 and spread["across_checkouts"]["pairs"] == 2


def test_the_deterministic_site_switches_torch_to_deterministic_algorithms(tmp_path):
    import subprocess
    import sys
    env = bench_commits.deterministic_site(tmp_path / "site")
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # fully on: under warn_only PyTorch's flash-attention backward stays non-deterministic (it only warns)
    probe = ("import torch; print(torch.are_deterministic_algorithms_enabled(), "
             "torch.is_deterministic_algorithms_warn_only_enabled())")
    out = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": env["AGOQ_BENCH_SITE"]},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "True False"
