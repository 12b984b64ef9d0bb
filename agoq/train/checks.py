"""Checks of the parsed command line of ``scripts/pretrain_llama.py`` that need no process group (called by
:func:`agoq.train.args.parse_args`): values and combinations (:func:`validate`), the policy's rules against
this model (:func:`check_policy_rules`), and flags that would do nothing in this run (:func:`check_unused_flags`).
The checks against the world size and the data files run in :mod:`agoq.train.preflight`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agoq.cli.flags import build_parser, policy_path
from agoq.cli.graph_args import check_graph_flags
from agoq.cli.optim_args import check_release_flags
from agoq.config import flag_for

# Light imports only (argparse, yaml, numpy, sentencepiece, the torch-free policy and format packages): the
# script parses and checks its command line before torch and megatron load (~5 s), so a bad flag, policy or
# data file stops in about a second (tests/unit/test_args.py::test_parsing_imports_neither_torch_nor_megatron).
from agoq.config.values import float_grads_mismatch
from agoq.data.indexed import split_weights
from agoq.policy import ScheduleInfo, check_rules_used, model_sites
from agoq.train.wandb_log import check_wandb_flags


def validate(args: argparse.Namespace) -> None:
    """Checks that need no process group; layout checks against the world size run at start-up. Then
    :func:`agoq.train.args.parse_args` builds the config (whose sections validate agoq's own values) and
    checks the policy's rules against this model (:func:`check_policy_rules`)."""
    _check_finite(args)
    if args.eval_interval is not None and (args.eval_interval <= 0 or args.eval_iters <= 0):
        raise ValueError("--eval-interval and --eval-iters must be positive")
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "train_iters", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "log_interval")
    for name in positive:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    check_wandb_flags(args)
    if args.vocab_size is not None and args.vocab_size <= 0:
        raise ValueError(f"--vocab-size must be positive, got {args.vocab_size}")
    if not 0.0 <= args.min_lr <= args.lr:  # Megatron's scheduler asserts max_lr >= min_lr deep in set-up
        raise ValueError(f"--lr {args.lr} must be at least --min-lr {args.min_lr} (default 3e-4) and --min-lr "
                         f"non-negative; pass --min-lr explicitly, e.g. --min-lr {args.lr / 10:g}")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{args.lr_decay_iters} (which defaults to --train-iters)"
        )
    if args.data_path and not args.tokenizer_model:
        raise ValueError("--data-path needs --tokenizer-model (the tokenizer the data was written with: a "
                         "SentencePiece .model or a tokenizer.json)")
    nlpvs = args.num_layers_per_virtual_pipeline_stage
    if nlpvs is not None and nlpvs <= 0:  # 0 used to turn interleaving off without a word
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage must be positive, got {nlpvs}; leave it out for the "
                         "plain 1F1B schedule")
    if nlpvs and args.pipeline_model_parallel_size < 2:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {nlpvs} (the interleaved schedule) needs "
                         "--pipeline-model-parallel-size >= 2; drop it, or add pipeline stages")
    if nlpvs:
        per_stage, rem = divmod(args.num_layers, args.pipeline_model_parallel_size)
        if rem or per_stage % nlpvs or per_stage // nlpvs < 2:
            fits = [v for v in range(1, per_stage // 2 + 1) if per_stage % v == 0]
            allowed = ("--num-layers must first divide over the stages" if rem else
                       f"allowed here: {', '.join(map(str, fits))}" if fits else
                       "no value fits this layout: use more layers per stage, or leave the flag out")
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {nlpvs}: each of the "
                f"{args.pipeline_model_parallel_size} stages must hold a multiple of it, and at least two "
                f"virtual stages (--num-layers {args.num_layers}); {allowed}"
            )
    for flag in ("agoq_policy", "config", "tokenizer_model"):
        value = getattr(args, flag)
        if value and not Path(value).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {value}: file not found")
    if args.log_json:  # opened for appending after the model is built; a bad path used to stop there, flag unnamed
        log = Path(args.log_json)
        if log.is_dir():
            raise ValueError(f"--log-json {log}: is a directory; pass a file path (e.g. {log / 'log.jsonl'})")
        if not log.parent.is_dir():
            raise ValueError(f"--log-json {log}: directory {log.parent} does not exist; create it first (mkdir -p "
                             f"{log.parent}) or pass a file in an existing directory")
    compute_flags = [args.agoq_fp8, args.agoq_smooth_swiglu, args.agoq_fp8_bf16_first_layers,
                     args.agoq_fp8_bf16_last_layers, args.agoq_fp8_amax_history_len]
    if args.agoq_disable and (args.agoq_grads or args.agoq_policy or args.agoq_optimizer != "torch"
                              or any(v is not None for v in compute_flags)):
        raise ValueError(
            f"{flag_for('enabled')} runs the plain Megatron baseline; drop {flag_for('grads.format')} / "
            f"{flag_for('policy.path')} / {flag_for('optimizer.kind')} / {flag_for('fp8.recipe')}* / "
            f"{flag_for('fp8.smooth_swiglu')}"
        )
    _check_param_gather_flags(args)
    check_graph_flags(args)
    if args.grad_reduce_in_bf16 and args.fp32:
        raise ValueError("--grad-reduce-in-bf16 needs bf16 parameters; drop --fp32 (fp32 params reduce fp32 grads)")
    if args.load and Path(args.load).exists() and not Path(args.load).is_dir():
        raise ValueError(f"--load {args.load}: not a directory (pass the checkpoint directory given to --save)")
    # (a --load directory that does not exist yet is a first run: it starts from scratch and says so)
    for name in ("save_interval", "exit_interval"):  # 0 = off, as in Megatron-LM; -1 used to save every iteration
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of iterations (0 or left out: "
                             + ("save at the end only" if name == "save_interval" else "run to --train-iters")
                             + f"), got {value}")
    _check_manual_gc_flags(args)
    if args.num_layers % args.pipeline_model_parallel_size:
        raise ValueError(
            f"--num-layers {args.num_layers} is not divisible by {args.pipeline_model_parallel_size} model chunks "
            f"(--pipeline-model-parallel-size {args.pipeline_model_parallel_size}); pick a layer count or layout "
            "that divides evenly"
        )
    if split_weights(args.split)[1] == 0 and args.eval_interval:
        raise ValueError(f"--eval-interval {args.eval_interval} evaluates the validation split, which --split "
                         f"{args.split} gives weight 0 (no validation documents); give it a weight (e.g. --split "
                         "969,30,1), or drop --eval-interval")
    data_blend(args.data_path)
    check_release_flags(args)  # the flags alone: preflight and pretrain check the batch against the real DP size


def _check_finite(args: argparse.Namespace) -> None:
    """Every float flag is a finite number: ``--lr nan`` failed the --min-lr check below, whose advice was
    "--min-lr nan" (NaN compares false with everything)."""
    import math

    for action in build_parser()._actions:
        if action.type is not float:
            continue
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list | tuple) else [values]:
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{action.option_strings[0]} {value}: must be a finite number (not nan or inf); "
                                 f"leave it out for the default{_default_text(action)}")


def _default_text(action: argparse.Action) -> str:
    return f" ({action.default})" if action.default is not None else ""


def _check_manual_gc_flags(args) -> None:
    """Megatron-LM's --manual-gc family: the interval is a step count; its companions do nothing without it."""
    if args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be 0 (no collection between steps) or a positive number of "
                         f"steps, got {args.manual_gc_interval}")
    if not args.manual_gc and (args.manual_gc_interval or not args.manual_gc_eval):
        given = "--manual-gc-interval" if args.manual_gc_interval else "--no-manual-gc-eval"
        raise ValueError(f"{given} acts only with --manual-gc (Python's automatic collector stays on without it); "
                         f"add --manual-gc or drop {given}")


def given_on_command_line(argv: list[str] | None) -> set[str]:
    """The destinations of the flags ``argv`` gives (parsed again with every default suppressed)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    parser._defaults.clear()
    return set(vars(parser.parse_args(argv)))


def check_unused_flags(args: argparse.Namespace, given: set[str], command_line: set[str]) -> None:
    """A flag that only acts together with another setting is an error when that setting is off: the run would
    silently do without it. ``given``: the flags on the command line or in the --config file; ``command_line``:
    those on the command line (the shipped model configs set save_interval for runs that pass --save)."""
    if args.tokenizer_model and not args.data_path:
        raise ValueError(
            f"--tokenizer-model {args.tokenizer_model} is read only with --data-path (the tokenizer your data was "
            "written with); without --data-path the run trains on the built-in corpus with its own tokenizer. Add "
            "--data-path PREFIX (data written with this tokenizer by scripts/prepare_data.py), or drop "
            "--tokenizer-model"
        )
    if "save_interval" in command_line and args.save_interval and not args.save:
        raise ValueError(f"--save-interval {args.save_interval} saves checkpoints into --save DIR, which is not given, "
                         "so nothing would be saved; add --save DIR (and --load DIR to resume from it), or drop "
                         "--save-interval")
    if "eval_iters" in given and args.eval_interval is None:
        raise ValueError(f"--eval-iters {args.eval_iters} sizes each evaluation, but evaluation runs only with "
                         "--eval-interval N (here no default; Megatron-LM's is 1000); add --eval-interval N, or drop "
                         "--eval-iters")
    if "recompute_num_layers" in given and args.recompute_granularity is None:
        raise ValueError(f"--recompute-num-layers {args.recompute_num_layers} sets the layers per group of "
                         "--recompute-granularity full, which is not given (nothing is recomputed); add "
                         "--recompute-granularity full, or drop --recompute-num-layers")
    if "rope_scaling_factor" in given and not args.use_rope_scaling:
        raise ValueError(f"--rope-scaling-factor {args.rope_scaling_factor} scales RoPE only with --use-rope-scaling, "
                         "which is not given (plain RoPE); add --use-rope-scaling, or drop --rope-scaling-factor")
    config = args.agoq_config
    if not config.grads.quantized:
        why = (flag_for("enabled") if args.agoq_disable else
               f"{flag_for('grads.format')} {args.agoq_grads}" if args.agoq_grads else
               f"no {flag_for('grads.format')} FORMAT, and the policy sets no default grads")
        for name in ("agoq_grads_mode", "agoq_grad_transport"):
            flag = "--" + name.replace("_", "-")
            if name in given:
                add = "" if args.agoq_disable else f"add {flag_for('grads.format')} int8_b256, or "
                raise ValueError(f"{flag} {getattr(args, name)} applies to agoq's 8-bit gradients, which this run does "
                                 f"not use ({why}); {add}drop {flag}")
    _check_float_grads_name(args)
    _check_companion_flags(args, given)
    for name in ("agoq_sgd_momentum", "agoq_sgd_nesterov", "agoq_lion_beta1", "agoq_lion_beta2"):
        kind = name.split("_")[1]
        if name in given and args.agoq_optimizer != kind:
            raise ValueError(f"--{name.replace('_', '-')} applies to {flag_for('optimizer.kind')} {kind} (this run: "
                             f"{args.agoq_optimizer}); add {flag_for('optimizer.kind')} {kind}, or drop "
                             f"--{name.replace('_', '-')}")
    _check_adam_flags(args, given, command_line)


def _companions(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """(flag dest, whether the setting it acts with is on, the fix) per flag that acts only with another one."""
    fp8 = args.agoq_config.fp8.recipe
    return [
        ("ddp_bucket_size", args.overlap_grad_reduce, "sizes the buckets of --overlap-grad-reduce; without it "
         "megatron-core reduces each model chunk in one bucket (DistributedDataParallel sets bucket_size=None); add "
         "--overlap-grad-reduce"),
        ("cuda_graph_warmup_steps", args.cuda_graph_impl != "none", "warms up Megatron's CUDA graphs before capture, "
         "which are off; add --cuda-graph-impl local"),
        ("override_opt_param_scheduler", bool(args.load), "replaces the learning-rate schedule a checkpoint carries, "
         "and no --load DIR is given (a fresh run uses the command line's schedule anyway); add --load DIR"),
        ("allow_fresh_start", bool(args.load), "lets a run start from scratch although --load holds checkpoints, "
         "and no --load DIR is given (a run without --load starts from scratch anyway); add --load DIR"),
        ("force_unlock", bool(args.save), "takes the lock of the --save folder, and no --save DIR is given; add "
         "--save DIR"),
        ("agoq_unfused", args.agoq_optimizer != "torch", "runs agoq's optimizer step in plain PyTorch, but "
         f"{flag_for('optimizer.kind')} is torch (Megatron's Adam); add {flag_for('optimizer.kind')} adamw (or lion / "
         "sgd)"),
        ("agoq_small_numel", args.agoq_optimizer != "torch", "tunes agoq's fused optimizer step, but "
         f"{flag_for('optimizer.kind')} is torch (Megatron's Adam); add {flag_for('optimizer.kind')} adamw (or lion / "
         "sgd)"),
        ("agoq_fp8_amax_history_len", fp8 == "delayed", f"sizes FP8 delayed scaling's amax history, and this run's "
         f"FP8 recipe is {fp8}; add {flag_for('fp8.recipe')} delayed"),
        ("agoq_fp8_bf16_first_layers", fp8 != "off", "keeps the first layers of FP8 linears in bf16, and FP8 is off; "
         f"add {flag_for('fp8.recipe')} delayed (or current / rowwise)"),
        ("agoq_fp8_bf16_last_layers", fp8 != "off", "keeps the last layers of FP8 linears in bf16, and FP8 is off; "
         f"add {flag_for('fp8.recipe')} delayed (or current / rowwise)"),
    ]


def _check_companion_flags(args: argparse.Namespace, given: set[str]) -> None:
    """A flag given (command line or --config file) whose companion setting is off would do nothing: an error that
    names both, as megatron-core and agoq would otherwise drop it without a word."""
    for name, active, fix in _companions(args):
        if name in given and not active:
            flag = "--" + name.replace("_", "-")
            value = getattr(args, name)
            shown = flag if isinstance(value, bool) else f"{flag} {value}"
            raise ValueError(f"{shown} {fix}, or drop {flag}")
    _check_policy_fp8_settings(args, given)
    if args.fp32 and "agoq_master" in given and args.agoq_master != "none":
        raise ValueError(f"{flag_for('optimizer.master')} {args.agoq_master} splits a 16-bit parameter's fp32 master, "
                         "but --fp32 parameters are their own master (agoq's optimizer keeps none); drop "
                         f"{flag_for('optimizer.master')}")
    if args.agoq_optimizer == "sgd" and args.agoq_sgd_nesterov and args.agoq_sgd_momentum == 0:
        raise ValueError(f"{flag_for('optimizer.sgd_nesterov')} needs momentum, and "
                         f"{flag_for('optimizer.sgd_momentum')} is 0 (plain SGD); set "
                         f"{flag_for('optimizer.sgd_momentum')} > 0, or drop {flag_for('optimizer.sgd_nesterov')}")


def _check_policy_fp8_settings(args: argparse.Namespace, given: set[str]) -> None:
    """The policy file's fp8 sub-settings, as the flags': amax_history_len acts only with delayed scaling and the
    bf16 first / last layers only with FP8 on, in the run's resolved recipe (the flags' value over the file's)."""
    from agoq.policy.schema import FP8Spec

    spec = args.agoq_config.policy.spec
    if spec is None or spec.fp8 is None:  # agoq off, or a policy without an fp8 section
        return
    recipe, defaults = args.agoq_config.fp8.recipe, FP8Spec()
    settings = [("amax_history_len", recipe == "delayed", "delayed scaling"),
                ("bf16_first_layers", recipe != "off", "FP8 linears"), ("bf16_last_layers", recipe != "off",
                                                                          "FP8 linears")]
    for key, active, what in settings:
        value = getattr(spec.fp8, key)
        if value != getattr(defaults, key) and not active and f"agoq_fp8_{key}" not in given:
            raise ValueError(f"{policy_path(args)}: fp8.{key} {value} acts only with {what}, and this run's FP8 "
                             f"recipe is {recipe} (the policy's fp8.recipe, or {flag_for('fp8.recipe')} over it); set "
                             f"the recipe, or drop fp8.{key}")


ADAM_FLAGS = ("adam_beta1", "adam_beta2", "adam_eps")
OWN_FLAGS = {"lion": f"{flag_for('optimizer.lion_beta1')} and {flag_for('optimizer.lion_beta2')} (and no eps)",
             "sgd": f"{flag_for('optimizer.sgd_momentum')} and {flag_for('optimizer.sgd_nesterov')}"}


def _check_adam_flags(args: argparse.Namespace, given: set[str], command_line: set[str]) -> None:
    """--adam-beta1/2 / --adam-eps act on Adam only (Megatron's, --agoq-optimizer torch, and agoq's adamw): with lion
    or sgd they did nothing. Given on the command line, or in a --config file that also picks lion / sgd; a model
    config's Adam settings under --agoq-optimizer lion / sgd on the command line stay defaults for Adam runs (the
    shipped configs set them, as save_interval)."""
    if args.agoq_optimizer not in OWN_FLAGS:
        return
    from_file = "agoq_optimizer" in given and "agoq_optimizer" not in command_line
    unused = [name for name in ADAM_FLAGS if name in command_line or (from_file and name in given)]
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        values = ", ".join(f"--{name.replace('_', '-')} {getattr(args, name)}" for name in unused)
        raise ValueError(f"{values} set{'s' * (len(unused) == 1)} Adam ({flag_for('optimizer.kind')} torch or adamw), "
                         f"which {flag_for('optimizer.kind')} {args.agoq_optimizer} does not use; "
                         f"{args.agoq_optimizer} takes {OWN_FLAGS[args.agoq_optimizer]}; drop {flags} (or use "
                         f"{flag_for('optimizer.kind')} adamw)")


def unused_file_settings(args: argparse.Namespace, file_keys: set[str], command_line: set[str]) -> list[str]:
    """The --config file's settings this run does not use, each with why, for one start-up line: the shipped model
    configs carry Adam's betas and a save interval for the runs that use them, so a run that does not (lion / sgd,
    no --save) is not an error, but it is said (nothing is ignored silently). Settings the command line also gives
    are the command line's to check (``check_unused_flags`` refuses those)."""
    from_file = file_keys - command_line
    notes = []
    if args.agoq_optimizer in OWN_FLAGS and (adam := [k for k in ADAM_FLAGS if k in from_file]):
        notes.append(f"{', '.join(adam)} (Adam's; {flag_for('optimizer.kind')} {args.agoq_optimizer} takes "
                     f"{OWN_FLAGS[args.agoq_optimizer]})")
    if "save_interval" in from_file and args.save_interval and not args.save:
        notes.append(f"save_interval {args.save_interval} (checkpoints are saved only with --save DIR)")
    return notes


def _check_float_grads_name(args: argparse.Namespace) -> None:
    """A float name for the gradients (FLOAT_GRADS: agoq's 8-bit gradients off) must be the gradient buffer this run
    keeps: fp32 (Megatron's default, and with --fp32), or bf16 with --grad-reduce-in-bf16. ``--agoq-grads bf16``
    alone used to run an fp32 buffer without a word."""
    fmt = args.agoq_config.grads.format_name
    mismatch = float_grads_mismatch(fmt, bf16_buffer=args.grad_reduce_in_bf16, fp32_params=args.fp32)
    if mismatch:
        source = f"{flag_for('grads.format')} {fmt}" if args.agoq_grads else f"{policy_path(args)}: default.grads {fmt}"
        raise ValueError(f"{source} {mismatch}")


def check_fc2_amax_flag(args: argparse.Namespace) -> None:
    """--log-fc2-amax reads fc2's delayed-scaling history (agoq.megatron.compute.fc2_input_amax): without FP8
    delayed scaling there is none, and the flag would log nothing."""
    if args.log_fc2_amax and args.agoq_config.fp8.recipe != "delayed":
        raise ValueError(f"--log-fc2-amax reads the FP8 fc2's amax history, which only {flag_for('fp8.recipe')} "
                         f"delayed keeps (this run: {args.agoq_config.fp8.recipe}); add {flag_for('fp8.recipe')} "
                         "delayed or drop the flag")


def _check_param_gather_flags(args: argparse.Namespace) -> None:
    """--overlap-param-gather: Megatron-LM's two requirements (megatron/training/arguments.py), same words."""
    if not args.overlap_param_gather:
        return
    if not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather overlaps the distributed optimizer's parameter all-gather with the "
                         "forward pass: it needs --use-distributed-optimizer (without it every rank updates every "
                         "parameter and nothing is gathered); add --use-distributed-optimizer or drop the flag")
    if not args.overlap_grad_reduce:
        raise ValueError("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM: "
                         "'Must use --overlap-param-gather with --overlap-grad-reduce'); add --overlap-grad-reduce")


def data_blend(values: list[str] | None) -> list[tuple[float, str]] | list[str] | None:
    """--data-path: ``PREFIX [PREFIX ...]`` (weighted by size) or ``W1 PREFIX1 W2 PREFIX2 ...`` (Megatron's blend)."""
    if not values:
        return None
    try:
        weights = [float(v) for v in values[0::2]]
    except ValueError:
        return list(values)  # prefixes only
    if len(values) % 2:
        raise ValueError(f"--data-path {' '.join(values)}: a weighted blend is 'W1 PREFIX1 W2 PREFIX2 ...' (pairs)")
    if any(w <= 0 for w in weights):
        raise ValueError(f"--data-path {' '.join(values)}: blend weights must be positive, got {weights}")
    return list(zip(weights, values[1::2], strict=True))



def check_policy_rules(args: argparse.Namespace, spec) -> None:
    """Each rule of the loaded policy ``spec`` (agoq.policy errors name file, key and fix) decides some site of
    this model and layout (docs/policy.md section 8): a rule for layers or stages that do not exist is an error."""
    if args.agoq_disable:
        return
    chunks = args.pipeline_model_parallel_size * (args.vpp or 1)
    if args.num_layers % chunks:
        return  # reported by the layout check
    schedule = ScheduleInfo(pp_size=args.pipeline_model_parallel_size, vp_size=args.vpp, num_microbatches=chunks)
    check_rules_used(spec, model_sites(args.num_layers, schedule))


def check_policy_requests(args: argparse.Namespace, num_microbatches: int) -> None:
    """Every role a rule of the run's policy names explicitly stores what the rule asks somewhere in this model and
    layout (agoq.plan.storage.check_requests_take_effect: e.g. attn.qkv_input while norm.input is quantized is
    recomputed whatever its format). Needs the micro-batches per step (the auto ladder's formats depend on them), so
    it runs once the world size is known: the script's preflight and the trainer."""
    if args.agoq_disable:
        return
    from agoq.plan.storage import check_requests_on_model

    schedule = ScheduleInfo(pp_size=args.pipeline_model_parallel_size, vp_size=args.vpp,
                            num_microbatches=num_microbatches)
    check_requests_on_model(args.agoq_config.policy.spec, args.num_layers, schedule)
