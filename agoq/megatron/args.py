"""Command line of ``scripts/pretrain_llama.py``: Megatron-compatible flags, ``--agoq-*`` flags, config files.

Precedence (lowest to highest): built-in defaults < ``--config FILE.yaml`` < flags on the command line.
A config file holds flag names in snake_case (``num_layers: 4``); an unknown key stops the run with
the file, the key and the allowed keys. Unknown or abbreviated flags are errors too
(``allow_abbrev=False``), so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

import yaml

from agoq.megatron.compute import add_compute_flags
from agoq.megatron.ddp import add_grad_flags
from agoq.megatron.optim_args import add_optim_flags, check_release_flags

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (LLaMA: RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="KV heads (GQA); default = heads (MHA)")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: LLaMA's 8/3·hidden rounded to 64")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--attention-backend", choices=("sdpa", "megatron"), default="sdpa",
                   help="sdpa: torch scaled_dot_product_attention (flash/cuDNN on GPU); "
                        "megatron: Megatron's unfused DotProductAttention (saves [b,h,s,s] probabilities)")
    g.add_argument("--fp32", action="store_true", help="fp32 parameters and compute (default: bf16)")
    g.add_argument("--recompute-granularity", choices=("full",), default=None,
                   help="Megatron's full activation recompute (GPU only; with an agoq policy the recomputed "
                        "forward stores its activations per the policy for the backward that follows)")
    g.add_argument("--recompute-num-layers", type=int, default=1,
                   help="with --recompute-granularity full: layers per recomputed group (method 'uniform')")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="enables the interleaved 1F1B schedule")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron-LM's flag: reduce each gradient bucket as soon as its last gradient is ready, "
                        "overlapping the data-parallel reduction with backward (no effect at DP=1)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket with --overlap-grad-reduce (Megatron's default: "
                        "max(40M, 1M x data-parallel size))")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)


def _optim_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule (Megatron's Adam(W), OptimizerParamScheduler)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=5)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="bf16 gradient buffer: accumulate and reduce main_grad in bf16 instead of Megatron's fp32 "
                        "(FlashOptim's 16-bit gradients; 2 instead of 4 bytes/param). Needs bf16 params")
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, follow this command line's LR schedule (--lr, --min-lr, --lr-warmup-iters, "
                        "--lr-decay-iters, --lr-decay-style, --train-iters) from the checkpoint's iteration on; "
                        "default: the checkpoint's schedule (Megatron-LM's --use-checkpoint-opt_param-scheduler)")
    g.add_argument("--seed", type=int, default=1234)


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="Megatron blend: PREFIX or 'W1 PREFIX1 W2 PREFIX2 ...' (.bin/.idx written by "
                        "scripts/prepare_data.py). Default: agoq's built-in corpus, built once and cached")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model (required with --data-path)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations and at the end (default: no evaluation)")
    g.add_argument("--eval-iters", type=int, default=2, help="global batches per evaluation")
    g.add_argument("--data-cache-dir", default=None, help="default: $AGOQ_CACHE or ~/.cache/agoq")


def _run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None, help="checkpoint directory (megatron.core.dist_checkpointing)")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    g.add_argument("--save-interval", type=int, default=None, help="default: only at the end")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--exit-interval", type=int, default=None, help="stop (after saving) at this iteration")
    g.add_argument("--debug-nonfinite-at-iteration", type=int, nargs="+", default=None, metavar="N",
                   help="fault injection for testing: make the loss NaN at these iterations (the step is skipped)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars and the resolved policy table here (needs `tensorboard`)")
    g.add_argument("--log-json", default=None,
                   help="also append each logged iteration as one JSON object per line to this file")


def _agoq_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agoq")
    g.add_argument("--agoq-policy", default=None,
                   help="bit-width policy YAML (default: configs/policy/agoq.yaml); see docs/policy.md")
    g.add_argument("--agoq-disable", action="store_true", help="run plain Megatron (the baseline)")
    g.add_argument("--agoq-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: GPU when CUDA is available, else CPU mode (gloo, shims; correctness only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_llama.py", allow_abbrev=False,
        description="Pretrain a LLaMA-architecture model on megatron-core with agoq.",
    )
    parser.add_argument("--config", default=None, help="YAML file of flag values (snake_case keys)")
    for add in (_model_flags, _parallel_flags, _optim_flags, _data_flags, _run_flags, _agoq_flags, add_grad_flags,
                add_optim_flags, add_compute_flags):
        add(parser)
    return parser


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """Read a YAML config of flag values; every key must be a flag's snake_case name."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: file not found")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: YAML syntax error: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    allowed = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"--config {path}: unknown key {key!r}{hint}. Allowed keys: {', '.join(sorted(allowed))}"
            )
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    first = parser.parse_args(argv)
    if first.config:
        try:
            parser.set_defaults(**load_config_file(first.config, parser))
        except ValueError as exc:
            parser.error(str(exc))
    args = parser.parse_args(argv)
    _fill_derived(args)
    try:
        validate(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


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
    """Checks that need no process group; layout checks against the world size run at start-up."""
    if args.eval_interval is not None and (args.eval_interval <= 0 or args.eval_iters <= 0):
        raise ValueError("--eval-interval and --eval-iters must be positive")
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "train_iters", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "log_interval")
    for name in positive:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{args.lr_decay_iters} (which defaults to --train-iters)"
        )
    if args.data_path and not args.tokenizer_model:
        raise ValueError("--data-path needs --tokenizer-model (the SentencePiece model the data was written with)")
    nlpvs = args.num_layers_per_virtual_pipeline_stage
    if nlpvs:
        per_stage, rem = divmod(args.num_layers, args.pipeline_model_parallel_size)
        if rem or per_stage % nlpvs or per_stage // nlpvs < 2:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {nlpvs}: each of the "
                f"{args.pipeline_model_parallel_size} stages must hold a multiple of it, and at least two "
                f"virtual stages (--num-layers {args.num_layers})"
            )
    for flag in ("agoq_policy", "config", "tokenizer_model"):
        value = getattr(args, flag)
        if value and not Path(value).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {value}: file not found")
    compute_flags = [args.agoq_fp8, args.agoq_smooth_swiglu, args.agoq_fp8_bf16_first_layers,
                     args.agoq_fp8_bf16_last_layers, args.agoq_fp8_amax_history_len]
    if args.agoq_disable and (args.agoq_grads or args.agoq_policy or args.agoq_optimizer != "torch"
                              or any(v is not None for v in compute_flags)):
        raise ValueError(
            "--agoq-disable runs the plain Megatron baseline; drop --agoq-grads / --agoq-policy / --agoq-optimizer "
            "/ --agoq-fp8* / --agoq-smooth-swiglu"
        )
    if args.grad_reduce_in_bf16 and args.fp32:
        raise ValueError("--grad-reduce-in-bf16 needs bf16 parameters; drop --fp32 (fp32 params reduce fp32 grads)")
    if args.grad_reduce_in_bf16 and args.agoq_grads and args.agoq_grads not in ("fp32", "bf16", "fp16"):
        raise ValueError(
            f"--grad-reduce-in-bf16 with --agoq-grads {args.agoq_grads}: the 8-bit gradient path is validated with "
            "Megatron's fp32 float buffer only; use one of the two (8-bit grads already store 1 byte/param)"
        )
    if args.recompute_num_layers < 1:
        raise ValueError(f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")
    if args.load and not Path(args.load).is_dir():
        raise ValueError(f"--load {args.load}: directory not found (use --save to start a new run)")
    check_release_flags(args)  # data-parallel size 1 assumed here; pretrain checks the real one
