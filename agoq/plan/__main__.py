"""``python -m agoq.plan``: predict each stage's peak GPU memory and write the richest policy that fits.

Example (a ~1B LLaMA, PP=2, 80 GiB GPUs)::

    python -m agoq.plan --model configs/model/tiny.yaml --num-layers 16 --hidden-size 2048 \
        --ffn-hidden-size 5632 --num-attention-heads 32 --num-query-groups 8 --vocab-size 32000 \
        --tp 1 --pp 2 --mbs 4 --gbs 64 --seq 4096 --memory-budget 80GiB --out chosen.yaml

Candidates (richest first): configs/policy/{bf16,int8,agoq,int4,aggressive}.yaml, or --policies. A
policy fits when the predicted peak (agoq.plan.peak: persistent state + activations + backward / loss /
optimizer-step temporaries; accuracy in docs/benchmarks/planner.md) of every stage is within the
budget. --agoq-optimizer / --agoq-grads / --grad-reduce-in-bf16 / --recompute-granularity / --agoq-fp8 /
--agoq-smooth-swiglu / --agoq-fp8-bf16-first-layers / --agoq-fp8-bf16-last-layers describe the run as
scripts/pretrain_llama.py's flags of the same names do (FP8: the flags only, not a policy's fp8 section):
the run's ``AgoqConfig`` is built by the trainer's function (``AgoqConfig.from_flags``, same defaults) from
the --model file's values and these flags. The --model file (a trainer config, configs/model/*.yaml) gives
the shape, the layout (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``num_layers_per_virtual_pipeline_stage``, ``use_distributed_optimizer``), the batch, the vocabulary
(``tokenizer_model`` padded to ``make_vocab_size_divisible_by`` x TP as the trainer does; else 32000) and
any ``agoq_*`` settings; flags given here override it.
Exit code 0 when a policy fits (its YAML is copied to --out), 3 when none does.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from agoq.config import MASTER_CHOICES, OPTIMIZERS, AgoqConfig
from agoq.plan.memory import Layout, ModelShape, parse_bytes
from agoq.plan.peak import Recipe, choose_by_peak, format_peak_report, grad_bytes_per_param
from agoq.plan.recipe import recipe_of
from agoq.policy import FP8_RECIPES, SMOOTH_SWIGLU_MODES, load_policy

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"
DEFAULT_CANDIDATES = ("bf16", "int8", "agoq", "int4", "aggressive")
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
DEFAULT_VOCAB = 32000  # without --vocab-size or a model file's tokenizer_model
MEGATRON_VOCAB_DIVISIBLE_BY = 128  # the trainer's --make-vocab-size-divisible-by default
# planner flag -> the trainer's flag (config-file key) it stands for
LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "mbs": "micro_batch_size",
               "gbs": "global_batch_size", "seq": "seq_length", "distributed_optimizer": "use_distributed_optimizer"}
LAYOUT_DEFAULTS = {"tp": 1, "pp": 1, "dp": 1, "mbs": 1, "gbs": 1, "seq": 2048, "distributed_optimizer": False}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m agoq.plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model YAML (configs/model/*.yaml): shape, layout, batch, vocabulary; flags "
                                   "below override it")
    for key in SHAPE_KEYS:
        p.add_argument("--" + key.replace("_", "-"), type=int)
    for flag in ("--tp", "--pp", "--dp", "--mbs", "--gbs", "--seq"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per rank")
    p.add_argument("--distributed-optimizer", action="store_true", default=None)
    # agoq's settings: the trainer's flags, defaults from agoq.config (None: not given here)
    p.add_argument("--agoq-optimizer", choices=OPTIMIZERS, default=None,
                   help="torch (Megatron's AdamW, default) or an agoq optimizer (adamw, lion, sgd)")
    p.add_argument("--agoq-moments", default=None, help="agoq optimizer's state formats (default flash)")
    p.add_argument("--agoq-master", default=None, choices=MASTER_CHOICES)
    p.add_argument("--agoq-grads", default=None, metavar="FORMAT", help="8-bit gradient store, e.g. int8_b256")
    p.add_argument("--grad-reduce-in-bf16", action="store_true", default=None)
    p.add_argument("--agoq-gradient-release", action="store_true", default=None,
                   help="no gradient buffer; each parameter stepped inside backward (agoq optimizer, PP=DP=1)")
    p.add_argument("--recompute-granularity", choices=("full",), default=None,
                   help="Megatron's full recompute (one layer per group)")
    p.add_argument("--agoq-fp8", choices=[r for r in FP8_RECIPES if r != "te"], default=None,
                   help="agoq's FP8 linears: weight caches, scaling state, FP8 saved inputs (agoq.plan.fp8)")
    p.add_argument("--agoq-smooth-swiglu", choices=SMOOTH_SWIGLU_MODES, default=None)
    p.add_argument("--agoq-fp8-bf16-first-layers", type=int, default=None)
    p.add_argument("--agoq-fp8-bf16-last-layers", type=int, default=None)
    p.add_argument("--memory-budget", required=True, help="per GPU, e.g. 80GiB")
    p.add_argument("--policies", nargs="+", help="candidate policy YAMLs, richest first")
    p.add_argument("--out", help="write the chosen policy YAML here")
    return p.parse_args(argv)


def _gradient_line(recipe: Recipe, layout: Layout) -> str:
    held, after = grad_bytes_per_param(recipe, layout)
    extra = f" + {after:.3f} B fp32 from the reduction to zero_grad" if after else ""
    optimizer = "Megatron's Adam" if recipe.optimizer == "torch" else "agoq's optimizer"
    if layout.distributed_optimizer:
        optimizer += f", distributed over {layout.dp} rank{'s' if layout.dp > 1 else ''}"
    return f"gradients per parameter per rank: {held:.3f} B held{extra} ({recipe.grads or 'float'}; {optimizer})"


def read_model_file(path: str | None) -> dict:
    """The model file's values (a trainer config: flag names in snake_case); {} without one."""
    if not path:
        return {}
    values = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--model {path}: expected a mapping of flag names to values")
    return values


def _vocab_size(cfg: dict, tp: int) -> int:
    """The trainer's padded vocabulary of the model file's tokenizer_model, else DEFAULT_VOCAB."""
    if not cfg.get("tokenizer_model"):
        return DEFAULT_VOCAB
    from agoq.data.tokenizer import Tokenizer, padded_vocab_size

    vocab = Tokenizer.load(cfg["tokenizer_model"]).vocab_size
    return padded_vocab_size(vocab, tp, cfg.get("make_vocab_size_divisible_by", MEGATRON_VOCAB_DIVISIBLE_BY))


def layout_of(args: argparse.Namespace, cfg: dict, config: AgoqConfig) -> Layout:
    """The planner's Layout: flags over the model file's layout and batch keys over the defaults."""
    values = {key: getattr(args, key) if getattr(args, key) is not None
              else cfg.get(LAYOUT_KEYS.get(key, key), default) for key, default in LAYOUT_DEFAULTS.items()}
    vpp = args.vpp
    per_chunk = cfg.get("num_layers_per_virtual_pipeline_stage")
    if vpp is None and per_chunk:
        vpp = cfg["num_layers"] // values["pp"] // per_chunk
    grad_bytes = 0 if config.optimizer.gradient_release else 2 if config.grads.reduce_in_bf16 else 4
    return Layout(vpp=vpp, grad_bytes=grad_bytes, **values)


def config_of(args: argparse.Namespace, cfg: dict) -> AgoqConfig:
    """The run's AgoqConfig as the trainer builds it (AgoqConfig.from_flags): the model file's values, then
    the flags given here; no policy's fp8 / grads section (the candidates differ)."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    return AgoqConfig.from_flags({**cfg, **given}, policy=None)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        cfg = read_model_file(args.model)
        config = config_of(args, cfg)
    except ValueError as err:
        print(f"agoq.plan: error: {err}", file=sys.stderr)
        return 2
    layout = layout_of(args, cfg, config)
    values = {k: getattr(args, k) if getattr(args, k) is not None else cfg.get(k) for k in SHAPE_KEYS}
    values["vocab_size"] = values["vocab_size"] or _vocab_size(cfg, layout.tp)
    missing = [k for k, v in values.items() if v is None]
    if missing:
        print(f"agoq.plan: error: give --{', --'.join(m.replace('_', '-') for m in missing)} (or a --model YAML)",
              file=sys.stderr)
        return 2
    recipe = recipe_of(config)
    names = DEFAULT_CANDIDATES
    paths = [Path(p) for p in args.policies] if args.policies else [POLICY_DIR / f"{n}.yaml" for n in names]
    candidates = [(p.stem, load_policy(p)) for p in paths]
    budget = parse_bytes(args.memory_budget)
    try:
        chosen, report = choose_by_peak(ModelShape(**values), layout, candidates, budget, recipe)
    except ValueError as err:
        print(f"agoq.plan: error: {err}", file=sys.stderr)
        return 2
    print(_gradient_line(recipe, layout))
    print(format_peak_report(report, budget))
    if chosen is None:
        print("no candidate policy fits: lower --mbs, raise --pp/--tp, or use the distributed optimizer")
        return 3
    print(f"chosen: {chosen}")
    if args.out:
        shutil.copyfile(paths[[n for n, _ in candidates].index(chosen)], args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
