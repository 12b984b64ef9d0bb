"""agoq's door to Megatron-LM's own ``pretrain_gpt.py``, unmodified: ``python -m agoq.megatron_lm SCRIPT <flags>``.

``torchrun --nproc-per-node 8 -m agoq.megatron_lm path/to/Megatron-LM/pretrain_gpt.py <Megatron-LM flags> --agoq-...``
installs the door below, then runs ``SCRIPT`` as ``__main__`` (as ``python SCRIPT`` would: its folder first on
``sys.path``, ``sys.argv`` = ``[SCRIPT, <flags>]``). Nothing in the script changes; the door works through the calls
every ``pretrain_gpt.py`` of megatron.training 0.19.x makes:

1. ``megatron.training.arguments.parse_and_validate_args`` (patch ``megatron_lm_door.parse_and_validate_args``, the
   one patch made before the script runs): adds the ``--agoq-*`` flags to Megatron's parser (beside the script's own
   ``extra_args_provider``); parses once more before Megatron's validation to refuse, in one line each and before
   Megatron's argument dump, what agoq cannot run (``check_megatron_args``, the CUDA requirement); after Megatron's
   validation builds the run's ``AgoqConfig``, takes over the recipe flags agoq's layers serve otherwise
   (``take_over_recipe_flags``: one start-up line each), installs agoq's seams in megatron.training
   (agoq.megatron.megatron_lm.install_for_megatron_training: the DDP class of both construction paths, the
   optimizer factory, the built check, agoq's RoPE in Megatron's fused-RoPE slot) and, with agoq on, gives Megatron
   agoq's layer spec through Megatron-LM's own ``--spec`` (``args.spec``), which both construction paths read: the
   config container's model config (``gpt_config_from_args`` → ``GPTModelBuilder``) and a model provider built on
   Megatron-LM's ``gpt_builder``.
2. After Megatron has built the model, its DDP and the optimizer, every rank checks they are what the flags ask for
   (agoq.megatron.built_check, the same check agoq's own trainer makes); a mismatch stops before the first step.
3. ``--agoq-log-json FILE``: the loss of every iteration (patch ``megatron_lm_door.log_json`` of
   ``megatron.training.training.train_step``; see :class:`LossRecord`).

Refusals (:class:`agoq.train.megatron_lm.MegatronLMRefusal`, :class:`agoq.megatron.built_check.BuiltMismatch`)
print one line (``agoq: ...``) and exit with status 2, without a traceback. Every change is undone when the script
returns (the install handle).

With ``--agoq-disable`` the door changes nothing of the model, DDP, optimizer or flags (Transformer Engine included);
it keeps the two start-up fixes that change no number (agoq.megatron.megatron_lm: the wheel's dataset helpers,
``--eval-iters 0``).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agoq.megatron import megatron_lm, megatron_training, runtime
from agoq.megatron.built_check import BuiltMismatch
from agoq.train.megatron_lm import (
    MegatronLMRefusal,
    RefusedFlags,
    UnavailableUnderMegatronTraining,
    add_agoq_args,
    agoq_config_from_megatron_args,
    check_megatron_args,
    gpt_model_options,
    take_over_recipe_flags,
    uses_transformer_engine,
)

SEAM_PARSE = "megatron_lm_door.parse_and_validate_args"
SEAM_LOG = "megatron_lm_door.log_json"

USAGE = ("usage: [torchrun ...] python -m agoq.megatron_lm path/to/pretrain_gpt.py <Megatron-LM flags> [--agoq-...]\n"
         "Runs your Megatron-LM pretrain_gpt.py (megatron.training 0.19.x) unmodified, with agoq. docs/megatron_lm.md")


@dataclass
class DoorRun:
    """What the door built for this run (after Megatron parsed and validated the flags)."""

    args: object
    config: object  # AgoqConfig
    options: object  # agoq.megatron.megatron_lm.GPTModelOptions
    handle: object  # agoq.megatron.install.Handle
    lines: list[str] = field(default_factory=list)  # the start-up lines printed
    record: LossRecord | None = None


_RUN: dict[str, DoorRun] = {}


def current_run() -> DoorRun:
    """The run the door set up (after the script's ``parse_and_validate_args``)."""
    if "run" not in _RUN:
        raise RuntimeError("agoq's door has not seen Megatron's parse_and_validate_args yet")
    return _RUN["run"]


def require_cuda() -> None:
    """megatron.training is CUDA-only (``initialize_megatron`` asserts "Megatron requires CUDA."): say so first."""
    import torch

    if not torch.cuda.is_available():
        raise UnavailableUnderMegatronTraining(
            "megatron.training (Megatron-LM's trainer) needs a CUDA GPU and torch sees none (Megatron would stop with "
            "'Megatron requires CUDA.'); run on a GPU machine, or use agoq's own trainer, scripts/pretrain_llama.py, "
            "which also runs on the CPU")


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(lines: list[str]) -> None:
    if _rank0():
        for line in lines:
            print(f"agoq: {line.removeprefix('agoq: ')}", flush=True)


def _with_agoq_args(extra_args_provider):
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_agoq_args(parser)

    return provider


def _after_validation(args, precheck) -> None:
    """Everything the door does once Megatron has validated the flags (module docstring, step 1)."""
    config = agoq_config_from_megatron_args(args)  # checks again on the validated args
    if precheck is not None:
        precheck(args)
    notes = take_over_recipe_flags(args, config)
    te = uses_transformer_engine(args)
    if te:
        from agoq.megatron import te as agoq_te

        try:
            agoq_te.require_te()
            agoq_te.check_te_composition(config, args.gradient_accumulation_fusion)
        except (RuntimeError, ValueError) as error:  # one line, as every refusal of the door
            raise RefusedFlags(str(error)) from None
    options = gpt_model_options(args)
    handle = megatron_lm.install_for_megatron_training(config)
    run = DoorRun(args=args, config=config, options=options, handle=handle)
    _RUN["run"] = run
    run.lines = [megatron_lm.describe(config), *notes]
    if te:
        run.lines.append("agoq on Transformer Engine's layers (Megatron's TE spec, unchanged): the policy's formats "
                         "for the activations TE saves in 16 bits, through saved-tensor scopes around its modules; "
                         "TE's FP8 copies stay as they are")
    elif config.enabled:
        spec = megatron_lm.agoq_gpt_layer_spec(config, options, megatron_training.transformer_config_from_args(args),
                                               num_microbatches=megatron_training.num_microbatches())
        args.spec = megatron_lm.offer_layer_spec(spec)
        run.lines.append(f"agoq's layer spec goes to Megatron through Megatron-LM's --spec {' '.join(args.spec)} "
                         "(read by the model config's builder and by Megatron-LM's gpt_builder)")
    if args.agoq_log_json:
        run.record = LossRecord(args.agoq_log_json, args.log_interval)
        run.record.install()
    _say(run.lines)


def install_door(precheck: Callable | None = None) -> None:
    """Put the door's ``parse_and_validate_args`` in ``megatron.training.arguments`` (recorded, undone by
    :func:`undo_door`). ``precheck(args)``: an entry script's own refusals, run with agoq's on the first parse and
    again on the validated args (scripts/pretrain_gpt_agoq.py)."""

    def make(original):
        def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):  # noqa: B006
            provider = _with_agoq_args(extra_args_provider)
            # refusals before Megatron's argument dump
            first = megatron_training.parse_args(provider, ignore_unknown_args)
            require_cuda()
            check_megatron_args(first)
            if precheck is not None:
                precheck(first)
            args = original(provider, ignore_unknown_args, args_defaults)
            _after_validation(args, precheck)
            return args

        return parse_and_validate_args

    megatron_training.replace_parse_and_validate_args(make, SEAM_PARSE)


def undo_door() -> None:
    """Undo every change the door and its install made (newest first)."""
    from agoq.megatron.install import undo_runtime_changes

    run = _RUN.pop("run", None)
    if run is not None:
        run.handle.undo()
    undo_runtime_changes()


def _refusal_line(error: BaseException) -> str | None:
    """The one line printed for a refusal on this rank (None: printed by another rank)."""
    text = str(error).removeprefix("agoq: ")
    if isinstance(error, BuiltMismatch):
        return text if (getattr(error, "local", True) or _rank0()) else None
    return text if _rank0() else None


def run(entry: Callable[[], object], precheck: Callable | None = None) -> None:
    """Install the door, call ``entry`` (a script's main), write ``--agoq-log-json``'s final record, undo. A refusal
    prints one line and exits with status 2."""
    install_door(precheck)
    try:
        entry()
        if "run" not in _RUN:  # the script parsed Megatron's flags some other way: agoq never got in
            raise UnavailableUnderMegatronTraining(
                "the script returned without calling megatron.training.arguments.parse_and_validate_args, where "
                "agoq's door gets in: whatever it ran, it ran without agoq; call parse_and_validate_args to parse "
                "Megatron's flags (as Megatron-LM's pretrain_gpt.py does)")
        record = _RUN["run"].record
        if record is not None:
            record.finish()
    except (MegatronLMRefusal, BuiltMismatch) as error:
        line = _refusal_line(error)
        if line is not None:
            print(f"agoq: {line}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        undo_door()


def main(argv: list[str] | None = None) -> None:
    """``python -m agoq.megatron_lm SCRIPT <flags>``: run ``SCRIPT`` as ``__main__`` through the door."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if not script.is_file():
        print(f"agoq: {script}: no such script (the first argument is your pretrain_gpt.py)\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))  # as `python SCRIPT`: the script's own imports (gpt_builders, ...)
    run(lambda: runpy.run_path(str(script), run_name="__main__"))


# -- --agoq-log-json ---------------------------------------------------------------------------------

class LossRecord:
    """``--agoq-log-json FILE``: one JSON line per training iteration, from ``train_step``'s return, written by the
    last pipeline stage's first tensor- and data-parallel rank. What ``train_step`` returns is each rank's own: the
    mean over its micro-batches of a 2-tuple loss function's report (Megatron reduces nothing over data-parallel
    ranks then), or the token sum / token count of a 3-tuple one (reduced over them: the same on every rank).

    * ``lm_loss``: the iteration's loss over the whole global batch, exact (``repr`` of the float): with data
      parallelism and ranks that differ, their mean (:func:`agoq.megatron.runtime.mean_over_data_parallel`, as
      scripts/pretrain_llama.py's ``--log-json`` records it); otherwise the value every rank holds;
    * ``megatron_log_lm_loss``: on the iterations where Megatron prints a log line, the value that line prints. The
      line is printed by the last rank, so with a 2-tuple loss at DP > 1 it is the last data-parallel rank's own
      loss, not the global batch's. Megatron's ``training_log`` sums the losses (fp32) of the iterations since its
      last print and divides by their number; it prints the first iteration of a run without resetting that sum, so
      with ``--log-interval 1`` the line of the second iteration shows the mean of the first two;
    * ``peak_bytes_so_far``: ``torch.cuda.max_memory_allocated()`` after the step;

    and ``{"final": true, "peak_bytes": ...}`` when the script returns. At DP > 1 every data-parallel rank of the last
    stage takes part in one all-gather (and, when their losses differ, one all-reduce) of one number per iteration."""

    KEY = "lm loss"

    def __init__(self, path: str, log_interval: int):
        self.path = path
        self.log_interval = log_interval
        self.logging_rank: bool | None = None
        self.first = True
        self.total = None  # fp32 tensor, as Megatron's total_loss_dict
        self.advanced = 0

    def install(self) -> None:
        megatron_training.observe_train_step(self.after_step, SEAM_LOG)

    def _is_logging_rank(self) -> bool:
        if self.logging_rank is None:
            self.logging_rank = runtime.is_last_stage() and runtime.speaks_for_stage()
        return self.logging_rank

    def after_step(self, iteration: int | None, loss_dict: dict, skipped: int) -> None:
        import torch

        if iteration is None or not loss_dict or self.KEY not in loss_dict:
            return
        iteration += 1  # train() counts the step after train_step returns; its log line shows this number
        printed, global_loss = self._over_data_parallel(loss_dict[self.KEY])
        if not skipped:  # Megatron's training_log: skipped iterations add nothing to the printed mean
            start = torch.tensor([0.0], dtype=torch.float, device=printed.device) if self.total is None else self.total
            self.total = start + printed
            self.advanced += 1
        record = {"iteration": iteration, "lm_loss": global_loss, "skipped": bool(skipped)}
        if iteration % self.log_interval == 0 or self.first:
            record["megatron_log_lm_loss"] = (0.0 if self.total is None else self.total.item()) / float(
                max(1, self.advanced))
            if not self.first:
                self.total, self.advanced = None, 0
        self.first = False
        record["peak_bytes_so_far"] = torch.cuda.max_memory_allocated()
        if self._is_logging_rank():
            self._append(record)

    @staticmethod
    def _over_data_parallel(loss):
        """(the loss the last data-parallel rank holds: what Megatron's log line adds up, the global batch's loss as
        a float). Every data-parallel rank of the last stage calls this in the same iteration."""
        import torch
        import torch.distributed as dist

        group = runtime.data_parallel_group()
        size = dist.get_world_size(group=group)
        if size == 1:
            return loss, float(loss.item())
        mine = loss.detach().reshape(1)
        ranks = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(ranks, mine, group=group)
        if all(torch.equal(value, ranks[0]) for value in ranks):  # a 3-tuple loss: Megatron reduced it already
            return ranks[-1].reshape(loss.shape), float(ranks[0].item())
        return ranks[-1].reshape(loss.shape), runtime.mean_over_data_parallel(mine)

    def finish(self) -> None:
        import torch

        if self.logging_rank:
            self._append({"final": True, "peak_bytes": torch.cuda.max_memory_allocated()})

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")
