"""agoq through Megatron-LM's trainer (scripts/pretrain_gpt_agoq.py, megatron.training.pretrain) vs agoq through
its own trainer (scripts/pretrain_llama.py): same model, seed and data, one GPU. Per variant both trainers run;
the result holds every iteration's exact loss, the CUDA peak (torch.cuda.max_memory_allocated at the end)
and, per pair, whether the losses are bit-identical (else the largest difference and the first iteration
that differs). The Megatron baseline through megatron.training is the ``baseline`` variant's first row.

    python3 benchmarks/bench_megatron_lm.py --out benchmarks/results/megatron_lm.json

Data: the default dataset (scripts/prepare_data.py: Python's standard-library text + its 4096-piece
SentencePiece tokenizer, cached in $AGOQ_CACHE); both trainers read it through --data-path, Megatron's
with --tokenizer-type GPTSentencePieceTokenizer. Runs go concurrently (--parallel), one process each;
peaks are per process (torch's allocator), so concurrency does not change them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEGATRON_SCRIPT = REPO / "scripts" / "pretrain_gpt_agoq.py"
AGOQ_SCRIPT = REPO / "scripts" / "pretrain_llama.py"

SIZES = {  # name -> (layers, hidden, heads, query groups, ffn, seq, micro-batch, global batch)
    "small": (8, 512, 8, 4, 1408, 512, 4, 16),
    "tiny": (4, 256, 4, 2, 704, 256, 2, 8),
}

# Megatron-LM flags that give megatron.training the model, schedule and data scripts/pretrain_llama.py builds
# (its defaults: LLaMA layers, no fusions, cosine decay, Adam beta2 0.95, bf16); tests/megatron/
# test_megatron_lm.py checks the TransformerConfig they give equals pretrain_llama.py's.
MEGATRON_EQUIVALENCE_FLAGS = [
    "--transformer-impl", "local", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--attention-softmax-in-fp32", "--no-create-attention-mask-in-dataloader", "--bf16",
    "--lr-decay-style", "cosine", "--adam-beta2", "0.95", "--eval-interval", "1000", "--eval-iters", "0",
    "--log-interval", "1",
]

# pretrain_llama.py's flags for what MEGATRON_EQUIVALENCE_FLAGS turn off there: Megatron's unfused RoPE
# (--no-rope-fusion; the trainer's default runs agoq's fused RoPE on CUDA, the same values)
TRAINER_EQUIVALENCE_FLAGS = ["--rope-fusion", "off"]

VARIANTS = {  # name -> agoq flags given to both trainers
    "baseline": ["--agoq-disable"],
    "agoq_default": [],
    "agoq_full": ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256"],
    "agoq_full_distopt": ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256", "--use-distributed-optimizer"],
}


def common_flags(size: str, iters: int) -> list[str]:
    layers, hidden, heads, groups, ffn, seq, mbs, gbs = SIZES[size]
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--num-query-groups", str(groups), "--ffn-hidden-size", str(ffn), "--seq-length", str(seq),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", str(iters),
            "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "5", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--seed", "1234", "--split", "969,30,1"]


def megatron_command(size: str, iters: int, agoq_flags: list[str], data: dict, log: Path, port: int) -> list[str]:
    seq = SIZES[size][5]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), str(MEGATRON_SCRIPT),
            *common_flags(size, iters), "--group-query-attention", "--max-position-embeddings", str(seq),
            *MEGATRON_EQUIVALENCE_FLAGS, "--data-path", data["prefix"], "--tokenizer-type",
            "GPTSentencePieceTokenizer", "--tokenizer-model", data["tokenizer"], "--agoq-log-json", str(log),
            *agoq_flags]


def agoq_command(size: str, iters: int, agoq_flags: list[str], data: dict, log: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), str(AGOQ_SCRIPT),
            *common_flags(size, iters), "--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"],
            "--log-json", str(log), *TRAINER_EQUIVALENCE_FLAGS, *agoq_flags]


def default_data(env: dict) -> dict:
    """Build (once, cached) the default dataset; its .bin/.idx prefix and tokenizer."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py")], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    prefix = fields.get("prefix") or fields.get("data_path")
    tokenizer = fields.get("tokenizer_model") or fields.get("tokenizer")
    if not prefix or not tokenizer:
        raise RuntimeError(f"prepare_data.py printed no prefix / tokenizer:\n{out}")
    return {"prefix": prefix.strip(), "tokenizer": tokenizer.strip()}


def read_losses(log: Path) -> tuple[list[float], int | None]:
    """(losses by iteration, final CUDA peak bytes) of either trainer's JSON log."""
    losses, peak = {}, None
    if not log.exists():
        return [], None
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if "lm_loss" in rec and "iteration" in rec:
            losses[rec["iteration"]] = rec["lm_loss"]
            if "peak_gib" in rec:  # pretrain_llama.py: GiB of torch.cuda.max_memory_allocated
                peak = round(rec["peak_gib"] * 2**30)
        if rec.get("final"):
            peak = rec["peak_bytes"]
    return [losses[i] for i in sorted(losses)], peak


def run_row(name: str, command: list[str], log: Path, env: dict, timeout_s: int) -> dict:
    log.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = -9, (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    losses, peak = read_losses(log)
    row = {"name": name, "returncode": rc, "seconds": round(time.perf_counter() - start, 1), "losses": losses,
           "peak_bytes": peak, "command": [c for c in command if c != sys.executable]}
    if rc != 0:
        row["output_tail"] = output[-6000:]
    return row


def compare(a: dict, b: dict) -> dict:
    """Loss and peak comparison of two rows (same length prefix)."""
    n = min(len(a["losses"]), len(b["losses"]))
    diffs = [abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n], strict=True)]
    first = next((i + 1 for i, d in enumerate(diffs) if d != 0.0), None)
    peak_diff = None if a["peak_bytes"] is None or b["peak_bytes"] is None else a["peak_bytes"] - b["peak_bytes"]
    return {"iterations_compared": n, "bit_identical": n > 0 and first is None, "first_differing_iteration": first,
            "max_abs_loss_diff": max(diffs) if diffs else None, "peak_diff_bytes": peak_diff,
            "peak_diff_fraction": None if peak_diff is None else peak_diff / b["peak_bytes"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    p.add_argument("--repeat", action="store_true", help="run pretrain_llama.py's agoq_default twice (noise floor)")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--timeout", type=int, default=420)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    data = default_data(env)
    log_dir = Path(args.log_dir or Path(args.out).parent)
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs, port = [], 29600
    for variant in args.variants:
        flags = VARIANTS[variant]
        for trainer, build in (("megatron_training", megatron_command), ("pretrain_llama", agoq_command)):
            log = log_dir / f"mlm_{variant}_{trainer}.jsonl"
            jobs.append((f"{variant}/{trainer}", build(args.size, args.iters, flags, data, log, port), log))
            port += 1
    if args.repeat:
        log = log_dir / "mlm_agoq_default_pretrain_llama_repeat.jsonl"
        jobs.append(("agoq_default/pretrain_llama_repeat", agoq_command(args.size, args.iters, [], data, log, port),
                     log))
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda j: run_row(j[0], j[1], j[2], env, args.timeout), jobs))
    by_name = {r["name"]: r for r in rows}
    comparisons = {}
    for variant in args.variants:
        comparisons[variant] = compare(by_name[f"{variant}/megatron_training"], by_name[f"{variant}/pretrain_llama"])
    if args.repeat:
        comparisons["agoq_default_repeat"] = compare(by_name["agoq_default/pretrain_llama_repeat"],
                                                     by_name["agoq_default/pretrain_llama"])
    import torch

    report = {"suite": "megatron_lm", "size": args.size, "shape": SIZES[args.size], "iters": args.iters,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "data": data, "rows": rows, "comparisons": comparisons}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, comp in comparisons.items():
        print(name, json.dumps(comp))
    for row in rows:
        print(row["name"], "rc", row["returncode"], "peak", row["peak_bytes"], "losses", row["losses"][:3], "...",
              row["losses"][-1:], f"{row['seconds']} s")
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
