"""``python -m agoq.plan``: predict per-stage memory and write the richest policy that fits.

Example (a ~1B LLaMA, PP=2, 80 GiB GPUs)::

    python -m agoq.plan --model configs/model/tiny.yaml --num-layers 16 --hidden-size 2048 \
        --ffn-hidden-size 5632 --num-attention-heads 32 --num-query-groups 8 --vocab-size 32000 \
        --tp 1 --pp 2 --mbs 4 --gbs 64 --seq 4096 --memory-budget 80GiB --out chosen.yaml

Candidates (richest first): configs/policy/{bf16,int8,agoq,int4,aggressive}.yaml, or --policies.
Exit code 0 when a policy fits (its YAML is copied to --out), 3 when none does.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from agoq.plan.memory import Layout, ModelShape, choose_policy, format_report, parse_bytes
from agoq.policy import load_policy

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
    p.add_argument("--memory-budget", required=True, help="per GPU, e.g. 80GiB")
    p.add_argument("--policies", nargs="+", help="candidate policy YAMLs, richest first")
    p.add_argument("--out", help="write the chosen policy YAML here")
    return p.parse_args(argv)


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
                    distributed_optimizer=args.distributed_optimizer)
    names = DEFAULT_CANDIDATES
    paths = [Path(p) for p in args.policies] if args.policies else [POLICY_DIR / f"{n}.yaml" for n in names]
    candidates = [(p.stem, load_policy(p)) for p in paths]
    budget = parse_bytes(args.memory_budget)
    try:
        chosen, report = choose_policy(ModelShape(**values), layout, candidates, budget)
    except ValueError as err:
        print(f"agoq.plan: error: {err}", file=sys.stderr)
        return 2
    print(format_report(report, budget))
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
