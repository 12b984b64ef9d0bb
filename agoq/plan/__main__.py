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
scripts/pretrain_llama.py's flags of the same names do (FP8: the flags only, not a policy's fp8 section).
Exit code 0 when a policy fits (its YAML is copied to --out), 3 when none does.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from agoq.plan.memory import Layout, ModelShape, parse_bytes
from agoq.plan.peak import Recipe, choose_by_peak, format_peak_report, grad_bytes_per_param
from agoq.policy import FP8_RECIPES, SMOOTH_SWIGLU_MODES, FP8Spec, load_policy

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"
DEFAULT_CANDIDATES = ("bf16", "int8", "agoq", "int4", "aggressive")
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m agoq.plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model YAML (configs/model/*.yaml); flags below override it")
    for key in SHAPE_KEYS:
        p.add_argument("--" + key.replace("_", "-"), type=int)
    for flag, default in (("--tp", 1), ("--pp", 1), ("--dp", 1), ("--mbs", None), ("--gbs", None), ("--seq", None)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per rank")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--agoq-optimizer", default="torch",
                   help="torch (Megatron's AdamW, default) or an agoq optimizer (adamw, lion, sgd)")
    p.add_argument("--agoq-moments", default="cint8_b32,cuint8_b32", help="agoq optimizer's state formats")
    p.add_argument("--agoq-master", default="split24", choices=("none", "split24", "split32", "fp32"))
    p.add_argument("--agoq-grads", default=None, metavar="FORMAT", help="8-bit gradient store, e.g. int8_b256")
    p.add_argument("--grad-reduce-in-bf16", action="store_true")
    p.add_argument("--agoq-gradient-release", action="store_true",
                   help="no gradient buffer; each parameter stepped inside backward (agoq optimizer, PP=DP=1)")
    p.add_argument("--recompute-granularity", choices=("full",), default=None,
                   help="Megatron's full recompute (one layer per group)")
    p.add_argument("--agoq-fp8", choices=[r for r in FP8_RECIPES if r != "te"], default="off",
                   help="agoq's FP8 linears: weight caches, scaling state, FP8 saved inputs (agoq.plan.fp8)")
    p.add_argument("--agoq-smooth-swiglu", choices=SMOOTH_SWIGLU_MODES, default="off")
    p.add_argument("--agoq-fp8-bf16-first-layers", type=int, default=FP8Spec.bf16_first_layers)
    p.add_argument("--agoq-fp8-bf16-last-layers", type=int, default=FP8Spec.bf16_last_layers)
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


def main(argv=None) -> int:
    args = parse(argv)
    cfg = yaml.safe_load(Path(args.model).read_text()) if args.model else {}
    values = {k: getattr(args, k) if getattr(args, k) is not None else cfg.get(k) for k in SHAPE_KEYS}
    values["vocab_size"] = values["vocab_size"] or 32000
    missing = [k for k, v in values.items() if v is None]
    if missing:
        print(f"agoq.plan: error: give --{', --'.join(m.replace('_', '-') for m in missing)} (or a --model YAML)",
              file=sys.stderr)
        return 2
    layout = Layout(tp=args.tp, pp=args.pp, vpp=args.vpp, dp=args.dp, mbs=args.mbs or cfg.get("micro_batch_size", 1),
                    gbs=args.gbs or cfg.get("global_batch_size", 1), seq=args.seq or cfg.get("seq_length", 2048),
                    distributed_optimizer=args.distributed_optimizer,
                    grad_bytes=0 if args.agoq_gradient_release else 2 if args.grad_reduce_in_bf16 else 4)
    if args.agoq_gradient_release and args.agoq_optimizer == "torch":
        print("agoq.plan: error: --agoq-gradient-release needs --agoq-optimizer adamw|lion|sgd", file=sys.stderr)
        return 2
    moments = tuple(m.strip() for m in args.agoq_moments.split(","))
    recipe = Recipe(optimizer="torch" if args.agoq_optimizer == "torch" else "agoq", grads=args.agoq_grads,
                    moments=moments if args.agoq_optimizer in ("torch", "adamw") else moments[:1],
                    master=args.agoq_master, recompute=args.recompute_granularity == "full",
                    gradient_release=args.agoq_gradient_release,
                    fp8=FP8Spec(recipe=args.agoq_fp8, smooth_swiglu=args.agoq_smooth_swiglu,
                                bf16_first_layers=args.agoq_fp8_bf16_first_layers,
                                bf16_last_layers=args.agoq_fp8_bf16_last_layers))
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
