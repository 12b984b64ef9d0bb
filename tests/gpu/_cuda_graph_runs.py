"""Eager vs Megatron's CUDA graphs through the real trainer, for tests/gpu/test_cuda_graphs_gpu.py (one GPU) and
tests/e2e/test_cuda_graphs_multigpu.py (PP=2 on two GPUs): issue 24 item 1's validation.

Every run is scripts/pretrain_llama.py through agoq/testing/unvalidated_cuda_graphs.py (the script with the refusal
of not-yet-validated graph features lifted, nothing else changed), on the default dataset, with ``--log-json``;
the pair of a case differs only by ``--cuda-graph-impl local``. Iteration 1 runs eagerly in both (Megatron records,
then warms up and captures every layer at the end of its forward-backward); iterations 2.. replay the graphs. The
comparison is per iteration: loss and gradient norm, bit for bit, the first iteration that differs, the largest
differences, the graph runners the trainer reports captured, and the median step time of each mode (a tiny model:
the host's share, not a speed claim).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agoq.testing.procs import PRETRAIN_SCRIPT, REPO_ROOT, child_env, torchrun_command

DRIVER = REPO_ROOT / "agoq" / "testing" / "unvalidated_cuda_graphs.py"
GRAPHS = ["--cuda-graph-impl", "local"]
# benchmarks/bench_megatron_lm.py's "tiny" (bf16, SDPA): two trainers give bit-identical losses for 20 iterations
# on an H100 at this shape (tests/gpu/test_megatron_lm_gpu.py), so the kernels are deterministic here; every GEMM
# dim and the tokens per micro-batch are multiples of 16 (FP8)
TINY = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "704", "--seq-length", "256", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters",
        "2", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234", "--split", "969,30,1",
        "--log-interval", "1"]
# every feature of agoq.megatron.graphs.FEATURES that layers use, each in at least one case (the default policy
# quantizes saved activations; FP8 keeps layers 0 and 3 in bf16, the fused Smooth-SwiGLU paths need FP8 delayed)
CASES: dict[str, list[str]] = {
    "baseline": ["--agoq-disable"],
    "agoq_default": [],
    "fp8_delayed": ["--agoq-fp8", "delayed"],
    "fp8_delayed_smooth_per_token": ["--agoq-fp8", "delayed", "--agoq-smooth-swiglu", "per-token"],
    "fp8_delayed_smooth_per_channel": ["--agoq-fp8", "delayed", "--agoq-smooth-swiglu", "per-channel"],
    "fp8_current": ["--agoq-fp8", "current"],
    "fp8_rowwise": ["--agoq-fp8", "rowwise"],
    "smooth_per_token_bf16": ["--agoq-smooth-swiglu", "per-token"],
    "smooth_per_channel_bf16": ["--agoq-smooth-swiglu", "per-channel"],
}
# which FEATURES a passing case validates (agoq.megatron.graphs.VALIDATED: add a feature when all its cases pass)
VALIDATES = {"agoq_default": ["activations"], "fp8_delayed": ["fp8_delayed"], "fp8_current": ["fp8_current"],
             "fp8_rowwise": ["fp8_rowwise"], "fp8_delayed_smooth_per_token": ["smooth_per_token"],
             "smooth_per_token_bf16": ["smooth_per_token"], "fp8_delayed_smooth_per_channel": ["smooth_per_channel"],
             "smooth_per_channel_bf16": ["smooth_per_channel"]}


def default_data(env: dict) -> dict:
    """The default dataset's .bin/.idx prefix and tokenizer, built once (scripts/prepare_data.py, cached)."""
    from tests.megatron._bench_scripts import load_bench_script

    return load_bench_script("bench_megatron_lm").default_data(env)


def run(name: str, nproc: int, args: list[str], workdir: Path, env: dict, timeout_s: float,
        script: Path = DRIVER) -> dict:
    """One torchrun of ``script`` (the driver, or scripts/pretrain_llama.py itself); its log records."""
    tag = "".join(c if c.isalnum() else "_" for c in name)
    log, cache = workdir / f"{tag}.jsonl", workdir / f"{tag}_cache"
    log.unlink(missing_ok=True)
    cmd = torchrun_command(nproc, script, [*args, "--data-cache-dir", str(cache), "--log-json", str(log)])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = -9, f"timed out after {timeout_s} s\n" + str(exc.stdout or "")[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    iters = [r for r in records if "lm_loss" in r]
    graphs = next((r["cuda_graphs"] for r in records if "cuda_graphs" in r), None)
    row = {"name": name, "returncode": rc, "seconds": round(time.perf_counter() - start, 1),
           "losses": [r["lm_loss"] for r in iters], "grad_norms": [r["grad_norm"] for r in iters],
           "step_ms": [1e3 * r["step_seconds"] for r in iters], "cuda_graphs": graphs,
           "command": " ".join(cmd[1:])}
    if rc != 0:
        row["output_tail"] = output[-6000:]
    return row


def compare(eager: dict, graphs: dict) -> dict:
    """Loss and gradient-norm comparison of two runs, iteration by iteration (the shorter length)."""
    n = min(len(eager["losses"]), len(graphs["losses"]))
    pairs = list(zip(eager["losses"][:n], graphs["losses"][:n], strict=True)) + \
        list(zip(eager["grad_norms"][:n], graphs["grad_norms"][:n], strict=True))
    first = next((i % n + 1 for i, (a, b) in enumerate(pairs) if a != b), None) if n else None
    loss_diff = [abs(a - b) for a, b in pairs[:n]]
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in pairs[:n]]
    steady = lambda r: statistics.median(r["step_ms"][2:]) if len(r["step_ms"]) > 2 else None  # noqa: E731
    return {"iterations": n, "bit_identical": n > 0 and first is None, "first_differing_iteration": first,
            "max_abs_loss_diff": max(loss_diff) if loss_diff else None,
            "max_rel_loss_diff": max(rel) if rel else None,
            "eager_step_ms_median": steady(eager), "graphs_step_ms_median": steady(graphs)}


def run_cases(cases: dict[str, list[str]], nproc: int, common: list[str], workdir: Path, *, parallel: int,
              timeout_s: float, extra: dict[str, tuple[list[str], Path]] | None = None) -> dict:
    """Every case eagerly and with graphs (plus ``extra`` single runs: name -> (flags, script)), ``parallel`` at a
    time; {case: {"eager", "graphs", "comparison"}, extra name: row, "device": ...}."""
    import torch

    env = child_env(AGOQ_CACHE=str(workdir / "agoq_cache"), OMP_NUM_THREADS="2")
    data = default_data(env)
    base = [*common, "--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"]]
    jobs = [(f"{case}/{mode}", base + flags + (GRAPHS if mode == "graphs" else []), DRIVER)
            for case, flags in cases.items() for mode in ("eager", "graphs")]
    jobs += [(name, base + flags, script) for name, (flags, script) in (extra or {}).items()]
    with ThreadPoolExecutor(parallel) as pool:
        rows = list(pool.map(lambda j: run(j[0], nproc, j[1], workdir, env, timeout_s, j[2]), jobs))
    by_name = {r["name"]: r for r in rows}
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "data": data}
    for case in cases:
        eager, graphs = by_name[f"{case}/eager"], by_name[f"{case}/graphs"]
        out[case] = {"eager": eager, "graphs": graphs, "comparison": compare(eager, graphs)}
    for name in extra or {}:
        out[name] = by_name[name]
    return out


def summary_lines(results: dict) -> list[str]:
    lines = [f"device {results['device']} | torch {results['torch']}"]
    for case, got in results.items():
        if isinstance(got, dict) and "comparison" in got:
            c, g = got["comparison"], got["graphs"]
            lines.append(f"{case:32s} rc {got['eager']['returncode']}/{g['returncode']} | graphs "
                         f"{g['cuda_graphs']} | bit-identical {c['bit_identical']} (first diff "
                         f"{c['first_differing_iteration']}, max rel {c['max_rel_loss_diff']}) | step ms eager "
                         f"{c['eager_step_ms_median']} graphs {c['graphs_step_ms_median']}")
    return lines


REPORT_DIR_ENV = "AGOQ_CUDA_GRAPHS_REPORT_DIR"  # the GPU session's output folder: a copy of each report goes there


def write_report(results: dict, path: Path) -> list[Path]:
    """The report at ``path``, and a copy in $AGOQ_CUDA_GRAPHS_REPORT_DIR when set; the paths written."""
    text = json.dumps(results, indent=1) + "\n"
    paths = [path] + ([Path(os.environ[REPORT_DIR_ENV]) / path.name] if os.environ.get(REPORT_DIR_ENV) else [])
    for target in paths:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return paths


__all__ = ["CASES", "DRIVER", "GRAPHS", "PRETRAIN_SCRIPT", "TINY", "VALIDATES", "compare", "run", "run_cases",
           "summary_lines", "write_report"]
