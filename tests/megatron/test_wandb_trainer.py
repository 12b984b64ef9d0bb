"""scripts/pretrain_llama.py with Megatron-LM's --wandb-project / --wandb-exp-name / --wandb-save-dir, offline
(WANDB_MODE=offline), beside --log-json: every iteration's loss, learning rate and gradient norm land in the offline
run file under Megatron's tags with the values --log-json records, and the run config holds the flags and the
resolved policy table. 2 gloo ranks (PP=2: the logging rank is the last stage), 4 iterations (~20 s)."""

from __future__ import annotations

import json

import pytest

from agoq.testing.procs import TINY_CONFIG, child_env, run_pretrain

pytest.importorskip("wandb", reason="pip install wandb (the [wandb] extra) to test --wandb-project")
pytestmark = [pytest.mark.megatron, pytest.mark.dist]

from agoq.testing import wandb_offline  # noqa: E402

ITERS = 4


def test_trainer_logs_its_iterations_to_an_offline_wandb_run(tmp_path):
    log, save_dir = tmp_path / "log.jsonl", tmp_path / "wandb_files"
    env = child_env(AGOQ_CACHE=str(tmp_path / "cache"), WANDB_MODE="offline", WANDB_SILENT="true")
    run_pretrain(2, ["--config", str(TINY_CONFIG), "--pipeline-model-parallel-size", "2", "--train-iters",
                     str(ITERS), "--log-json", str(log), "--wandb-project", "agoq-ci", "--wandb-exp-name", "tiny",
                     "--wandb-save-dir", str(save_dir)], env=env)
    records = [r for r in map(json.loads, log.read_text().splitlines()) if "lm_loss" in r]
    path = wandb_offline.run_file(save_dir)
    assert wandb_offline.run_names(path) == ("agoq-ci", "tiny")
    rows = {row["_step"]: row for row in wandb_offline.history(path)}
    assert sorted(rows) == [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    for r in records:
        row = rows[r["iteration"]]
        assert row["lm loss"] == pytest.approx(r["lm_loss"], rel=1e-12)
        assert row["learning-rate"] == pytest.approx(r["lr"], rel=1e-12)
        assert row["grad-norm"] == pytest.approx(r["grad_norm"], rel=1e-12)
        assert row["samples"] == r["consumed_samples"]
    config = wandb_offline.config_updates(path)
    assert config["train_iters"] == ITERS and config["pipeline_model_parallel_size"] == 2
    assert config["agoq_config"]["enabled"] is True
    assert "mlp.fc1_input" in config["agoq/policy"]  # the resolved policy table
