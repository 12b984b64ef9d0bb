"""Megatron-LM's --wandb-project / --wandb-exp-name / --wandb-save-dir in scripts/pretrain_llama.py
(agoq.train.wandb_log): the flags as Megatron-LM takes them, a clear error naming `pip install wandb` when
the package is missing, and the logged keys and values in the offline run file (WANDB_MODE=offline)."""

from __future__ import annotations

import sys

import pytest

from agoq.train.args import parse_args

pytest.importorskip("wandb", reason="pip install wandb (the [wandb] extra) to test the wandb logger")

from agoq.testing import wandb_offline  # noqa: E402
from agoq.train import wandb_log  # noqa: E402


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_iterations_land_in_the_offline_run_file_under_megatrons_tags(offline, tmp_path):
    logger = wandb_log.WandbLogger("agoq-test", "run-1", str(tmp_path), {"lr": 3e-4, "agoq_grads": "int8_b256"})
    logger.log_iteration({"iteration": 1, "lm_loss": 7.5, "lr": 1e-3, "consumed_samples": 8, "grad_norm": None,
                          "tokens_per_second": 1234.5})
    logger.log_iteration({"iteration": 2, "lm_loss": 7.25, "lr": 2e-3, "consumed_samples": 16, "grad_norm": 0.5})
    logger.log_iteration({"iteration": 2, "validation_lm_loss": 7.0})
    logger.log_policy_table("layer  role  format\n0  mlp.fc1_input  int8_b128")
    logger.close()
    path = wandb_offline.run_file(tmp_path)
    assert wandb_offline.run_names(path) == ("agoq-test", "run-1")
    rows = wandb_offline.history(path)
    picked = [{k: v for k, v in r.items() if not k.startswith("_")} | {"step": r["_step"]} for r in rows]
    assert picked == [
        {"lm loss": 7.5, "learning-rate": 1e-3, "samples": 8, "tokens-per-sec": 1234.5, "step": 1},
        {"lm loss": 7.25, "learning-rate": 2e-3, "grad-norm": 0.5, "samples": 16, "validation_lm_loss": 7.0,
         "step": 2},  # one row per step: wandb merges what is logged at the same step
    ], picked
    config = wandb_offline.config_updates(path)
    assert config["lr"] == 3e-4 and config["agoq_grads"] == "int8_b256"
    assert config["agoq/policy"].endswith("mlp.fc1_input  int8_b128")


def test_a_record_without_an_iteration_or_with_a_non_number_is_refused(offline, tmp_path):
    logger = wandb_log.WandbLogger("p", "n", str(tmp_path), {})
    try:
        with pytest.raises(ValueError, match="needs an 'iteration' key"):
            logger.log_iteration({"lm_loss": 1.0})
        with pytest.raises(ValueError, match="lm_loss='x' is not a number"):
            logger.log_iteration({"iteration": 1, "lm_loss": "x"})
    finally:
        logger.close()


@pytest.mark.parametrize("argv, message", [
    (["--wandb-project", "p"], "--wandb-project needs --wandb-exp-name"),
    (["--wandb-exp-name", "e"], "--wandb-exp-name without --wandb-project does nothing"),
    (["--wandb-save-dir", "d", "--wandb-exp-name", "e"], "--wandb-exp-name, --wandb-save-dir without --wandb-project"),
])  # fmt: skip
def test_the_flags_as_megatron_lm_takes_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
    args = parse_args(["--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "d"])
    assert (args.wandb_project, args.wandb_exp_name, args.wandb_save_dir) == ("p", "e", "d")


def test_a_missing_wandb_package_stops_every_rank_naming_pip_install(monkeypatch):
    args = parse_args(["--wandb-project", "p", "--wandb-exp-name", "e"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    for writer in (True, False):
        with pytest.raises(ValueError, match="needs the 'wandb' package, which is not installed: pip install wandb"):
            wandb_log.open_wandb(args, is_writer_rank=writer)
    assert isinstance(wandb_log.open_wandb(parse_args([]), is_writer_rank=True), wandb_log.NullTensorBoard)


def test_save_dir_defaults_to_the_checkpoint_directory(offline, tmp_path, monkeypatch):
    args = parse_args(["--wandb-project", "p", "--wandb-exp-name", "e", "--save", str(tmp_path / "ckpt")])
    logger = wandb_log.open_wandb(args, is_writer_rank=True)
    logger.close()
    assert wandb_offline.run_file(tmp_path / "ckpt" / "wandb").is_file()
    assert wandb_offline.config_updates(wandb_offline.run_file(tmp_path / "ckpt" / "wandb"))["save"] == str(
        tmp_path / "ckpt")
