"""Command line of ``scripts/pretrain_llama.py``: Megatron-compatible flags, ``--agoq-*`` flags, config files.

Precedence (lowest to highest): built-in defaults < ``--config FILE.yaml`` < flags on the command line.
:func:`parse_args` also builds the run's ``agoq.config.AgoqConfig`` from the merged values, once, and keeps it
as ``args.agoq_config``: the trainer passes it (or a section) to library code, which never reads this
Namespace. Megatron's own flags (layout, batch sizes, lr) stay on the Namespace for the trainer.
A config file holds flag names in snake_case (``num_layers: 4``); an unknown key stops the run with
the file, the key and the allowed keys. Unknown or abbreviated flags are errors too
(``allow_abbrev=False``), so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from pathlib import Path

import yaml

# Light imports only (argparse, yaml, numpy, sentencepiece, the torch-free policy and format packages): the
# script parses and checks its command line before torch and megatron load (~5 s), so a bad flag, policy or
# data file stops in about a second (tests/unit/test_args.py::test_parsing_imports_neither_torch_nor_megatron).
from agoq.config import (  # noqa: F401 (FLOAT_GRADS re-exported)
    FLOAT_GRADS,
    GRAD_MODES,
    GRAD_TRANSPORTS,
    RECOMPUTE_GRANULARITIES,
    AgoqConfig,
    GradsFormatError,
)
from agoq.data.indexed import split_weights
from agoq.megatron.train.graph_args import add_graph_flags, check_graph_flags
from agoq.megatron.train.optim_args import DEFAULT_MASTER, DEFAULT_MOMENTS, add_optim_flags, check_release_flags
from agoq.policy import FP8_RECIPES, SMOOTH_SWIGLU_MODES, ScheduleInfo, check_rules_used, load_policy, model_sites

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
DEFAULT_POLICY = Path(__file__).resolve().parents[3] / "configs" / "policy" / "agoq.yaml"


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (LLaMA: RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings)")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers (all pipeline stages together)")
    g.add_argument("--hidden-size", type=int, default=64, help="model width")
    g.add_argument("--num-attention-heads", type=int, default=4, help="query heads")
    g.add_argument("--num-query-groups", type=int, default=None, help="KV heads (GQA); default = heads (MHA)")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width; default: LLaMA's 8/3·hidden rounded up to a multiple of 64")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (LLaMA-3: 500000)")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="RMSNorm epsilon")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the normal weight initialisation")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the tokenizer's vocabulary to a multiple of this x --tensor-model-parallel-size")
    g.add_argument("--attention-backend", choices=("sdpa", "megatron"), default="sdpa",
                   help="sdpa: torch scaled_dot_product_attention (flash/cuDNN on GPU); "
                        "megatron: Megatron's unfused DotProductAttention (saves [b,h,s,s] probabilities)")
    g.add_argument("--fp32", action="store_true", help="fp32 parameters and compute (default: bf16)")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="Megatron's activation recompute: full (each group of --recompute-num-layers layers keeps "
                        "its input and reruns its forward; with an agoq policy the recomputed forward stores its "
                        "activations per the policy) or selective (core attention only, recompute_modules "
                        "['core_attn']: with SDPA attention it saves no memory, agoq.plan.storage.megatron_bytes)")
    g.add_argument("--recompute-num-layers", type=int, default=1,
                   help="with --recompute-granularity full: layers per recomputed group (method 'uniform')")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP: ranks that split each layer")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="PP: pipeline stages (layers split evenly); data-parallel size = world size / (TP x PP)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="enables the interleaved 1F1B schedule")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer states (and with agoq's optimizer its master) over the data-parallel ranks")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron-LM's flag: reduce each gradient bucket as soon as its last gradient is ready, "
                        "overlapping the data-parallel reduction with backward (no effect at DP=1)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="Megatron-LM's flag: the distributed optimizer's all-gather of the updated parameters runs "
                        "bucket by bucket during the next forward (DDP forward pre-hooks) instead of right after "
                        "the step; needs --use-distributed-optimizer and --overlap-grad-reduce. With interleaved "
                        "pipelines the stages launch their all-gathers together (Megatron-LM's default "
                        "align_param_gather). Checkpoints, evaluation and the end of training sync the parameters "
                        "first")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket with --overlap-grad-reduce (Megatron's default: "
                        "max(40M, 1M x data-parallel size))")
    g.add_argument("--micro-batch-size", type=int, default=2, help="samples per forward/backward pass per rank")
    g.add_argument("--global-batch-size", type=int, default=8,
                   help="samples per optimizer step over all data-parallel ranks (a multiple of micro-batch x DP)")


def _optim_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule (Megatron's Adam(W), OptimizerParamScheduler)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (after warmup)")
    g.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the decay")
    g.add_argument("--lr-warmup-iters", type=int, default=5, help="linear warmup iterations from 0 to --lr")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations from the end of warmup to --min-lr; default: --train-iters")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine", help="decay from --lr to --min-lr")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay (AdamW)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam first-moment decay (optimizer torch / adamw)")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="Adam second-moment decay (torch / adamw)")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon (torch / adamw)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="bf16 gradient buffer: accumulate and reduce main_grad in bf16 instead of Megatron's fp32 "
                        "(FlashOptim's 16-bit gradients; 2 instead of 4 bytes/param). Needs bf16 params")
    g.add_argument("--train-iters", type=int, default=30, help="optimizer steps of the whole run (resumes count on)")
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, follow this command line's LR schedule (--lr, --min-lr, --lr-warmup-iters, "
                        "--lr-decay-iters, --lr-decay-style, --train-iters) from the checkpoint's iteration on; "
                        "default: the checkpoint's schedule (Megatron-LM's --use-checkpoint-opt_param-scheduler)")
    g.add_argument("--seed", type=int, default=1234, help="weight initialisation and data order")


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="Megatron blend: PREFIX or 'W1 PREFIX1 W2 PREFIX2 ...' (.bin/.idx written by "
                        "scripts/prepare_data.py). Default: agoq's built-in corpus, built once and cached")
    g.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer the data was written with: a SentencePiece .model or a Hugging Face "
                        "tokenizer.json (required with --data-path)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations and at the end (default: no evaluation)")
    g.add_argument("--eval-iters", type=int, default=2, help="global batches per evaluation")
    g.add_argument("--data-cache-dir", default=None,
                   help="where the built-in corpus and the dataset indices are cached; default: $AGOQ_CACHE, "
                        "else ~/.cache/agoq/data")


def _run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None, help="checkpoint directory (megatron.core.dist_checkpointing)")
    g.add_argument("--load", default=None,
                   help="resume from the latest checkpoint in this directory (a directory without one yet: "
                        "start from scratch, as Megatron-LM)")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (default, or 0: only at the end, on a signal and at --exit-interval)")
    g.add_argument("--log-interval", type=int, default=1, help="print an iteration line every N iterations")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving) at the first iteration of this run that is a multiple of N, as "
                        "Megatron-LM (default, or 0: run to --train-iters)")
    g.add_argument("--debug-nonfinite-at-iteration", type=int, nargs="+", default=None, metavar="N",
                   help="fault injection for testing: make the loss NaN at these iterations (the step is skipped)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars and the resolved policy table here (needs `tensorboard`)")
    g.add_argument("--log-json", default=None,
                   help="also append each logged iteration as one JSON object per line to this file")
    g.add_argument("--log-fc2-amax", action="store_true",
                   help="add each FP8 fc2 input's newest amax (per layer, and their max) to the logged iterations "
                        "(TensorBoard, --log-json): the FP8 paper's outlier proxy, with or without "
                        "--agoq-smooth-swiglu; needs --agoq-fp8 delayed")


def _agoq_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agoq")
    g.add_argument("--agoq-policy", default=None,
                   help="bit-width policy YAML (default: configs/policy/agoq.yaml); see docs/policy.md")
    g.add_argument("--agoq-disable", action="store_true", help="run plain Megatron (the baseline)")
    g.add_argument("--agoq-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: GPU when CUDA is available, else CPU mode (gloo, shims; correctness only)")


def add_grad_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--agoq-grads FORMAT, --agoq-grads-mode, --agoq-grads-error-feedback (read by agoq.megatron.ddp)."""
    g = parser.add_argument_group("agoq gradients")
    g.add_argument("--agoq-grads", default=None, metavar="FORMAT",
                   help="8-bit gradients in DDP, e.g. int8_b256 (agoq.formats name); default: off "
                        "(Megatron's float gradients; fp32 says so, as does bf16 with --grad-reduce-in-bf16). A "
                        "policy YAML's grads: entry gives the same choice.")
    g.add_argument("--agoq-grads-mode", choices=GRAD_MODES, default="store",
                   help="reduce: 8-bit communication, float main_grad; store: also 8-bit main_grad accumulation")
    g.add_argument("--agoq-grads-error-feedback", action="store_true",
                   help="store mode: keep the requantization error in a bf16 residual (+2 bytes/param)")
    g.add_argument("--agoq-grad-transport", choices=GRAD_TRANSPORTS, default="auto",
                   help="how the 8-bit reduction moves bytes: nccl (collectives, any link), peer (the reduce "
                        "kernels read the peers' 8-bit stores over NVLink; CUDA, one host), auto (peer where it "
                        "applies, else nccl; the choice and its reason are printed at start-up)")
    return parser


def add_compute_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agoq FP8 compute and Smooth-SwiGLU (docs/fp8.md); default: the policy's fp8 "
                                  "section, else off")
    g.add_argument("--agoq-fp8", choices=FP8_RECIPES, default=None,
                   help="FP8 linears (E4M3 forward, E5M2 backward; needs an sm_89+ GPU): current / delayed "
                        "per-tensor scaling, rowwise (per-row current scaling), te (Transformer Engine; not "
                        "built), off")
    g.add_argument("--agoq-smooth-swiglu", choices=SMOOTH_SWIGLU_MODES, default=None,
                   help="Smooth-SwiGLU (FP8 paper): rescale the SwiGLU output per token (authors' code) or per "
                        "FFN channel (paper text) before fc2; function-preserving, runs anywhere")
    g.add_argument("--agoq-fp8-bf16-first-layers", type=int, default=None, metavar="N",
                   help="keep the first N transformer layers in bf16 (default 1)")
    g.add_argument("--agoq-fp8-bf16-last-layers", type=int, default=None, metavar="N",
                   help="keep the last N transformer layers in bf16 (default 1; the LM head is always bf16)")
    g.add_argument("--agoq-fp8-amax-history-len", type=int, default=None, metavar="N",
                   help="delayed scaling: amaxes kept per tensor (default 16)")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's '(default: X)' after each flag's help, except where the help already says its default in
    words, for switches (off unless given) and for defaults that mean "not given" (None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or isinstance(action, argparse._StoreTrueAction)):
            return text
        return super()._get_help_string(action)


# A quiet rank (not the first of its node) waits this long before it exits on an argument error: torchrun
# stops every worker as soon as one exits non-zero, and a quiet rank that exited first could take the
# printing rank down before its one error line was out (seen about once in nine launches, 2026-11-26).
QUIET_EXIT_DELAY_S = 1.0


def _exit_quietly_after_delay() -> None:
    time.sleep(QUIET_EXIT_DELAY_S)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    """argparse that reports an error in one line, without the usage dump (which under torchrun was ~150
    lines per rank); ``quiet`` (ranks other than the first on a node) exits without printing, a moment after
    the printing rank (QUIET_EXIT_DELAY_S)."""

    quiet = False

    def error(self, message: str):
        if self.quiet:
            _exit_quietly_after_delay()
        if message.startswith("unrecognized arguments: "):
            message += _unknown_flag_hints(message.split(": ", 1)[1].split(), self._option_string_actions)
        self.exit(2, f"{self.prog}: error: {message} (all flags: {self.prog} --help)\n")


_LLAMA_ALWAYS = "the model is always LLaMA on megatron-core's local layers (RMSNorm, SwiGLU, RoPE, no biases, untied)"
# Megatron-LM pretrain_gpt.py flags a Megatron user passes out of habit, which this LLaMA-only trainer does not take
MEGATRON_LM_ONLY = {
    "--bf16": "bf16 is the default here (--fp32 for fp32)",
    "--fp16": "fp16 parameters are not supported here (bf16 is the default)",
    "--group-query-attention": "GQA follows --num-query-groups",
    "--max-position-embeddings": "RoPE positions follow --seq-length",
    "--tokenizer-type": "the type follows the --tokenizer-model file (SentencePiece .model or tokenizer.json)",
    **{flag: _LLAMA_ALWAYS for flag in ("--swiglu", "--normalization", "--disable-bias-linear", "--use-mcore-models",
                                        "--position-embedding-type", "--untie-embeddings-and-output-weights",
                                        "--transformer-impl", "--use-rotary-position-embeddings")},
}


def _unknown_flag_hints(words: list[str], flags) -> str:
    """For the unknown flags among ``words``: what a Megatron-LM-only flag means here, else the closest real flag
    (' (did you mean --agoq-policy?)')."""
    names = [w.split("=", 1)[0] for w in words if w.startswith("--")]
    megatron = [f"{n}: {MEGATRON_LM_ONLY[n]}" for n in names if n in MEGATRON_LM_ONLY]
    known = [f for f in flags if f.startswith("--") and f != "--help"]
    hints = []
    for name in (n for n in names if n not in MEGATRON_LM_ONLY):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hints += [close[0] if len(names) == 1 else f"{close[0]} for {name}"] if close else []
    text = f" (did you mean {', '.join(hints)}?)" if hints else ""
    if megatron:
        text += (f" (Megatron-LM flags this LLaMA-only trainer does not take: {'; '.join(megatron)}. Drop them, or "
                 "use scripts/pretrain_gpt_agoq.py, which takes every Megatron-LM flag: docs/megatron_lm.md)")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_llama.py", allow_abbrev=False, formatter_class=_HelpFormatter,
        description="Pretrain a LLaMA-architecture model on megatron-core with agoq.",
        epilog="Defaults are the built-in ones; a --config file replaces them (file < command line).",
    )
    parser.add_argument("--config", default=None, help="YAML file of flag values (snake_case keys)")
    for add in (_model_flags, _parallel_flags, _optim_flags, _data_flags, _run_flags, _agoq_flags, add_grad_flags,
                add_optim_flags, add_compute_flags, add_graph_flags):
        add(parser)
    # None = not given, so that --agoq-moments/--agoq-master without agoq's optimizer is an error, not ignored;
    # _fill_derived puts in the defaults
    parser.set_defaults(agoq_moments=None, agoq_master=None)
    return parser


def load_config_file(path: str, parser: argparse.ArgumentParser, *, flag: str = "--config") -> dict:
    """Read a YAML config of flag values; every key must be a flag's snake_case name, every value one its flag
    takes. ``flag``: the option that named the file, for the messages (the planner reads the same files as
    ``--model``)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag} {path}: file not found")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{flag} {path}: YAML syntax error: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{flag} {path}: expected a mapping of flag names to values")
    allowed = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{flag} {path}: unknown key {key!r}{hint}. Allowed keys: {', '.join(sorted(allowed))}"
            )
    actions = {a.dest: a for a in parser._actions}
    return {key: _config_value(f"{flag} {path}", key, value, actions[key]) for key, value in values.items()}


_TYPE_WORDS = {int: "an integer", float: "a number"}


def _config_value(source: str, key: str, value, action: argparse.Action):
    """A config file's ``value`` for ``key`` as the command line would give it (typed, within the choices), or a
    ValueError naming the file, the key, its flag and what it takes. set_defaults alone would keep a YAML list,
    a quoted boolean or a float for an integer flag as they are (``fp32: "no"`` turned fp32 on)."""
    flag = max(action.option_strings, key=len)
    where = f"{source}: {key} ({flag})"
    if value is None and action.default is None:
        return None  # as if the key were left out
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: write {key}: true or {key}: false (YAML booleans, unquoted); "
                             f"got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise ValueError(f"{where} takes one or more values (a YAML list, or one value); got []")
        return [_config_item(where, item, action) for item in items]
    if isinstance(value, (list, dict)):
        raise ValueError(f"{where} takes one value; got {value!r}")
    return _config_item(where, value, action)


def _config_item(where: str, value, action: argparse.Action):
    kind = action.type
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        wanted = _TYPE_WORDS.get(kind, "a string" if not action.choices else "one of the choices")
        hint = " (YAML reads unquoted yes / no / on / off as booleans: quote the value)" * isinstance(value, bool)
        raise ValueError(f"{where} takes {wanted}; got {value!r}{hint}" + _choices_text(action))
    if kind in (int, float):
        if isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                raise ValueError(f"{where} takes {_TYPE_WORDS[kind]}; got {value!r}") from None
        elif kind is int and not isinstance(value, int):
            raise ValueError(f"{where} takes {_TYPE_WORDS[kind]}; got {value!r}")
        else:
            value = kind(value)
    elif kind is None:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: invalid choice; got {value!r}" + _choices_text(action))
    return value


def _choices_text(action: argparse.Action) -> str:
    return f"; allowed: {', '.join(map(str, action.choices))}" if action.choices else ""


def parse_args(argv: list[str] | None = None, *, quiet: bool = False,
               environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse and check the command line and build ``args.agoq_config`` (:func:`build_config`; ``environ``:
    the process environment, ``os.environ`` when None); on an error print one line (none with ``quiet``)
    and exit 2."""
    parser = build_parser()
    parser.quiet = quiet
    first = parser.parse_args(argv)
    file_keys: set[str] = set()
    if first.config:
        try:
            values = load_config_file(first.config, parser)
        except ValueError as exc:
            parser.error(str(exc))
        parser.set_defaults(**values)
        file_keys = set(values)
    args = parser.parse_args(argv)
    try:
        _check_optimizer_state_flags(args)
        _fill_derived(args)
        validate(args)
        args.agoq_config = build_config(args, os.environ if environ is None else environ)
        check_policy_rules(args, args.agoq_config.policy.spec)
        _check_fc2_amax_flag(args)
        command_line = given_on_command_line(argv)
        check_unused_flags(args, command_line | file_keys, command_line)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def build_config(args: argparse.Namespace, environ) -> AgoqConfig:
    """The run's AgoqConfig from the parsed flags (config file < command line), the policy file loaded once,
    and the one environment variable agoq's library would otherwise read (TRITON_INTERPRET). The planner
    and the memory report build theirs with the same ``AgoqConfig.from_flags``."""
    policy = None if args.agoq_disable else load_policy(policy_path(args))
    try:
        return AgoqConfig.from_flags(vars(args), policy=policy,
                                     triton_interpret=environ.get("TRITON_INTERPRET") == "1")
    except GradsFormatError as exc:  # the float names this trainer takes (_check_float_grads_name)
        floats = "fp32, or bf16 with --grad-reduce-in-bf16 (Megatron's float gradients)"
        raise ValueError(exc.allowing(floats)) from None


def _check_optimizer_state_flags(args: argparse.Namespace) -> None:
    if args.agoq_optimizer == "torch":
        for flag in ("agoq_moments", "agoq_master"):
            if getattr(args, flag) is not None:
                raise ValueError(
                    f"--{flag.replace('_', '-')} {getattr(args, flag)} sets a state format of agoq's optimizer, but "
                    "--agoq-optimizer is torch (Megatron's Adam, fp32 states); add --agoq-optimizer adamw (or "
                    f"lion / sgd), or drop --{flag.replace('_', '-')}"
                )
    if args.agoq_moments is None:
        args.agoq_moments = DEFAULT_MOMENTS
    if args.agoq_master is None:
        args.agoq_master = DEFAULT_MASTER


def _fill_derived(args: argparse.Namespace) -> None:
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 64 * -(-int(8 * args.hidden_size / 3) // 64)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.vpp = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.vpp = per_stage // args.num_layers_per_virtual_pipeline_stage


def validate(args: argparse.Namespace) -> None:
    """Checks that need no process group; layout checks against the world size run at start-up. Then
    :func:`parse_args` builds the config (whose sections validate agoq's own values) and checks the policy's
    rules against this model (:func:`check_policy_rules`)."""
    if args.eval_interval is not None and (args.eval_interval <= 0 or args.eval_iters <= 0):
        raise ValueError("--eval-interval and --eval-iters must be positive")
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "train_iters", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "log_interval")
    for name in positive:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
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
            "--agoq-disable runs the plain Megatron baseline; drop --agoq-grads / --agoq-policy / --agoq-optimizer "
            "/ --agoq-fp8* / --agoq-smooth-swiglu"
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
    if args.num_layers % args.pipeline_model_parallel_size:
        raise ValueError(
            f"--num-layers {args.num_layers} is not divisible by {args.pipeline_model_parallel_size} model chunks "
            f"(--pipeline-model-parallel-size {args.pipeline_model_parallel_size}); pick a layer count or layout "
            "that divides evenly"
        )
    split_weights(args.split)
    data_blend(args.data_path)
    check_release_flags(args)  # data-parallel size 1 assumed here; pretrain checks the real one


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
    config = args.agoq_config
    if not config.grads.quantized:
        why = ("--agoq-disable" if args.agoq_disable else
               f"--agoq-grads {args.agoq_grads}" if args.agoq_grads else
               "no --agoq-grads FORMAT, and the policy sets no default grads")
        for name in ("agoq_grads_mode", "agoq_grad_transport"):
            flag = "--" + name.replace("_", "-")
            if name in given:
                add = "" if args.agoq_disable else "add --agoq-grads int8_b256, or "
                raise ValueError(f"{flag} {getattr(args, name)} applies to agoq's 8-bit gradients, which this run does "
                                 f"not use ({why}); {add}drop {flag}")
    _check_float_grads_name(args)
    for name in ("agoq_sgd_momentum", "agoq_sgd_nesterov", "agoq_lion_beta1", "agoq_lion_beta2"):
        kind = name.split("_")[1]
        if name in given and args.agoq_optimizer != kind:
            raise ValueError(f"--{name.replace('_', '-')} applies to --agoq-optimizer {kind} (this run: "
                             f"{args.agoq_optimizer}); add --agoq-optimizer {kind}, or drop --{name.replace('_', '-')}")
    _check_adam_flags(args, given, command_line)


ADAM_FLAGS = ("adam_beta1", "adam_beta2", "adam_eps")
OWN_FLAGS = {"lion": "--agoq-lion-beta1 and --agoq-lion-beta2 (and no eps)",
             "sgd": "--agoq-sgd-momentum and --agoq-sgd-nesterov"}


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
        raise ValueError(f"{values} set{'s' * (len(unused) == 1)} Adam (--agoq-optimizer torch or adamw), which "
                         f"--agoq-optimizer {args.agoq_optimizer} does not use; {args.agoq_optimizer} takes "
                         f"{OWN_FLAGS[args.agoq_optimizer]}; drop {flags} (or use --agoq-optimizer adamw)")


def _check_float_grads_name(args: argparse.Namespace) -> None:
    """A float name for the gradients (FLOAT_GRADS: agoq's 8-bit gradients off) must be the gradient buffer this run
    keeps: fp32 (Megatron's default, and with --fp32), or bf16 with --grad-reduce-in-bf16. ``--agoq-grads bf16``
    alone used to run an fp32 buffer without a word."""
    fmt = args.agoq_config.grads.format
    if fmt not in FLOAT_GRADS:
        return
    kept = "bf16" if args.grad_reduce_in_bf16 else "fp32"
    if fmt == kept:
        return
    source = f"--agoq-grads {fmt}" if args.agoq_grads else f"{policy_path(args)}: default.grads {fmt}"
    if fmt == "fp16":
        fix = ("this trainer keeps fp32 gradients, or bf16 ones with --grad-reduce-in-bf16 (it builds no fp16 "
               "parameters); write fp32, or bf16 with --grad-reduce-in-bf16")
    elif fmt == "bf16" and args.fp32:
        fix = "--fp32 parameters keep fp32 gradients; write fp32, or drop --fp32 and add --grad-reduce-in-bf16"
    elif fmt == "bf16":
        fix = ("Megatron keeps fp32 gradients unless --grad-reduce-in-bf16 is given; add --grad-reduce-in-bf16 for a "
               "bf16 gradient buffer, or write fp32")
    else:
        fix = "--grad-reduce-in-bf16 keeps them in bf16; write bf16, or drop --grad-reduce-in-bf16"
    raise ValueError(f"{source} names Megatron's float gradients in {fmt}, but this run keeps them in {kept}: {fix}")


def _check_fc2_amax_flag(args: argparse.Namespace) -> None:
    """--log-fc2-amax reads fc2's delayed-scaling history (agoq.megatron.compute.fc2_input_amax): without FP8
    delayed scaling there is none, and the flag would log nothing."""
    if args.log_fc2_amax and args.agoq_config.fp8.recipe != "delayed":
        raise ValueError(f"--log-fc2-amax reads the FP8 fc2's amax history, which only --agoq-fp8 delayed keeps "
                         f"(this run: {args.agoq_config.fp8.recipe}); add --agoq-fp8 delayed or drop the flag")


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


def policy_path(args: argparse.Namespace) -> Path:
    return Path(args.agoq_policy) if args.agoq_policy else DEFAULT_POLICY


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


def check_layout(args: argparse.Namespace, world_size: int) -> None:
    """Tensor x pipeline parallel size against the number of processes (before any process group exists)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes "
            f"(torchrun --nproc-per-node {tp * pp}) or lower the parallel sizes"
        )


def microbatch_count(global_batch: int, micro_batch: int, tp: int, pp: int, vpp: int | None,
                     world_size: int) -> int:
    """Micro-batches per step and data-parallel rank, or a ValueError naming the flags and the batch sizes that
    fit: the global batch is a multiple of micro-batch x data-parallel size, and Megatron's interleaved
    schedule needs a multiple of the pipeline size of them."""
    dp_size = world_size // (tp * pp)
    per_step = micro_batch * dp_size
    if global_batch % per_step:
        below = global_batch // per_step * per_step
        fits = " or ".join(str(g) for g in (below, below + per_step) if g > 0)
        raise ValueError(
            f"--global-batch-size {global_batch} must be a multiple of --micro-batch-size {micro_batch} x "
            f"data-parallel size {dp_size} (world size {world_size} / (TP {tp} x PP {pp})) = {per_step}; use "
            f"--global-batch-size {fits}, or another --micro-batch-size"
        )
    count = global_batch // per_step
    if vpp and count % pp:
        fits = -(-count // pp) * pp * per_step
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({count}) to be a multiple of "
            f"--pipeline-model-parallel-size {pp}; raise --global-batch-size (e.g. {fits}), or drop "
            "--num-layers-per-virtual-pipeline-stage"
        )
    return count


def preflight(args: argparse.Namespace, world_size: int) -> None:
    """What the script checks before torch and megatron load: the layout against ``world_size``, and with
    --data-path the tokenizer and every dataset (headers, sizes, splits, token ids: agoq.data.indexed)."""
    check_layout(args, world_size)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    microbatch_count(args.global_batch_size, args.micro_batch_size, tp, pp, args.vpp, world_size)
    blend = data_blend(args.data_path)
    if blend:
        from agoq.data.indexed import check_split, check_token_ids, check_tokenizer_record, read_index
        from agoq.data.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(args.tokenizer_model)
        for prefix in (p if isinstance(p, str) else p[1] for p in blend):
            data = read_index(prefix)
            check_split(data, args.split)
            check_token_ids(data, tokenizer.vocab_size, args.tokenizer_model)
            check_tokenizer_record(prefix, tokenizer.vocab_size, tokenizer.sha256, args.tokenizer_model)


def parse_and_check(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's start: :func:`parse_args` and :func:`preflight` against torchrun's WORLD_SIZE. A mistake
    is printed in one line by the first process of each node (LOCAL_RANK 0; the same line from every rank
    would repeat it per process) and every process exits 2."""
    quiet = os.environ.get("LOCAL_RANK", "0") != "0"
    args = parse_args(argv, quiet=quiet)
    try:
        preflight(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        if quiet:
            _exit_quietly_after_delay()
        print(f"pretrain_llama.py: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return args
