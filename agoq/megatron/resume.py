"""What a checkpoint can be resumed with: the resume contract, checked before any tensor is read.

Every checkpoint records the settings its tensors depend on (``ResumeContract``, saved in the common
state under ``agoq.resume_contract``). ``--load`` compares them with the current run before reading
tensors: a setting the checkpoint cannot serve (model shape, tensor/pipeline/virtual-pipeline size,
optimizer kind, its state formats, the distributed optimizer) stops the job with the setting, both
values and the fix; a setting it can serve (data-parallel size, gradient release, 8-bit gradient
format, sequence length, the activation policy) is reported in one line and allowed. Checkpoints
written before the record existed load without the check.

Also here: the one line that says which LR schedule is in force after a resume (Megatron-LM's
``--use-checkpoint-opt_param-scheduler`` default versus ``--override-opt-param-scheduler``).
No Megatron import: plain values in, plain values out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from agoq.megatron.optim_args import MOMENT_PRESETS, parse_moments

CONTRACT_KEY = "resume_contract"  # key in the checkpoint's state["agoq"] extras


class ResumeMismatch(ValueError):
    """The checkpoint's saved settings cannot serve this run (nothing was read or changed)."""


@dataclass(frozen=True)
class ResumeContract:
    """The settings a checkpoint's tensors depend on (and a few recorded for the report only)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int  # padded (tokenizer, --make-vocab-size-divisible-by, TP)
    seq_length: int
    tensor_parallel: int
    pipeline_parallel: int
    virtual_pipeline: int  # model chunks per pipeline rank (1 = no interleaving)
    optimizer: str  # torch (Megatron's Adam) | adamw | lion | sgd
    moments: str | None  # agoq state formats, "m" or "m,v" (None for Megatron's Adam)
    master: str | None  # agoq master weights (None for Megatron's Adam)
    small_numel: int | None  # agoq's small-tensor rule (changes per-tensor formats)
    distributed_optimizer: bool
    gradient_release: bool
    grads: str | None  # agoq 8-bit gradient format (None: Megatron's float main_grad)

    @classmethod
    def from_run(cls, *, shape, tensor_parallel: int, pipeline_parallel: int, virtual_pipeline: int | None,
                 optimizer: str, moments: str, master: str, small_numel: int, distributed_optimizer: bool,
                 gradient_release: bool, grads: str | None) -> ResumeContract:
        """``shape``: an agoq.megatron.model.LlamaShape; the rest are the run's resolved settings."""
        agoq = optimizer != "torch"
        return cls(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
            ffn_hidden_size=shape.ffn_hidden_size, vocab_size=shape.vocab_size, seq_length=shape.seq_length,
            tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
            virtual_pipeline=virtual_pipeline or 1, optimizer=optimizer,
            moments=_state_formats(optimizer, moments) if agoq else None, master=master if agoq else None,
            small_numel=small_numel if agoq else None, distributed_optimizer=distributed_optimizer,
            gradient_release=gradient_release, grads=grads,
        )  # fmt: skip

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _state_formats(optimizer: str, moments: str) -> str:
    m_fmt, v_fmt = parse_moments(moments)
    return f"{m_fmt},{v_fmt}" if optimizer == "adamw" else m_fmt  # Lion and SGD keep one state


# field -> (what it is called, the flag that sets it); fields missing here are allowed to change
_MUST_MATCH = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "padded vocabulary size (tokenizer, --make-vocab-size-divisible-by)",
    "tensor_parallel": "--tensor-model-parallel-size",
    "pipeline_parallel": "--pipeline-model-parallel-size",
    "virtual_pipeline": "model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage)",
    "optimizer": "--agoq-optimizer",
    "moments": "--agoq-moments",
    "master": "--agoq-master",
    "small_numel": "--agoq-small-numel",
    "distributed_optimizer": "--use-distributed-optimizer",
}
_AGOQ_STATE_FIELDS = ("moments", "master", "small_numel")
_MAY_CHANGE = {
    "seq_length": "--seq-length",
    "gradient_release": "--agoq-gradient-release",
    "grads": "--agoq-grads",
}


def check_contract(source: str, saved: dict | None, current: ResumeContract) -> list[str]:
    """Raise ResumeMismatch naming every setting the checkpoint at ``source`` cannot serve; return one
    report line per allowed change (or for a checkpoint without a record)."""
    if saved is None:
        return [f"{source} predates agoq's resume record: its settings are not checked (a changed model or "
                "parallel layout shows as a read error)"]
    now = current.as_dict()
    changed = {k: (saved[k], now[k]) for k in now if k in saved and saved[k] != now[k]}
    if "optimizer" in changed:  # the state formats of another optimizer kind follow from it
        changed = {k: v for k, v in changed.items() if k not in _AGOQ_STATE_FIELDS}
    hard = [k for k in changed if k in _MUST_MATCH]
    if hard:
        raise ResumeMismatch(_mismatch_message(source, saved, {k: changed[k] for k in hard}))
    return [f"{source}: {_MAY_CHANGE[k]} changed since the checkpoint (saved {old!r}, now {new!r}); allowed, "
            "the checkpoint's tensors do not depend on it" for k, (old, new) in changed.items()]


def _mismatch_message(source: str, saved: dict, changed: dict) -> str:
    lines = [f"{_MUST_MATCH[k]}: saved {old!r}, requested {new!r}" for k, (old, new) in changed.items()]
    fixes = [_resume_flag(k, saved) for k in changed]
    return (
        f"checkpoint {source} cannot be resumed with this run's settings (nothing was loaded):\n  "
        + "\n  ".join(lines)
        + f"\nFix: resume with {', '.join(fixes)}; or start a new run without --load (and another --save "
        "directory). The checkpoint itself is intact; older checkpoints in the directory were saved by the "
        "same run, so falling back to them would not help and was not tried."
    )


def _resume_flag(field: str, saved: dict) -> str:
    """The command-line setting that reproduces the saved value of ``field``."""
    value = saved[field]
    if field == "distributed_optimizer":
        return "--use-distributed-optimizer" if value else "without --use-distributed-optimizer"
    if field == "virtual_pipeline":
        if value == 1:
            return "without --num-layers-per-virtual-pipeline-stage"
        per_chunk = saved["num_layers"] // (saved["pipeline_parallel"] * value)
        return f"--num-layers-per-virtual-pipeline-stage {per_chunk}"
    if field == "vocab_size":
        return f"the tokenizer and --make-vocab-size-divisible-by that give a padded vocabulary of {value}"
    if field == "moments" and value is not None:
        preset = [name for name, pair in MOMENT_PRESETS.items() if value in (",".join(pair), pair[0])]
        return f"--agoq-moments {preset[0] if preset else value}"
    return f"{_MUST_MATCH[field]} {value}"


def policy_note(source: str, saved_report: str | None, current_report: str) -> str | None:
    """One line when the resolved activation/gradient policy differs from the checkpoint's (allowed)."""
    if saved_report is None or saved_report == current_report:
        return None
    return (f"{source}: the resolved policy table differs from the checkpoint's (allowed: activations and "
            "gradients are not part of a checkpoint); the new table is printed above")


_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--lr-decay-iters (default --train-iters)", "lr_decay_style": "--lr-decay-style"}


def schedule_line(in_force: dict, requested: dict, *, override: bool, global_batch_size: int,
                  train_iters: int) -> str:
    """Which LR schedule a resumed run follows, with its values (scheduler state dicts, steps in samples)."""
    def iters(samples: int) -> str:
        return f"{samples // global_batch_size}"

    values = (f"lr {in_force['max_lr']:.4g} -> min {in_force['min_lr']:.4g}, {in_force['lr_decay_style']}, "
              f"warmup {iters(in_force['lr_warmup_steps'])} / decay {iters(in_force['lr_decay_steps'])} iterations")
    if override:
        return f"LR schedule: the command line's (--override-opt-param-scheduler): {values}"
    line = f"LR schedule: the checkpoint's ({values})"
    differs = [flag for key, flag in _SCHEDULE_FLAGS.items() if requested[key] != in_force[key]]
    if differs:
        line += f"; not used from this command line: {', '.join(differs)}"
    if train_iters * global_batch_size > in_force["lr_decay_steps"]:
        line += f"; iterations after {iters(in_force['lr_decay_steps'])} run at the minimum lr"
    return line + " (--override-opt-param-scheduler takes the command line's schedule)"
