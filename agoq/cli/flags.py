"""The parser of ``scripts/pretrain_llama.py`` (its checks and config build: :mod:`agoq.train.args`; also
``python -m agoq.plan``'s trainer flags):
Megatron-compatible flags, ``--agoq-*`` flags, the help text, and errors in one line.

Unknown or abbreviated flags are errors (``allow_abbrev=False``), so a typo never silently falls back to a default;
the error names the closest real flag, or what a Megatron-LM-only flag means here
(:mod:`agoq.cli.flag_hints`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from agoq.cli.agoq_flags import TRAINER_UNSET, add_agoq_flags
from agoq.cli.flag_hints import TE_FP8_HINT, unknown_flag_hints
from agoq.cli.graph_args import add_graph_flags
from agoq.cli.seqpar_args import add_sequence_parallel_flag
from agoq.config import flag_for

# Light imports only (argparse, yaml, numpy, sentencepiece, the torch-free policy and format packages): the
# script parses and checks its command line before torch and megatron load (~5 s), so a bad flag, policy or
# data file stops in about a second (tests/unit/test_args.py::test_parsing_imports_neither_torch_nor_megatron).
from agoq.config.values import RECOMPUTE_GRANULARITIES, ROPE_FUSIONS

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "configs" / "policy" / "agoq.yaml"


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (LLaMA: RMSNorm, SwiGLU, RoPE, GQA, no biases; untied embeddings by default)")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers (all pipeline stages together)")
    g.add_argument("--hidden-size", type=int, default=64, help="model width")
    g.add_argument("--num-attention-heads", type=int, default=4, help="query heads")
    g.add_argument("--num-query-groups", type=int, default=None, help="KV heads (GQA); default = heads (MHA)")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width; default: LLaMA's 8/3·hidden rounded up to a multiple of 64")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (LLaMA-3: 500000)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Megatron-LM's flag: LLaMA-3.1's scaled RoPE (rope_type llama3: frequencies with wavelengths "
                        "beyond 8192 divided by --rope-scaling-factor, those below 2048 kept, a blend between; "
                        "megatron-core fixes low_freq_factor 1, high_freq_factor 4, original context 8192)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="Megatron-LM's flag: the factor of --use-rope-scaling (LLaMA-3.1 / 3.3: 8, LLaMA-3.2: 32)")
    tie = g.add_mutually_exclusive_group()
    tie.add_argument("--untie-embeddings-and-output-weights", dest="untie_embeddings_and_output_weights",
                     action="store_true", default=True,
                     help="Megatron-LM's flag: the output layer has its own weight. The default here (agoq's LLaMA "
                          "configs are untied; Megatron-LM ties unless it is given); tie with "
                          "--tie-embeddings-and-output-weights or untie_embeddings_and_output_weights: false")
    tie.add_argument("--tie-embeddings-and-output-weights", dest="untie_embeddings_and_output_weights",
                     action="store_false",
                     help="the output layer shares the embedding's weight (LLaMA-3.2-1B / 3B: tie_word_embeddings; "
                          "Megatron's share_embeddings_and_output_weights, kept equal across pipeline stages)")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="RMSNorm epsilon")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the normal weight initialisation")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="the model's vocabulary before padding (Megatron-LM's flag); default: the tokenizer's. Larger "
                        "than the tokenizer's: the embedding and output layer get this many rows (the data's ids stay "
                        "below the tokenizer's; e.g. LLaMA-3's 128256 with the built-in corpus), said at start-up; "
                        "smaller: refused. python -m agoq.plan reads it as the model's vocabulary")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the tokenizer's vocabulary to a multiple of this x --tensor-model-parallel-size")
    g.add_argument("--attention-backend", choices=("sdpa", "megatron"), default="sdpa",
                   help="sdpa: torch scaled_dot_product_attention (flash/cuDNN on GPU); "
                        "megatron: Megatron's unfused DotProductAttention (saves [b,h,s,s] probabilities)")
    g.add_argument("--rope-fusion", choices=ROPE_FUSIONS, default=None,
                   help="RoPE: auto (default): agoq's fused Triton RoPE where agoq is on and the run is on "
                        "CUDA, with Megatron's QKV split in the same op (Megatron's values and gradients bit for "
                        f"bit, one launch each way per layer instead of ~45); agoq: always, {flag_for('enabled')} too; "
                        "off: Megatron's split and unfused RoPE. A Transformer Engine RoPE, when installed, is kept")
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
    add_sequence_parallel_flag(g)
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
                   help="iteration at which the decay reaches --min-lr, counted from iteration 0 with the warmup "
                        "included (Megatron's OptimizerParamScheduler); default: --train-iters")
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
                        "--lr-decay-iters, --lr-decay-style, --train-iters) and --weight-decay from the checkpoint's "
                        "iteration on; default: the checkpoint's, with the differences printed (Megatron-LM's "
                        "--use-checkpoint-opt_param-scheduler; Megatron-LM without either flag stops on a difference)")
    g.add_argument("--seed", type=int, default=1234,
                   help="weight initialisation (stage s of a pipeline seeds with SEED + 100 x s, as Megatron-LM) "
                        "and data order")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Megatron-LM's flag: bit-reproducible runs on a GPU (torch's deterministic algorithms, "
                        "NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8; slower; agoq.train.determinism)")


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
                   help="validation loss every N iterations and at the end, and the test split's once when training "
                        "completes (Megatron-LM's; default: no evaluation)")
    g.add_argument("--eval-iters", type=int, default=2, help="global batches per evaluation")
    g.add_argument("--data-cache-dir", default=None,
                   help="where the built-in corpus and the dataset indices are cached; default: $AGOQ_CACHE, "
                        "else ~/.cache/agoq/data")


def _run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save", default=None, help="checkpoint directory (megatron.core.dist_checkpointing)")
    g.add_argument("--load", default=None,
                   help="resume from the latest checkpoint in this directory (its tracker file), or from exactly "
                        "iteration N with DIR/iter_000000N (Megatron-LM's --ckpt-step); a directory without a "
                        "checkpoint yet starts from scratch when --save holds none either (docs/user-guide.md 8)")
    g.add_argument("--allow-fresh-start", action="store_true",
                   help="start from scratch although --load holds checkpoints (they are not read); checkpoints in "
                        "--save are never written over")
    g.add_argument("--force-unlock", action="store_true",
                   help="take the --save folder's lock (agoq_save.lock) even if its holder looks alive; only when "
                        "that job is known to be gone")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (default, or 0: only at the end, on a signal and at --exit-interval)")
    g.add_argument("--log-interval", type=int, default=1,
                   help="print an iteration line every N iterations (averaged over them, as Megatron-LM)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving) at the first iteration of this run that is a multiple of N, as "
                        "Megatron-LM (default, or 0: run to --train-iters)")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's automatic garbage collector off during training, collections at fixed points "
                        "instead (Megatron-LM's flag: aligns the pauses across ranks where the host sets the pace)")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: a full collection every N training steps (0, the default: not between "
                        "steps)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: no collection before and after each evaluation")
    g.add_argument("--debug-nonfinite-at-iteration", type=int, nargs="+", default=None, metavar="N",
                   help="fault injection for testing: make the loss NaN at these iterations (the step is skipped)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars and the resolved policy table here (needs `tensorboard`)")
    g.add_argument("--wandb-project", default=None,
                   help="Megatron-LM's flag: log the iteration scalars to this Weights & Biases project too (needs "
                        "`wandb` and --wandb-exp-name; WANDB_MODE=offline writes the run files only)")
    g.add_argument("--wandb-exp-name", default=None, help="Megatron-LM's flag: the Weights & Biases run name")
    g.add_argument("--wandb-save-dir", default=None,
                   help="Megatron-LM's flag: where wandb writes its files (default: <--save>/wandb, without --save "
                        "./wandb)")
    g.add_argument("--log-json", default=None,
                   help="also append each logged iteration as one JSON object per line to this file")
    g.add_argument("--log-fc2-amax", action="store_true",
                   help="add each FP8 fc2 input's newest amax (per layer, and their max) to the logged iterations "
                        "(TensorBoard, --log-json): the FP8 paper's outlier proxy, with or without "
                        f"{flag_for('fp8.smooth_swiglu')}; needs {flag_for('fp8.recipe')} delayed")


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
# printing rank down before its one error line was out (seen about once in nine launches, 2026-11-26; and with 1 s,
# once in CI on 2026-12-07: on two loaded cores the printing rank reached its check over 1 s after the others).
# The wait costs nothing when the printing rank exits first: torchrun then stops the waiting ranks at once.
QUIET_EXIT_DELAY_S = 5.0


def exit_quietly_after_delay() -> None:
    time.sleep(QUIET_EXIT_DELAY_S)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    """argparse that reports an error in one line, without the usage dump (which under torchrun was ~150
    lines per rank); ``quiet`` (ranks other than the first on a node) exits without printing, a moment after
    the printing rank (QUIET_EXIT_DELAY_S)."""

    quiet = False

    def error(self, message: str):
        if self.quiet:
            exit_quietly_after_delay()
        if message.startswith("unrecognized arguments: "):
            message += unknown_flag_hints(message.split(": ", 1)[1].split(), self._option_string_actions)
        elif message.startswith(f"argument {flag_for('fp8.recipe')}: invalid choice: 'te'"):
            message += TE_FP8_HINT
        self.exit(2, f"{self.prog}: error: {message} (all flags: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_llama.py", allow_abbrev=False, formatter_class=_HelpFormatter,
        description="Pretrain a LLaMA-architecture model on megatron-core with agoq.",
        epilog="Defaults are the built-in ones; a --config file replaces them (file < command line).",
    )
    parser.add_argument("--config", default=None, help="YAML file of flag values (snake_case keys)")
    for add in (_model_flags, _parallel_flags, _optim_flags, _data_flags, _run_flags):
        add(parser)
    # generated from AgoqConfig (agoq.cli.agoq_flags); --agoq-moments / --agoq-master default to None so that they
    # are refused without agoq's optimizer, not ignored (agoq.train.args puts in the defaults)
    add_agoq_flags(parser, unset=TRAINER_UNSET)
    add_graph_flags(parser)
    return parser


def policy_path(args: argparse.Namespace) -> Path:
    """--agoq-policy, else DEFAULT_POLICY."""
    return Path(args.agoq_policy) if args.agoq_policy else DEFAULT_POLICY

