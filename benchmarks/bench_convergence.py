"""Convergence runs (issue 9): a ~125M LLaMA on the Debian-docs corpus, Megatron baseline vs agoq presets.

One preset per invocation (each run is a few minutes on one H100), the training log streamed to
``<out>.log.jsonl`` as it goes (so a run cut short still leaves its curve), a summary JSON at the end:

    python scripts/build_corpus.py --out data/debdocs.jsonl
    python scripts/prepare_data.py --input data/debdocs.jsonl --vocab-size 32000 \
        --tokenizer-sample-sentences 1000000 --output-prefix data/debdocs --workers 8
    python benchmarks/bench_convergence.py --preset baseline --data-prefix data/debdocs --out conv_baseline.json
    python benchmarks/bench_convergence.py --preset agoq-default --data-prefix data/debdocs --out conv_default.json
    python benchmarks/bench_convergence.py --preset aggressive --data-prefix data/debdocs --out conv_aggressive.json
    python benchmarks/plot_benchmarks.py convergence conv_*.json --out docs/benchmarks/convergence.png

Presets (all: same model, data order, batch, schedule, SDPA attention, one GPU):
  baseline      Megatron alone (--agoq-disable): bf16 params, fp32 grads, Megatron Adam (fp32 states)
  agoq-default  the default activation policy (configs/policy/agoq.yaml) + agoq AdamW (split24 master,
                FlashOptim companded 8-bit moments): the preset that cuts peak memory ~49 % (pretrain_memory.md)
  aggressive    4-bit activations everywhere (configs/policy/aggressive.yaml) + 8-bit gradients + agoq
                AdamW with FP8 moments (m E4M3, v E5M2)
``--smoke`` runs a tiny CPU version (tiny model, built-in corpus) to check the plumbing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_pretrain

from bench_pretrain import environment  # noqa: E402

from agoq.testing.procs import PRETRAIN_SCRIPT, child_env, torchrun_command  # noqa: E402

MODEL_CONFIG = REPO_ROOT / "configs" / "model" / "llama-125m.yaml"
GRADS = ["--agoq-grads", "int8_b256"]
PRESETS = {
    "baseline": ["--agoq-disable"],
    "agoq-default": ["--agoq-optimizer", "adamw", "--agoq-moments", "flash"],
    "aggressive": GRADS + ["--agoq-optimizer", "adamw", "--agoq-moments", "fp8",
                           "--agoq-policy", str(REPO_ROOT / "configs" / "policy" / "aggressive.yaml")],
}
# Batch and schedule: 64 x 1024 = 65,536 tokens per step (2 micro-batches of 32) (GPT-3 Small used 0.5M at 2048 with 6e-4; a
# smaller batch takes more steps per token, which these short runs need); cosine to 10 % after 100
# warm-up steps; AdamW betas (0.9, 0.95), weight decay 0.1, clip 1.0 from the model config.
SEQ_LENGTH, MICRO_BATCH, GLOBAL_BATCH = 1024, 32, 64
WARMUP_ITERS, LR, MIN_LR = 100, 6.0e-4, 6.0e-5
EVAL_INTERVAL, EVAL_ITERS = 250, 8
LOG_INTERVAL = 10
LAST_WINDOW = 20  # training-loss records averaged for the "final loss" (20 x LOG_INTERVAL steps)


def run_args(preset: str, data_prefix: str | None, iters: int, smoke: bool) -> list[str]:
    if smoke:
        model = ["--config", str(REPO_ROOT / "configs" / "model" / "tiny.yaml"), "--seq-length", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "4"]
    else:
        model = ["--config", str(MODEL_CONFIG), "--seq-length", str(SEQ_LENGTH),
                 "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH)]
    data = []
    if data_prefix:
        data = ["--data-path", data_prefix, "--tokenizer-model", f"{data_prefix}.tokenizer.model"]
    return model + data + [
        "--train-iters", str(iters), "--lr", str(LR), "--min-lr", str(MIN_LR),
        "--lr-warmup-iters", str(min(WARMUP_ITERS, max(1, iters // 10))), "--lr-decay-style", "cosine",
        "--log-interval", str(1 if smoke else LOG_INTERVAL), "--eval-interval", str(max(1, min(EVAL_INTERVAL, iters))),
        "--eval-iters", str(1 if smoke else EVAL_ITERS), "--save-interval", "0",
    ] + PRESETS[preset]  # fmt: skip


def summarise(records: list[dict]) -> dict:
    train = [r for r in records if "lm_loss" in r]
    valid = [r for r in records if "validation_lm_loss" in r]
    if not train:
        return {"completed_iterations": 0}
    tail = train[-LAST_WINDOW:]
    steady = train[len(train) // 10 :] or train
    out = {
        "completed_iterations": train[-1]["iteration"],
        "final_train_loss_mean": statistics.fmean(r["lm_loss"] for r in tail),
        "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in steady),
        "skipped_iterations": train[-1]["skipped_iterations"],
    }
    if valid:
        out["final_validation_loss"] = valid[-1]["validation_lm_loss"]
        out["final_validation_iteration"] = valid[-1]["iteration"]
    peaks = [r["peak_gib"] for r in train if "peak_gib" in r]
    if peaks:
        out["peak_gib"] = max(peaks)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--data-prefix", default=None, help="indexed dataset prefix (tokenizer at <prefix>.tokenizer.model)")
    parser.add_argument("--tokens", type=float, default=100e6, help="training tokens (rounded up to whole steps)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the plumbing (built-in corpus)")
    args = parser.parse_args(argv)
    if not args.smoke and not args.data_prefix:
        parser.error("--data-prefix is required (see the module docstring for building the corpus)")
    tokens_per_step = (4 * 64) if args.smoke else GLOBAL_BATCH * SEQ_LENGTH
    iters = max(1, -(-int(args.tokens) // tokens_per_step))
    log = args.out.with_suffix(".log.jsonl")
    log.unlink(missing_ok=True)
    cmd = torchrun_command(1, PRETRAIN_SCRIPT, run_args(args.preset, args.data_prefix, iters, args.smoke)
                           + ["--log-json", str(log)])  # fmt: skip
    print("running:", " ".join(cmd[1:]), flush=True)
    start = time.time()
    proc = subprocess.run(cmd, env=child_env(), cwd=REPO_ROOT, timeout=args.timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    result = {
        "preset": args.preset, "preset_flags": PRESETS[args.preset], "returncode": proc.returncode,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "wall_seconds": time.time() - start,
        "command": " ".join(cmd[1:]), "environment": environment(), "train_iters": iters,
        "tokens_per_step": tokens_per_step, "summary": summarise(records), "records": records,
    }  # fmt: skip
    if proc.returncode != 0:
        result["output_tail"] = proc.stdout[-4000:]
    args.out.write_text(json.dumps(result, indent=1))
    print(proc.stdout[-3000:])
    print(json.dumps({"preset": args.preset, "returncode": proc.returncode, **result["summary"]}, indent=1))
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
