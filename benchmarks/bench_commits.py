"""Two checkouts of agoq side by side on one GPU: the same runs of ``scripts/pretrain_llama.py`` from each, in
interleaved rounds (old, new, old, new, ...), so that host drift lands on both.

It answers "did a restructuring change what a user gets?" on the real device: per variant and checkout, the median
step time and tokens/s (iterations from ``--skip`` on), the peak allocated GiB, and every iteration's loss and
gradient norm, with a verdict whether the two checkouts' losses and grad norms are bit-identical in every round,
and, where they are not, whether the checkouts differ by more than two runs of one checkout do (on a GPU, kernels
that accumulate with atomics make two runs of one checkout differ from the first backward on; H100, 2026-12-07: the
~1B baseline's grad norm differed in the 6th digit at iteration 0, with deterministic algorithms requested in
warn-only mode). ``--deterministic`` runs every rank with ``torch.use_deterministic_algorithms(True)`` (not
warn-only: under ``warn_only=True`` PyTorch's flash-attention backward keeps its non-deterministic dQ accumulation
and only warns, aten/src/ATen/native/transformers/cuda/attention_backward.cu; an op with no deterministic kernel
then stops its run with PyTorch's error, which the row records) and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (through a
``sitecustomize`` on ``PYTHONPATH``, so that neither checkout needs a flag for it).

    # the checkout before the step, unpacked beside this one (ignored by git; carried to the GPU machine):
    mkdir -p .old/a43a8b4 && git archive a43a8b4 | tar -x -C .old/a43a8b4
    python benchmarks/bench_commits.py --tree old=.old/a43a8b4 --tree new=. --rounds 2 --out commits.json

Each run is one ``torchrun`` process with that checkout as its working directory and first on ``PYTHONPATH``;
everything else (megatron-core, torch, the built-in corpus) is shared. ``--variants`` picks rows of ``VARIANTS``.
CPU smoke (tiny model, 2 iterations; times are not meaningful): ``--smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# the ~1B LLaMA body of the graphs suites (benchmarks/device/common.sh's LLAMA_1B_MBS1) at seq 4096
SHAPE_1B = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32", "--num-query-groups", "8",
            "--ffn-hidden-size", "8192", "--seq-length", "4096"]
SHAPE_TINY = ["--config", "configs/model/tiny.yaml"]
AGOQ_FULL = ["--agoq-grads", "int8_b256", "--agoq-optimizer", "adamw"]
VARIANTS: dict[str, list[str]] = {  # name -> flags (flags both checkouts accept)
    "baseline": ["--agoq-disable"],
    "agoq_full": AGOQ_FULL,
    "agoq_full_fp8": [*AGOQ_FULL, "--agoq-fp8", "delayed", "--agoq-smooth-swiglu", "per-token"],
}


def schedule(iters: int, micro_batch: int, global_batch: int) -> list[str]:
    return ["--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch), "--train-iters",
            str(iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--log-interval", "1",
            "--seed", "1234"]


DETERMINISTIC_SITE = (
    "import torch  # written by benchmarks/bench_commits.py --deterministic\n"
    "torch.use_deterministic_algorithms(True)\n")


def deterministic_site(folder: Path) -> dict[str, str]:
    """Environment additions that make every Python process started with them use deterministic algorithms."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(DETERMINISTIC_SITE)
    return {"AGOQ_BENCH_SITE": str(folder), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def run_one(tree: Path, variant: str, args, record: Path, port: int) -> dict:
    """One run of ``variant`` from checkout ``tree``; its per-iteration record read back from ``--log-json``."""
    record.unlink(missing_ok=True)
    shape = SHAPE_TINY if args.smoke else SHAPE_1B
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "--master-port", str(port), "scripts/pretrain_llama.py", *shape,
               *schedule(args.iters, args.micro_batch, args.global_batch), *VARIANTS[variant],
               "--log-json", str(record)]
    first = [str(tree)] + ([os.environ["AGOQ_BENCH_SITE"]] if "AGOQ_BENCH_SITE" in os.environ else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*first, os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    iterations = []
    if record.exists():
        iterations = [r for r in map(json.loads, record.read_text().splitlines()) if "lm_loss" in r]
    kept = [r["step_seconds"] for r in iterations if r["iteration"] >= args.skip]
    tokens_per_step = args.global_batch * (128 if args.smoke else 4096)
    run = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
           "median_step_s": statistics.median(kept) if kept else None,
           "tokens_per_s": round(tokens_per_step / statistics.median(kept), 1) if kept else None,
           "peak_gib": max((r.get("peak_gib", r.get("rss_gib", 0.0)) for r in iterations), default=None),
           "losses": [r["lm_loss"] for r in iterations], "grad_norms": [r["grad_norm"] for r in iterations]}
    if proc.returncode != 0 or not iterations:
        run["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    return run


def first_difference(a: dict, b: dict) -> int | None:
    """The first iteration whose loss or grad norm differs between two runs (None: identical traces); a run that
    stopped early differs at the first iteration it lacks."""
    ta = list(zip(a["losses"], a["grad_norms"], strict=True))
    tb = list(zip(b["losses"], b["grad_norms"], strict=True))
    shared = min(len(ta), len(tb))
    first = next((i for i in range(shared) if ta[i] != tb[i]), None)
    return first if first is not None or len(ta) == len(tb) else shared


def max_loss_gap(a: dict, b: dict) -> float:
    shared = min(len(a["losses"]), len(b["losses"]))
    return max((abs(x - y) for x, y in zip(a["losses"][:shared], b["losses"][:shared], strict=True)), default=0.0)


def spread(per_tree: dict[str, list[dict]]) -> dict:
    """Two runs of one checkout against two runs of different checkouts: the earliest iteration where a pair
    differs and the largest loss gap, and the verdict on whether the checkouts differ beyond the run-to-run spread."""
    runs = [(t, r) for t, rs in per_tree.items() for r in rs if r["losses"]]
    within = [(a, b) for i, (ta, a) in enumerate(runs) for tb, b in runs[i + 1:] if ta == tb]
    across = [(a, b) for i, (ta, a) in enumerate(runs) for tb, b in runs[i + 1:] if ta != tb]

    def describe(pairs):
        firsts = [first_difference(a, b) for a, b in pairs]
        differing = [f for f in firsts if f is not None]
        return {"pairs": len(pairs), "identical_pairs": len(firsts) - len(differing),
                "first_differing_iteration": min(differing, default=None),
                "max_loss_gap": max((max_loss_gap(a, b) for a, b in pairs), default=None)}

    out = {"within_checkout": describe(within), "across_checkouts": describe(across)}
    w, x = out["within_checkout"], out["across_checkouts"]
    if not across:
        out["verdict"] = "no pair of checkouts ran"
    elif x["identical_pairs"] == x["pairs"]:
        out["verdict"] = "bit-identical"
    elif not within:
        out["verdict"] = "differs; no two runs of one checkout to compare with"
    elif w["identical_pairs"] == w["pairs"]:
        out["verdict"] = "differs beyond the run-to-run spread (runs of one checkout are bit-identical)"
    elif x["first_differing_iteration"] >= w["first_differing_iteration"]:
        # once two runs of one checkout differ, later gaps grow chaotically in both kinds of pair: the first
        # differing iteration is the comparison that does not depend on how many pairs there are
        out["verdict"] = "within the run-to-run spread (differs no earlier than runs of one checkout)"
    else:
        out["verdict"] = "differs earlier than runs of one checkout do"
    return out


def summarise(rows: list[dict], trees: list[str]) -> dict:
    """Per variant: medians over rounds for each checkout, the ratio of the last to the first, bit-equality, and
    the cross-checkout differences against the run-to-run spread of one checkout."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        per_tree = {t: [r for r in rows if r["variant"] == variant and r["tree"] == t] for t in trees}
        entry = {}
        for t, runs in per_tree.items():
            ok = [r for r in runs if r["tokens_per_s"]]
            entry[t] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok) if ok else None,
                        "peak_gib": max((r["peak_gib"] for r in ok), default=None), "runs": len(runs)}
        first, last = entry[trees[0]], entry[trees[-1]]
        if first["tokens_per_s"] and last["tokens_per_s"]:
            entry["speed_ratio"] = round(last["tokens_per_s"] / first["tokens_per_s"], 4)
        traces = {(tuple(r["losses"]), tuple(r["grad_norms"])) for runs in per_tree.values() for r in runs}
        entry["losses_and_grad_norms_identical"] = len(traces) == 1 and all(r["losses"] for r in rows
                                                                             if r["variant"] == variant)
        entry["spread"] = spread(per_tree)
        out[variant] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                        help="a checkout to run (give two or more; the first is the reference of the ratios)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--skip", type=int, default=4, help="first iteration counted in the medians")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--run-timeout", type=int, default=300)
    parser.add_argument("--deterministic", action="store_true",
                        help="every rank under torch.use_deterministic_algorithms (a sitecustomize on PYTHONPATH)")
    parser.add_argument("--smoke", action="store_true", help="tiny model (CPU): checks the harness, not speed")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.smoke:
        args.iters, args.skip, args.global_batch = 3, 1, 2
    trees = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "scripts" / "pretrain_llama.py").is_file():
            parser.error(f"--tree {spec}: expected NAME=PATH of an agoq checkout (PATH/scripts/pretrain_llama.py)")
        trees[name] = Path(path).resolve()
    import torch

    from agoq.testing.procs import source_commit

    result = {"bench": "commits", "trees": {n: str(p) for n, p in trees.items()}, "device":
              torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "agoq_commit": source_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "iters": args.iters, "skip": args.skip, "micro_batch": args.micro_batch,
              "global_batch": args.global_batch, "shape": "tiny" if args.smoke else "1b",
              "deterministic": args.deterministic, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    port = 29600
    with tempfile.TemporaryDirectory() as tmp:
        if args.deterministic:
            os.environ.update(deterministic_site(Path(tmp) / "site"))
        for rnd in range(args.rounds):
            for variant in args.variants:
                for name, tree in trees.items():
                    port += 1
                    run = run_one(tree, variant, args, Path(tmp) / f"{name}_{variant}.jsonl", port)
                    result["rows"].append({"round": rnd, "variant": variant, "tree": name, **run})
                    print(f"round {rnd} {variant} {name}: rc {run['returncode']} {run['tokens_per_s']} tok/s "
                          f"peak {run['peak_gib']} GiB losses {run['losses'][:3]}", flush=True)
                    result["summary"] = summarise(result["rows"], list(trees))
                    args.out.write_text(json.dumps(result, indent=1))  # after every run: a killed run keeps it
    print(json.dumps(result["summary"], indent=1))
    failed = [r for r in result["rows"] if r["returncode"] != 0]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
