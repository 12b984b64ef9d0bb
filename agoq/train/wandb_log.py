"""Optional Weights & Biases output with Megatron-LM's flags (``--wandb-project``, ``--wandb-exp-name``,
``--wandb-save-dir``), beside TensorBoard (agoq.train.tensorboard): the same per-iteration scalars under the
same Megatron tag names, the run's flags as the run config, the resolved policy table in it.

As Megatron-LM (megatron/training/global_vars.py, ``_set_wandb_writer``, 0.19): on when ``--wandb-project`` is given,
the experiment name is then required, the files go to ``--wandb-save-dir`` (default: ``<--save>/wandb``, without
--save ``./wandb``), one rank writes (the logging rank, as TensorBoard's). Unlike Megatron-LM, a missing ``wandb``
package stops every rank at start-up (Megatron-LM raises on the writer rank only) and a wandb flag without
--wandb-project is refused (it would do nothing). ``WANDB_MODE=offline`` and wandb's other variables apply as usual.
"""

from __future__ import annotations

import argparse
import numbers
from collections.abc import Mapping
from pathlib import Path

from agoq.train.tensorboard import NOT_SCALARS, POLICY_TAG, SCALAR_TAGS, VS_SAMPLES, NullTensorBoard, _scalars

MISSING = ("--wandb-project needs the 'wandb' package, which is not installed: pip install wandb (or drop "
           "--wandb-project)")


def check_wandb_flags(args: argparse.Namespace) -> None:
    """The flags as Megatron-LM takes them: a name with a project, and no wandb flag without one."""
    if not args.wandb_project:
        extra = [f for f in ("wandb_exp_name", "wandb_save_dir") if getattr(args, f)]
        if extra:
            raise ValueError(f"{', '.join('--' + f.replace('_', '-') for f in extra)} without --wandb-project does "
                             "nothing (Weights & Biases logging is on with --wandb-project); add it or drop them")
        return
    if not args.wandb_exp_name:
        raise ValueError("--wandb-project needs --wandb-exp-name (the run's name, as Megatron-LM requires)")


def _wandb():
    try:
        import wandb
    except ImportError as exc:
        raise ValueError(MISSING) from exc
    return wandb


class WandbLogger:
    """One wandb run; the same methods as agoq.train.tensorboard.TensorBoardLogger."""

    def __init__(self, project: str, name: str, save_dir: str, config: Mapping, wandb=None):
        self._wandb = wandb or _wandb()
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        self.run = self._wandb.init(project=project, name=name, dir=save_dir, config=dict(config))

    def log_iteration(self, record: Mapping[str, float | int | None]) -> None:
        """Every numeric value of one iteration's record under TensorBoard's tags, at step ``iteration``; the
        'vs samples' plots are the consumed samples logged beside them (wandb plots any key against any other)."""
        if "iteration" not in record:
            raise ValueError(f"log_iteration: the record needs an 'iteration' key, got keys {sorted(record)}")
        values = {}
        for key, value in _scalars(record):
            if key in NOT_SCALARS or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"log_iteration: {key}={value!r} is not a number")
            values[SCALAR_TAGS.get(key, key)] = float(value)
        if any(k in record for k in VS_SAMPLES) and record.get("consumed_samples") is not None:
            values["samples"] = int(record["consumed_samples"])
        if values:
            self.run.log(values, step=int(record["iteration"]))

    def log_policy_table(self, text: str, iteration: int = 0) -> None:
        self.log_text(POLICY_TAG, text, iteration)

    def log_text(self, tag: str, text: str, iteration: int = 0) -> None:
        self.run.config.update({tag: text}, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """TensorBoard and wandb together, behind TensorBoardLogger's methods (the training loop calls one object)."""

    def __init__(self, *loggers):
        self.loggers = [lg for lg in loggers if not isinstance(lg, NullTensorBoard)]

    def log_iteration(self, record) -> None:
        for lg in self.loggers:
            lg.log_iteration(record)

    def log_policy_table(self, text: str, iteration: int = 0) -> None:
        for lg in self.loggers:
            lg.log_policy_table(text, iteration)

    def log_text(self, tag: str, text: str, iteration: int = 0) -> None:
        for lg in self.loggers:
            lg.log_text(tag, text, iteration)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def run_config(args: argparse.Namespace) -> dict:
    """The run's flags as wandb's run config (as Megatron-LM passes ``vars(args)``): plain values only."""
    plain = (str, int, float, bool, type(None))
    out = {k: v for k, v in vars(args).items() if isinstance(v, plain) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))}
    if getattr(args, "agoq_config", None) is not None:
        out["agoq_config"] = args.agoq_config.as_dict()
    return out


def open_wandb(args: argparse.Namespace, *, is_writer_rank: bool) -> WandbLogger | NullTensorBoard:
    """A wandb run on the writer rank with --wandb-project; a no-op otherwise. Every rank checks that the package
    imports, so a missing package stops the whole job at start-up."""
    if not args.wandb_project:
        return NullTensorBoard()
    wandb = _wandb()
    if not is_writer_rank:
        return NullTensorBoard()
    save_dir = args.wandb_save_dir or str(Path(args.save or ".") / "wandb")
    return WandbLogger(args.wandb_project, args.wandb_exp_name, save_dir, run_config(args), wandb=wandb)
