"""Benchmark whole training steps of scripts/pretrain_llama.py: tokens/s and peak GPU memory per variant.

Every variant runs the real script (torchrun, one process per GPU) in this one invocation, so the
baseline and the variants share the device, the versions and the data. The script's ``--log-json``
records are summarised as: median tokens/s and step time over the iterations after ``--warmup``,
the peak of ``torch.cuda.max_memory_allocated`` (the logging rank, i.e. the last pipeline stage) and
the first/last loss, and the planner's predicted peak of the same stage (``agoq.plan.peak``, written by
the script at start-up: ``predicted_peak_gib``, ``predicted_peak_error``; docs/benchmarks/planner.md).

    python benchmarks/bench_pretrain.py --suite attention --out benchmarks/results/pretrain_attention.json

The suites (``--suite NAME``) are defined in benchmarks/pretrain_suites.py (its docstring lists them; SUITES
names them all) and benchmarks/pretrain_suites_scale.py (data / pipeline parallel, issue 23's capacity and equal
memory). ``--smoke`` runs a tiny CPU version of the suite (for CI-style checks). ``--list`` prints every variant's
command and runs nothing. For the equal-memory suites the report's ``equal_memory`` table takes, per memory budget,
the fastest run of each side whose measured peak fits, with their tokens/s ratio and MFUs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite modules beside this script (not a package)

# the suites and their flags; ARCH_KEYS and fp8_scale_suite are re-exported for the tests that read them here
from pretrain_flags import ARCH_KEYS, LLAMA3_VOCAB, MODEL_DIR  # noqa: E402, F401
from pretrain_suites import SUITES, fp8_scale_suite  # noqa: E402, F401
from pretrain_suites_scale import CAPACITY_PLANS, EQUAL_MEMORY_BUDGETS_GIB  # noqa: E402

from agoq.testing.procs import PRETRAIN_SCRIPT, child_env, source_commit, torchrun_command  # noqa: E402

# Dense BF16 tensor-core peak per GPU, TFLOP/s (NVIDIA's H100 and H200 datasheets: 1,979 with 2:4 sparsity for
# the SXM parts, 1,513 for H100 PCIe), the denominator of MFU (model FLOPs of agoq.train.flops, no recompute).
DENSE_BF16_TFLOPS = {"H100 PCIe": 756.5, "H100": 989.4, "H200": 989.4}


def variant_command(variant: dict, log: Path) -> tuple[list[str], str]:
    """(argv, the shell line) of one variant: torchrun + scripts/pretrain_llama.py (or the variant's ``script``, a
    driver that runs it) + its flags + --log-json."""
    script = variant.get("script", PRETRAIN_SCRIPT)
    cmd = torchrun_command(variant["nproc"], script, variant["args"] + ["--log-json", str(log)])
    env = variant.get("env", {})
    return cmd, " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd[1:]])


# what torch prints when the caching allocator cannot serve a request (torch.OutOfMemoryError's message)
OUT_OF_MEMORY_MARKERS = ("torch.OutOfMemoryError", "CUDA out of memory", "OutOfMemoryError")


TIMEOUT_RETURNCODE = 124  # as timeout(1): the variant ran past --timeout and its process group was killed


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc's parent links), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and all its workers. torchrun starts each worker in a session of its own
    (torch.distributed.elastic's SubprocessHandler, start_new_session=True), so killing torchrun's process
    group alone leaves the workers running, holding their GPU memory and the output pipes (the 2026-11-26
    capacity_4gpu run hung that way). The tree is read before anything is killed: orphans lose their parent link."""
    for target in [pid, *_descendants(pid)]:
        for kill in (lambda t: os.killpg(t, signal.SIGKILL), lambda t: os.kill(t, signal.SIGKILL)):
            try:
                kill(target)
            except (ProcessLookupError, PermissionError):
                pass


def _run_bounded(cmd: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    """Run torchrun in its own process group; past ``timeout`` kill it and every worker (see _kill_tree) and
    return TIMEOUT_RETURNCODE with what was printed, so the suite goes on. Output goes to files, not pipes, so
    a surviving grandchild can never block the read."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=REPO_ROOT,
                                start_new_session=True)
        note = ""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            note = f"\nbench: killed after --timeout {timeout} s"
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode if not note else TIMEOUT_RETURNCODE,
                                           out.read(), err.read() + note)


def _error_lines(output: str, limit: int = 20) -> list[str]:
    """The distinct lines that name an error (``...Error: ...`` / ``error:``), first ``limit``."""
    lines = [line.strip() for line in output.splitlines() if re.search(r"(Error|error):", line)]
    return list(dict.fromkeys(lines))[:limit]


def run_variant(variant: dict, workdir: Path, timeout: float) -> dict:
    log = workdir / ("".join(c if c.isalnum() else "_" for c in variant["name"]) + ".jsonl")
    cmd, line = variant_command(variant, log)
    env = variant.get("env", {})
    proc = _run_bounded(cmd, timeout, child_env(**env))
    result = {"name": variant["name"], "command": line, "returncode": proc.returncode,
              **{k: variant[k] for k in ("side", "expect") if variant.get(k)}}
    records = [json.loads(r) for r in log.read_text().splitlines()] if log.exists() else []
    predicted = [r["predicted_memory"] for r in records if "predicted_memory" in r]
    if predicted:
        result["predicted_memory"] = predicted[-1]  # agoq.plan.peak, per stage (the script's start-up report)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        result["out_of_memory"] = any(m in output for m in OUT_OF_MEMORY_MARKERS)
        result["error_lines"] = _error_lines(output)  # the workers' errors (torchrun's own report comes last)
        result["error_tail"] = output[-4000:]
        return result
    breakdowns = [r["memory_breakdown"] for r in records if "memory_breakdown" in r]
    if breakdowns:
        result["memory_breakdown_last"] = breakdowns[-1]  # weights / grads / optimizer GiB + peak (logging rank)
    stage_peaks = _stage_peaks(proc.stdout)
    if stage_peaks:
        result["stage_peaks_gib"] = stage_peaks  # every pipeline stage's, from the last measured-memory line
    records = [r for r in records if "lm_loss" in r]  # training iterations (validation records have no lm_loss)
    result["records"] = records
    return result


_STAGE_PEAK = re.compile(r"stage (\d+): mem alloc [\d.]+ GiB \| peak ([\d.]+) GiB")


def _stage_peaks(stdout: str) -> list[float]:
    """Peak GiB per pipeline stage from the script's last "measured memory after iteration N" line."""
    lines = [line for line in stdout.splitlines() if line.startswith("measured memory after iteration")]
    if not lines:
        return []
    return [float(peak) for _, peak in sorted((int(s), p) for s, p in _STAGE_PEAK.findall(lines[-1]))]


def summarise(result: dict, warmup: int, device: str | None = None) -> dict:
    if result["returncode"] != 0:
        out = {"name": result["name"], "failed": True, "out_of_memory": result.get("out_of_memory", False),
               "timed_out": result["returncode"] == TIMEOUT_RETURNCODE,
               **{k: result[k] for k in ("side", "expect") if k in result}}
        if out["out_of_memory"] and result.get("expect") == "oom":
            out["outcome"] = "out of memory (expected)"
        if "predicted_memory" in result:
            out["predicted_stage_peaks_gib"] = result["predicted_memory"]["peak_gib"]
        return out
    steady = [r for r in result["records"] if r["iteration"] > warmup] or result["records"]
    summary = {
        "name": result["name"],
        "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in steady),
        "step_ms_median": 1e3 * statistics.median(r["step_seconds"] for r in steady),
        "first_loss": result["records"][0]["lm_loss"],
        "last_loss": result["records"][-1]["lm_loss"],
    }
    if "peak_gib" in result["records"][-1]:
        summary["peak_gib"] = max(r["peak_gib"] for r in result["records"])
    if "peak_gib" in summary and "predicted_memory" in result:
        # the measured peak is the logging rank's (the last pipeline stage): compare with that stage
        summary["predicted_peak_gib"] = result["predicted_memory"]["peak_gib"][-1]
        summary["predicted_peak_error"] = summary["predicted_peak_gib"] / summary["peak_gib"] - 1
    if result.get("stage_peaks_gib"):
        summary["stage_peaks_gib"] = result["stage_peaks_gib"]
        summary["losses"] = [r["lm_loss"] for r in result["records"]]
        if "predicted_memory" in result:
            summary["predicted_stage_peaks_gib"] = result["predicted_memory"]["peak_gib"]
    # reserved_gib: the allocator's footprint at the last step; under CUDA graphs the memory to compare (a replay
    # allocates nothing, so peak_gib misses what the graph pool holds: docs/benchmarks/activations.md)
    for key in ("weights_gib", "grads_gib", "optimizer_gib", "reserved_gib"):
        if key in result.get("memory_breakdown_last", {}):
            summary[key] = result["memory_breakdown_last"][key]
    summary.update(_mfu(steady, device))
    summary.update(host_summary(steady))
    for key in ("side", "expect"):
        if key in result:
            summary[key] = result[key]
    if result.get("expect") == "oom":
        summary["outcome"] = "trained (expected out of memory)"
    return summary


BACKWARD_THREAD = "pt_autograd_"  # torch's autograd thread for device N is pt_autograd_N (backward's Python nodes)


def host_summary(steady: list[dict]) -> dict:
    """Medians over the steady iterations of where the host's time went (trainer's --log-json, hoststats): time until
    the schedule returned (``host_enqueue_ms_median``), the training loop's and the backward thread's CPU time and
    the main thread's wait for a CPU, and Python's collections per step; keys whose readings are missing are left
    out."""
    out = {}
    enqueue = [r["host_enqueue_seconds"] for r in steady if r.get("host_enqueue_seconds") is not None]
    if enqueue:
        out["host_enqueue_ms_median"] = 1e3 * statistics.median(enqueue)
    rows = [r["host_threads"] for r in steady if r.get("host_threads")]
    picks = (("main", lambda row: row["main"]), ("backward", lambda row: row["name"].startswith(BACKWARD_THREAD)))
    for label, pick in picks:
        picked = [next((row for row in threads if pick(row)), None) for threads in rows]
        picked = [row for row in picked if row is not None]
        if picked:
            out[f"{label}_thread_cpu_ms_median"] = 1e3 * statistics.median(row["cpu_seconds"] for row in picked)
            out[f"{label}_thread_wait_ms_median"] = 1e3 * statistics.median(row["wait_seconds"] for row in picked)
    collections = [r["gc_collections"] for r in steady if r.get("gc_collections") is not None]
    if collections:
        out["gc_collections_median"] = statistics.median(collections)
    return out


def peak_tflops(device: str | None) -> float | None:
    """DENSE_BF16_TFLOPS of the device name (the most specific key it contains), None if unknown."""
    keys = [k for k in DENSE_BF16_TFLOPS if device and k in device]
    return DENSE_BF16_TFLOPS[max(keys, key=len)] if keys else None


def _mfu(steady: list[dict], device: str | None) -> dict:
    """Median model TFLOP/s per GPU (agoq.train.flops: no recompute counted) and MFU against the device's dense
    BF16 peak."""
    if not steady or "tflops_per_gpu" not in steady[0]:
        return {}
    tflops = statistics.median(r["tflops_per_gpu"] for r in steady)
    peak = peak_tflops(device)
    return {"tflops_per_gpu_median": tflops, **({"mfu": tflops / peak} if peak else {})}


def measured_peak_gib(summary: dict) -> float | None:
    """The largest measured per-GPU peak of a run (every stage where the script reported them)."""
    if summary.get("stage_peaks_gib"):
        return max(summary["stage_peaks_gib"])
    return summary.get("peak_gib")


def _fastest(summaries: list[dict], side: str, budget_gib: float) -> dict | None:
    fits = [s for s in summaries if s.get("side") == side and not s.get("failed")
            and (measured_peak_gib(s) or float("inf")) <= budget_gib]
    return max(fits, key=lambda s: s["tokens_per_second_median"]) if fits else None


def equal_memory_table(summaries: list[dict], budgets_gib) -> list[dict]:
    """Per budget: the fastest baseline and agoq run whose measured peak fits it, their tokens/s ratio and MFUs."""
    rows = []
    for budget in budgets_gib:
        base, agoq = _fastest(summaries, "baseline", budget), _fastest(summaries, "agoq", budget)
        row = {"budget_gib": budget, "baseline": base and base["name"], "agoq": agoq and agoq["name"]}
        for tag, run in (("baseline", base), ("agoq", agoq)):
            if run:
                row[f"{tag}_tokens_per_second"] = run["tokens_per_second_median"]
                row[f"{tag}_peak_gib"] = measured_peak_gib(run)
                row[f"{tag}_mfu"] = run.get("mfu")
        if base and agoq:
            row["speedup"] = agoq["tokens_per_second_median"] / base["tokens_per_second_median"]
        rows.append(row)
    return rows


def planner_capacity(model: str, budget: str, seq: int = 4096) -> dict:
    """``python -m agoq.plan --capacity`` for configs/model/<model>.yaml with LLaMA-3's vocabulary at ``budget``."""
    from agoq.plan.__main__ import main as plan_main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "capacity.json"
        argv = ["--capacity", "--config", str(MODEL_DIR / f"{model}.yaml"), "--vocab-size", str(LLAMA3_VOCAB),
                "--seq-length", str(seq), "--memory-budget", budget, "--max-gpus", "16", "--out", str(out)]
        if plan_main(argv) != 0:
            return {"error": f"python -m agoq.plan {' '.join(argv)} failed"}
        return {"command": "python -m agoq.plan " + " ".join(argv[:-2]), **json.loads(out.read_text())}


def _device_budget() -> str:
    """The planner's budget for this machine: GPU 0's total memory, 80GiB without a GPU."""
    import torch

    if torch.cuda.is_available():
        return str(torch.cuda.get_device_properties(0).total_memory)
    return "80GiB"


def expected_failure(summary: dict) -> bool:
    return bool(summary.get("failed") and summary.get("out_of_memory") and summary.get("expect") == "oom")


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
            "agoq_commit": source_commit()}
    try:
        import triton

        from agoq.megatron.compat import installed_mcore_version  # pip's release, not megatron's git-tagged one

        info.update(megatron_core=installed_mcore_version(), triton=triton.__version__)
    except (ImportError, RuntimeError) as exc:  # RuntimeError: megatron-core not installed
        info["import_error"] = str(exc)
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["num_gpus"] = torch.cuda.device_count()
    else:
        info["device"] = "cpu"
    return info


def select_variants(suite: str, smoke: bool, only: list[str] | None, skip: list[str] | None = None) -> list[dict]:
    variants = SUITES[suite](smoke)
    if skip:
        unmatched = [t for t in skip if not any(t in v["name"] for v in variants)]
        if unmatched:  # as --only: a misspelt filter must not pass unnoticed
            raise SystemExit(f"--skip {unmatched}: no variant of suite {suite!r} matches")
        variants = [v for v in variants if not any(t in v["name"] for t in skip)]
        if not variants:  # nothing to run would write no JSON and exit 0
            raise SystemExit(f"--skip {skip}: leaves no variant of suite {suite!r} to run")
    if only:
        unmatched = [t for t in only if not any(t in v["name"] for v in variants)]
        if unmatched:  # a misspelt filter beside a good one would otherwise drop its variants silently
            names = "\n  ".join(v["name"] for v in variants)
            raise SystemExit(f"--only {unmatched}: no variant of suite {suite!r} matches; its variants:\n  {names}")
        variants = [v for v in variants if any(t in v["name"] for t in only)]
    return variants


ROUND_SUFFIX = " #round "


def round_robin(variants: list[dict], rounds: int) -> list[dict]:
    """The variants ``rounds`` times in A B A B order; with more than one round each copy's name ends in
    ``" #round k"`` (k from 1), so that every run keeps its own record and summary."""
    if rounds == 1:
        return variants
    return [{**v, "name": f"{v['name']}{ROUND_SUFFIX}{k}"} for k in range(1, rounds + 1) for v in variants]


def rounds_summary(summaries: list[dict]) -> list[dict]:
    """Per variant (its name without the round suffix): the tokens/s medians of its rounds in run order, their
    median, the spread (max / min - 1) that says how far one round alone could be trusted, and how many of its
    rounds failed (a variant whose every round failed is listed with no median)."""
    by_name: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    for s in summaries:
        base = s["name"].split(ROUND_SUFFIX)[0]
        by_name.setdefault(base, [])
        failed[base] = failed.get(base, 0) + bool(s.get("failed"))
        if not s.get("failed"):
            by_name[base].append(s["tokens_per_second_median"])
    return [{"name": name, "tokens_per_second_rounds": values,
             "tokens_per_second_median_of_rounds": statistics.median(values) if values else None,
             "spread": max(values) / min(values) - 1 if values else None, "failed_rounds": failed[name]}
            for name, values in by_name.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="attention")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the medians")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU version of the suite")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="run only the variants whose name contains one of these strings (each must match one)")
    parser.add_argument("--list", action="store_true", help="print every variant's command; run nothing")
    parser.add_argument("--skip", nargs="+", metavar="TEXT",
                        help="leave out the variants whose name contains one of these strings (each must match one)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the selected variants this many times, round-robin (A B A B ...), so that slow "
                             "drift of a shared host lands on every variant alike; the report adds a "
                             "per-variant summary over the rounds (``rounds``)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if args.rounds > 1 and args.suite in EQUAL_MEMORY_BUDGETS_GIB:  # its table takes single runs, not rounds
        parser.error(f"--rounds {args.rounds}: the {args.suite} suite's equal-memory table compares single runs; "
                     "run it without --rounds")
    if args.list:
        for variant in round_robin(select_variants(args.suite, args.smoke, args.only, args.skip), args.rounds):
            print(f"{variant['name']}\n  {variant_command(variant, Path(args.out + '.' + 'log.jsonl'))[1]}")
        return 0
    report = {
        "suite": args.suite, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "environment": environment(),
        "warmup_iterations_excluded": args.warmup, "variants": [], "summary": [],
    }
    if args.suite in CAPACITY_PLANS:
        model, gpus = CAPACITY_PLANS[args.suite]
        report["planner_capacity"] = {"gpus_in_this_suite": gpus, **planner_capacity(model, _device_budget())}
    device = report["environment"].get("device")
    with tempfile.TemporaryDirectory() as tmp:
        for variant in round_robin(select_variants(args.suite, args.smoke, args.only, args.skip), args.rounds):
            print(f"bench: {dt.datetime.now(dt.UTC):%H:%M:%S} running {variant['name']}", file=sys.stderr, flush=True)
            result = run_variant(variant, Path(tmp), args.timeout)
            report["variants"].append(result)
            report["summary"].append(summarise(result, args.warmup, device))
            if args.rounds > 1:
                report["rounds"] = rounds_summary(report["summary"])
            if args.suite in EQUAL_MEMORY_BUDGETS_GIB:
                report["equal_memory"] = equal_memory_table(report["summary"], EQUAL_MEMORY_BUDGETS_GIB[args.suite])
            print(json.dumps(report["summary"][-1]), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            # after each variant: a cut run keeps its results
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    failed = [s["name"] for s in report["summary"] if s.get("failed") and not expected_failure(s)]
    if failed:
        print(f"failed variants: {failed} (see error_tail in {args.out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
