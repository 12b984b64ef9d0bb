"""What a checkpoint can be resumed with: the run's config saved with every checkpoint, checked before any tensor
is read.

Every checkpoint saves its run record (:func:`run_record`, in the common state under ``agoq.config``): the
whole ``AgoqConfig.as_dict()``, the model shape and the parallel layout. ``--load`` derives the
``ResumeContract`` (the settings the tensors depend on) of the saved record and of the current run and
compares them before reading tensors; every key of the record is classified here, by name:

* stops the load (``_MUST_MATCH``): model shape, tensor/pipeline/virtual-pipeline size, optimizer kind, its
  state formats, master and small-tensor rule, the distributed optimizer; the error names the flag, both
  values and the fix;
* may change, reported in one line (``_MAY_CHANGE`` and ``CONFIG_MAY_CHANGE``): data-parallel size (not
  recorded), sequence length, gradient release, gradient format / mode / error feedback / bf16 buffer,
  recompute, FP8 / Smooth-SwiGLU, the policy file (its resolved table is compared too: ``policy_note``);
* may change silently (``CONFIG_RUNTIME``): device, Triton interpreter, fused or reference optimizer step.

Checkpoints without the record: those with a flat ``resume_contract`` entry (written before the record, or
converted weights-only checkpoints with their shape) are checked by the keys it has; others load without
the check.

Also here: the one line that says which LR schedule (and weight decay) is in force after a resume (agoq's default,
Megatron-LM's ``--use-checkpoint-opt_param-scheduler``, versus ``--override-opt-param-scheduler``).
No Megatron import: plain values in, plain values out.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from agoq.config import AgoqConfig, flag_for
from agoq.config.values import MOMENT_PRESETS
from agoq.plan.shape import SHAPE_FIELDS, ModelShape

RECORD_KEY = "config"  # key in the checkpoint's state["agoq"] extras: run_record(...)
# ResumeContract fields, flat (any subset): what checkpoints saved before the record (2026-11-26), and what
# converted weights-only checkpoints write (agoq.megatron.ckpt.hf_checkpoint: the model shape); checked key by key
CONTRACT_KEY = "resume_contract"


class ResumeMismatch(ValueError):
    """The checkpoint's saved settings cannot serve this run (nothing was read or changed)."""


_SHAPE_FIELDS = (*SHAPE_FIELDS, "seq_length")
# the rest of the model's shape, recorded since LLaMA-3.x support (None in older records: not compared),
# so that agoq-to-hf exports what was trained without a --config
SHAPE_FIELDS_LATER = ("rotary_base", "norm_epsilon", "rope_scaling", "rope_scaling_factor",
                       "share_embeddings_and_output_weights", "unpadded_vocab_size")


def run_record(config: AgoqConfig, *, shape, tensor_parallel: int, pipeline_parallel: int,
               virtual_pipeline: int | None, distributed_optimizer: bool, data: dict | None = None) -> dict:
    """What every checkpoint saves about its run (plain JSON values): the agoq config, the model shape (an
    agoq.megatron.model.LlamaShape; ``vocab_size`` padded), the parallel layout and ``data``: the settings of
    the data order (:data:`DATA_FLAGS` keys; reported on resume by :func:`data_lines`). The data-parallel size
    is not part of it (a checkpoint loads at any)."""
    record = {"agoq": config.as_dict(),
              "model": {name: getattr(shape, name) for name in _SHAPE_FIELDS + SHAPE_FIELDS_LATER},
              "parallel": {"tensor": tensor_parallel, "pipeline": pipeline_parallel,
                           "virtual_pipeline": virtual_pipeline or 1, "distributed_optimizer": distributed_optimizer}}
    if data is not None:
        record["data"] = dict(data)
    return record


@dataclass(frozen=True)
class ResumeContract(ModelShape):
    """The settings a checkpoint's tensors depend on (and a few recorded for the report only), derived from
    a run record (:func:`run_record`): the model's size (agoq.plan.shape.ModelShape; ``vocab_size`` padded for the
    tokenizer, --make-vocab-size-divisible-by and TP), its sequence length, layout and optimizer."""

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
    rotary_base: int | None = None  # this and below: None = not recorded (SHAPE_FIELDS_LATER)
    norm_epsilon: float | None = None
    rope_scaling: bool | None = None
    rope_scaling_factor: float | None = None
    share_embeddings_and_output_weights: bool | None = None
    unpadded_vocab_size: int | None = None  # the tokenizer's vocabulary (recorded, never compared)

    @classmethod
    def from_record(cls, record: dict) -> ResumeContract:
        config = AgoqConfig.from_dict(record["agoq"])
        opt, parallel = config.optimizer, record["parallel"]
        return cls(
            **record["model"], tensor_parallel=parallel["tensor"], pipeline_parallel=parallel["pipeline"],
            virtual_pipeline=parallel["virtual_pipeline"], optimizer=opt.kind,
            moments=",".join(opt.states.names) if opt.agoq else None, master=opt.master if opt.agoq else None,
            small_numel=opt.small_numel if opt.agoq else None,
            distributed_optimizer=parallel["distributed_optimizer"], gradient_release=opt.gradient_release,
            grads=config.grads.format_name,
        )  # fmt: skip

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    "optimizer": flag_for("optimizer.kind"),
    "moments": flag_for("optimizer.moments"),
    "master": flag_for("optimizer.master"),
    "small_numel": flag_for("optimizer.small_numel"),
    "distributed_optimizer": "--use-distributed-optimizer",
    "share_embeddings_and_output_weights": "tied embeddings (--tie-embeddings-and-output-weights)",
}
_AGOQ_STATE_FIELDS = ("moments", "master", "small_numel")
_MAY_CHANGE = {
    "seq_length": "--seq-length",
    "rotary_base": "--rotary-base",
    "norm_epsilon": "--norm-epsilon",
    "rope_scaling": "--use-rope-scaling",
    "rope_scaling_factor": "--rope-scaling-factor",
    "gradient_release": flag_for("optimizer.gradient_release"),
    "grads": flag_for("grads.format"),
}
# AgoqConfig keys ("section.field" of as_dict) that the contract above does not derive: allowed to change,
# reported by their flag ...
CONFIG_MAY_CHANGE = {
    "enabled": flag_for("enabled"),
    "policy.path": flag_for("policy.path"),
    "activations.recompute": "--recompute-granularity",
    "activations.recompute_num_layers": "--recompute-num-layers",
    "activations.selective_recompute": "--recompute-granularity",
    "grads.mode": flag_for("grads.mode"),
    "grads.error_feedback": flag_for("grads.error_feedback"),
    "grads.reduce_in_bf16": "--grad-reduce-in-bf16",
    "grads.transport": flag_for("grads.transport"),
    "optimizer.sgd_momentum": flag_for("optimizer.sgd_momentum"),
    "optimizer.sgd_nesterov": flag_for("optimizer.sgd_nesterov"),
    "optimizer.lion_beta1": flag_for("optimizer.lion_beta1"),
    "optimizer.lion_beta2": flag_for("optimizer.lion_beta2"),
    "fp8.recipe": flag_for("fp8.recipe"),
    "fp8.smooth_swiglu": flag_for("fp8.smooth_swiglu"),
    "fp8.bf16_first_layers": flag_for("fp8.bf16_first_layers"),
    "fp8.bf16_last_layers": flag_for("fp8.bf16_last_layers"),
    "fp8.amax_history_len": flag_for("fp8.amax_history_len"),
}
# ... or silently: how the run executes, not what it computes
CONFIG_RUNTIME = ("device", "triton_interpret", "rope_fusion", "optimizer.unfused")
# ... and those the contract derives its fields from (checked there)
CONFIG_IN_CONTRACT = ("optimizer.kind", "optimizer.moments", "optimizer.master", "optimizer.small_numel",
                      "optimizer.gradient_release", "grads.format")


def config_keys(data: dict, prefix: str = "") -> dict:
    """``as_dict()`` flattened to "section.field" keys."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(config_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_LEGACY_NOTE = ("{source} predates agoq's resume record: its settings are not checked (a changed model or "
                "parallel layout shows as a read error)")


def check_contract(source: str, saved_extra: dict | None, current: dict) -> list[str]:
    """Raise ResumeMismatch naming every setting the checkpoint at ``source`` cannot serve; return one
    report line per allowed change (or for a checkpoint without a record). ``saved_extra``: the checkpoint's
    ``state["agoq"]``; ``current``: this run's :func:`run_record`."""
    saved_extra = saved_extra or {}
    record = saved_extra.get(RECORD_KEY)
    if record is not None:
        saved = ResumeContract.from_record(record).as_dict()
    else:
        saved = saved_extra.get(CONTRACT_KEY)
    if saved is None:
        return [_LEGACY_NOTE.format(source=source)]
    now = ResumeContract.from_record(current).as_dict()
    changed = {k: (saved[k], now[k]) for k in now if k in saved and saved[k] != now[k]
               and not (k in SHAPE_FIELDS_LATER and saved[k] is None)}
    changed.pop("unpadded_vocab_size", None)  # the padded size is what the tensors depend on (checked above)
    if not (saved.get("rope_scaling") or now.get("rope_scaling")):
        changed.pop("rope_scaling_factor", None)  # unused without scaling
    if "optimizer" in changed:  # the state formats of another optimizer kind follow from it
        changed = {k: v for k, v in changed.items() if k not in _AGOQ_STATE_FIELDS}
    hard = [k for k in changed if k in _MUST_MATCH]
    if hard:
        raise ResumeMismatch(_mismatch_message(source, saved, {k: changed[k] for k in hard}))
    # --seq-length with a record: data_lines names it with its consequence for the data order
    notes = [(_MAY_CHANGE[k], old, new) for k, (old, new) in changed.items()
             if not (k == "seq_length" and record is not None)]
    if record is not None:
        old_keys, new_keys = config_keys(record["agoq"]), config_keys(current["agoq"])
        notes += [(CONFIG_MAY_CHANGE[k], old_keys[k], new_keys[k]) for k in CONFIG_MAY_CHANGE
                  if k in old_keys and old_keys[k] != new_keys[k]]
    return [f"{source}: {flag} changed since the checkpoint (saved {old!r}, now {new!r}); allowed, "
            "the checkpoint's tensors do not depend on it" for flag, old, new in notes]


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
    if field == "share_embeddings_and_output_weights":
        return "--tie-embeddings-and-output-weights" if value else "--untie-embeddings-and-output-weights"
    if field == "vocab_size":
        return f"the tokenizer and --make-vocab-size-divisible-by that give a padded vocabulary of {value}"
    if field == "moments" and value is not None:
        preset = [name for name, pair in MOMENT_PRESETS.items() if value in (",".join(pair), pair[0])]
        return f"{flag_for('optimizer.moments')} {preset[0] if preset else value}"
    return f"{_MUST_MATCH[field]} {value}"


def _table_of(report: str) -> object:
    """The policy report (agoq.policy.resolve's JSON) without the policy file's path: the same table read from a
    checkout at another path (another node's mount, a moved folder) is the same table."""
    try:
        doc = json.loads(report)
    except ValueError:  # not JSON: compared as text
        return report
    if isinstance(doc, dict):
        doc.pop("policy_source", None)
    return doc


def policy_note(source: str, saved_report: str | None, current_report: str) -> str | None:
    """One line when the resolved activation/gradient policy differs from the checkpoint's (allowed); the policy
    file's path alone is no difference."""
    if saved_report is None or _table_of(saved_report) == _table_of(current_report):
        return None
    return (f"{source}: the resolved policy table differs from the checkpoint's (allowed: activations and "
            "gradients are not part of a checkpoint); the new table is printed above")


# scheduler state-dict key -> the flag that sets it (weight decay: Megatron's scheduler carries it, constant here:
# start_wd = end_wd = --weight-decay)
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--lr-decay-iters (default --train-iters)", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--weight-decay", "end_wd": "--weight-decay"}


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
    differs = list(dict.fromkeys(flag for key, flag in _SCHEDULE_FLAGS.items()
                                 if key in requested and requested[key] != in_force[key]))
    if differs:
        line += f"; not used from this command line: {', '.join(differs)}"
    if train_iters * global_batch_size > in_force["lr_decay_steps"]:
        line += f"; iterations after {iters(in_force['lr_decay_steps'])} run at the minimum lr"
    return line + " (--override-opt-param-scheduler takes the command line's schedule)"


# What decides the data order (run_record's ``data``, and the model's seq_length) -> the flag, and what a change does
# to the resumed run. Megatron-LM accepts every one of them changed on resume without a word; agoq accepts them too
# (a changed seed is the usual way to step past a bad stretch of data) and says so, one line each.
DATA_FLAGS = {"seed": "--seed", "split": "--split", "data_path": "--data-path", "seq_length": "--seq-length",
              "global_batch_size": "--global-batch-size"}
_DATA_CONSEQUENCE = {
    "seed": "the data order after iteration {it} changes (the sample shuffle is drawn from the seed; weights, "
            "optimizer and RNG states are still the checkpoint's), so the losses leave the uninterrupted run's",
    "split": "the documents are divided into train / valid / test anew: the samples after iteration {it} come in "
             "another order, and documents may move between training and validation",
    "data_path": "the samples after iteration {it} are drawn from the new blend, in another order",
    "seq_length": "samples are cut at the new length: the samples after iteration {it} come in another order, and "
                  "the consumed-samples count stands for other tokens",
    "global_batch_size": "the data continues at the checkpoint's consumed samples in the same order, {gbs} per "
                         "step; the LR schedule counts samples, so its warmup and decay end at other iteration "
                         "numbers",
}


def _data_values(record: dict) -> dict:
    values = dict(record.get("data") or {})
    if "model" in record:
        values["seq_length"] = record["model"]["seq_length"]
    return values


def _shown(key: str, value) -> str:
    if key == "data_path":
        return "the built-in corpus" if not value else " ".join(map(str, value))
    return str(value)


def data_lines(saved: dict | None, current: dict, iteration: int) -> list[str]:
    """The resume report's data-order lines: the settings kept from the checkpoint in one line, then one line per
    changed setting with its consequence (``saved``: the checkpoint's run record, ``current``: this run's)."""
    now = _data_values(current)
    old = _data_values(saved or {})
    kept = [k for k in DATA_FLAGS if k in old and k in now and old[k] == now[k]]
    changed = [k for k in DATA_FLAGS if k in old and k in now and old[k] != now[k]]
    unknown = [k for k in DATA_FLAGS if k in now and k not in old]
    lines = []
    if kept:
        lines.append("data order: the checkpoint's (" + ", ".join(f"{DATA_FLAGS[k]} {_shown(k, now[k])}"
                                                                 for k in kept) + ")")
    for key in changed:
        consequence = _DATA_CONSEQUENCE[key].format(it=iteration, gbs=now.get("global_batch_size"))
        lines.append(f"data order: {DATA_FLAGS[key]} changed since the checkpoint (saved {_shown(key, old[key])}, now "
                     f"{_shown(key, now[key])}): {consequence}. Allowed, as in Megatron-LM; resume with "
                     f"{DATA_FLAGS[key]} {_shown(key, old[key])} to keep the checkpoint's")
    if unknown:
        lines.append(f"data order: {', '.join(DATA_FLAGS[k] for k in unknown)} not recorded in the checkpoint (saved "
                     "before agoq recorded them): not compared")
    return lines
