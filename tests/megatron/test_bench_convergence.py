"""benchmarks/bench_convergence.py (issue 25): the seed-band report from run JSONs, and the matrix runner's
plumbing on the CPU (two tiny runs, one re-run that skips them, the report over their JSONs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agoq.testing.procs import REPO_ROOT, child_env
from tests.megatron._bench_scripts import load_bench_script

CONV = load_bench_script("bench_convergence")
SCRIPT = REPO_ROOT / "benchmarks" / "bench_convergence.py"


def _run(preset: str, seed: int, loss: float, skipped: int = 0) -> dict:
    return {"preset": preset, "seed": seed, "returncode": 0,
            "summary": {"final_validation_loss": loss, "skipped_iterations": skipped,
                        "tokens_per_second_median": 1000.0, "peak_gib": 2.0}}


def test_seed_bands_place_each_preset_against_the_baselines_spread():
    runs = [_run("baseline", 1, 2.10), _run("baseline", 2, 2.14), _run("baseline", 3, 2.12),
            _run("agoq-full", 1, 2.11), _run("agoq-full", 2, 2.15),  # mean 2.13: inside
            _run("aggressive", 1, 2.16, skipped=3),  # outside the band, +1.9 % of the mean
            _run("agoq-default", 1, 2.09)]  # below the band: a lower loss than every baseline seed
    bands = CONV.seed_bands(runs)
    assert bands["baseline_band"] == (2.10, 2.14) and bands["baseline_mean"] == pytest.approx(2.12)
    full, aggressive = bands["presets"]["agoq-full"], bands["presets"]["aggressive"]
    assert full["seeds"] == {1: 2.11, 2: 2.15} and full["mean"] == pytest.approx(2.13)
    assert full["inside_baseline_band"] and full["within_1pct_of_baseline_mean"]
    assert not aggressive["inside_baseline_band"] and not aggressive["within_1pct_of_baseline_mean"]
    assert aggressive["vs_baseline_mean"] == pytest.approx(2.16 / 2.12 - 1)
    assert aggressive["skipped_iterations"] == {1: 3}
    assert [bands["presets"][p]["vs_baseline_band"] for p in ("agoq-full", "aggressive", "agoq-default")] == [
        "inside", "above", "below"]


def test_matrix_runs_each_job_once_and_reports_its_bands(tmp_path):
    out_dir = tmp_path / "conv"
    cmd = [sys.executable, str(SCRIPT), "--matrix", "smoke", "--smoke", "--gpus", "cpu", "--tokens", "1024",
           "--timeout", "240", "--out-dir", str(out_dir)]
    first = subprocess.run(cmd, env=child_env(), cwd=REPO_ROOT, text=True, capture_output=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    names = [CONV.job_name(p, s) for p, s in CONV.MATRICES["smoke"]]
    for name in names:
        assert CONV.completed(out_dir / f"{name}.json"), (out_dir / f"{name}.out").read_text()[-3000:]
    again = subprocess.run(cmd, env=child_env(), cwd=REPO_ROOT, text=True, capture_output=True, timeout=120)
    assert again.returncode == 0 and f"{len(names)} of {len(names)} runs already complete" in again.stdout
    report = subprocess.run([sys.executable, str(SCRIPT), "--report", str(out_dir), "--out", str(tmp_path / "b.json")],
                            env=child_env(), cwd=REPO_ROOT, text=True, capture_output=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    bands = CONV.json.loads((tmp_path / "b.json").read_text())
    assert set(bands["presets"]) == {"baseline", "agoq-full"} and bands["baseline_band"][0] > 0
