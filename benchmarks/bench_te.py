"""agoq against Megatron + Transformer Engine as Megatron-LM users run it: one GPU, ~1B LLaMA body, seq 4096; and
on 2 or 4 GPUs of one host, the layouts of ``benchmarks/te_layouts.py`` (``--suite``: DP, DP x PP, the 8B shape at
equal memory, context parallelism).

Every row is one ``torchrun`` process through ``megatron.training`` on the same GPU, one after another, with the same
model, mock data, batch and schedule:

* ``te/...`` rows: Megatron-core with Transformer Engine built the way Megatron-LM 0.19 builds it
  (``benchmarks/megatron_gpt_upstream.py``: the model config container, Megatron's TE spec, fused attention, FP8
  recipes, the precision-aware optimizer, recompute, activation offloading) — nothing of agoq imported;
* ``agoq/...`` rows: agoq through its Megatron-LM door (``scripts/pretrain_gpt_agoq.py``) on Megatron's local spec;
* ``agoq_te/...`` rows: the same upstream driver through agoq's zero-edit door (``torchrun --module agoq.megatron_lm
  benchmarks/megatron_gpt_upstream.py ... --agoq-...``), as a Megatron-LM user runs their own ``pretrain_gpt.py``:
  Megatron's TE spec, with agoq's saved-activation scopes, 8-bit gradients and optimizer.

Per row: tokens/s and TFLOP/s/GPU (medians of Megatron's own per-iteration log from iteration ``--skip`` on), the
CUDA allocator's peak (allocated and reserved), and each iteration's loss. Megatron + TE runs without
gradient-accumulation fusion: its output layer's fused weight-gradient kernel is apex's, which the GPU machines lack.

A suite row (``--suite NAME``, benchmarks/te_layouts.py) is one of these rows at a TP / PP / CP / DP layout on
``nproc`` GPUs (``torchrun --nproc-per-node``). It adds every rank's peak (``rank_peaks``: each rank's pipeline stage,
data-parallel and context-parallel rank and its CUDA peaks; ``stage_peaks_bytes``: each stage's largest) read from
the driver's per-rank files, tokens/s per GPU, and the planner's prediction or its refusal (``planner``). The JSON's
``summary`` holds the suite's tables: ``equal_memory`` (each side's fastest row under per-GPU budgets, and the ratio),
``cp_losses`` (each CP=2 row against its CP=1 twin), ``planner_error`` per row. ``--summarize A.json B.json`` prints
the summary of rows from several runs (a suite split over calls).

    python benchmarks/bench_te.py --out benchmarks/results/te.json            # every row
    python benchmarks/bench_te.py --rows te/bf16 agoq/full --iters 10         # some rows
    python benchmarks/bench_te.py --shape 8b --global-batch 8 --micro-batch 1 --rows agoq_te/full_fp8  # LLaMA-3-8B
    python benchmarks/bench_te.py --suite dp_1b --nproc 2 --iters 20 --out te_dp2.json    # a suite's 2-GPU rows
    python benchmarks/bench_te.py --summarize te4_8b_a.json te4_8b_b.json                 # one summary of both
    python benchmarks/bench_te.py --rows te/fp8_delayed agoq_te/full_fp8 --iters 12 --profile 8 10   # GPU time by kind

``--profile A B`` runs Megatron-LM's own torch profiler (``--profile --use-pytorch-profiler``) over iterations A..B-1
of each one-GPU row and stores ``benchmarks/trace_summary.py``'s summary in the row (``profile``: GPU busy time,
kernel time per category, the top kernels); ``python benchmarks/trace_summary.py B.json.gz --against A.json.gz``
compares two kept traces (``--keep-traces DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import te_layouts  # noqa: E402  (benchmarks/, beside this file)

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "benchmarks" / "megatron_gpt_upstream.py"
DOOR = REPO / "scripts" / "pretrain_gpt_agoq.py"
ZERO_EDIT = "zero-edit"  # the upstream driver through agoq's door: python -m agoq.megatron_lm UPSTREAM ...

SHAPES = {  # name -> Megatron model flags
    "1b": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32", "--group-query-attention",
           "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--seq-length", "4096",
           "--max-position-embeddings", "4096"],
    # LLaMA-3-8B (configs/model/llama3-8b.yaml) with its 128,256-entry vocabulary, untied
    "8b": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
           "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--seq-length", "4096",
           "--max-position-embeddings", "4096"],
    # LLaMA-3.2-3B's body (benchmarks/pretrain_suites_scale.py SHAPE_3B) with LLaMA-3's vocabulary, untied
    "3b": ["--num-layers", "28", "--hidden-size", "3072", "--num-attention-heads", "24", "--group-query-attention",
           "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--seq-length", "4096",
           "--max-position-embeddings", "4096"],
    "tiny": ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "352", "--seq-length", "128",
             "--max-position-embeddings", "128"],
}
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
         "--rotary-base", "500000", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--bf16", "--no-gradient-accumulation-fusion"]
VOCAB = {"1b": 32000, "8b": 128256, "3b": 128256, "tiny": 32000}  # NullTokenizer's vocabulary per shape


def data_flags(shape: str) -> list[str]:
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB[shape]),
            "--split", "969,30,1"]


TE_FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
          "--fp8-amax-compute-algo", "max"]
PRECISION_AWARE_BF16 = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                        "--exp-avg-sq-dtype", "bf16"]
OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "qkv_linear", "core_attn",
           "attn_proj", "mlp_norm"]
# the door's local spec with Megatron-LM's LLaMA defaults that it does not take over yet
DOOR_LOCAL = ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-create-attention-mask-in-dataloader"]
AGOQ_FULL = ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256"]
AGOQ_FP8 = ["--agoq-fp8", "delayed"]

# name -> (driver, micro-batch, extra flags, extra environment)
ROWS: dict[str, tuple[Path | str, int, list[str], dict]] = {
    "te/bf16": (UPSTREAM, 2, [], {}),
    "te/fp8_delayed": (UPSTREAM, 2, TE_FP8, {}),
    "te/fp8_tensorwise": (UPSTREAM, 2, ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], {}),
    "te/fp8_delayed_mbs4": (UPSTREAM, 4, TE_FP8, {}),
    "te/fp8_delayed_mbs8": (UPSTREAM, 8, TE_FP8, {}),
    "te/fp8_precision_aware_bf16": (UPSTREAM, 2, TE_FP8 + PRECISION_AWARE_BF16, {}),
    "te/fp8_precision_aware_fp8": (UPSTREAM, 2, TE_FP8 + ["--use-distributed-optimizer",
                                                         "--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8",
                                                         "--exp-avg-sq-dtype", "bf16"], {}),
    "te/fp8_precision_aware_bf16_selective": (UPSTREAM, 2, TE_FP8 + PRECISION_AWARE_BF16 + [
        "--recompute-granularity", "selective"], {}),
    "te/fp8_precision_aware_bf16_full_recompute": (UPSTREAM, 2, TE_FP8 + PRECISION_AWARE_BF16 + [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], {}),
    "te/fp8_precision_aware_bf16_offload": (UPSTREAM, 2, TE_FP8 + PRECISION_AWARE_BF16 + OFFLOAD,
                                            {"NVTE_CPU_OFFLOAD_V1": "1"}),
    "local/bf16": (DOOR, 2, DOOR_LOCAL + ["--agoq-disable"], {}),
    "agoq/full": (DOOR, 2, DOOR_LOCAL + AGOQ_FULL, {}),
    "agoq/full_fp8": (DOOR, 2, DOOR_LOCAL + AGOQ_FULL + AGOQ_FP8, {}),
    # agoq composed with TE (agoq/megatron/te.py): TE's layers, agoq's saved-activation scopes, 8-bit gradients and
    # optimizer, through the door with Megatron-LM's default --transformer-impl transformer_engine
    "agoq_te/bf16_policy": (ZERO_EDIT, 2, ["--agoq-policy", "configs/policy/bf16.yaml"], {}),
    "agoq_te/full": (ZERO_EDIT, 2, AGOQ_FULL, {}),
    "agoq_te/full_fp8": (ZERO_EDIT, 2, AGOQ_FULL + TE_FP8, {}),
    "agoq_te/full_fp8_mbs4": (ZERO_EDIT, 4, AGOQ_FULL + TE_FP8, {}),
    "agoq_te/full_fp8_mbs8": (ZERO_EDIT, 8, AGOQ_FULL + TE_FP8, {}),
    "agoq_te/full_fp8_mbs16": (ZERO_EDIT, 16, AGOQ_FULL + TE_FP8, {}),
    "agoq_te/lean_fp8": (ZERO_EDIT, 2, AGOQ_FULL + TE_FP8 + ["--agoq-policy", "configs/policy/bf16.yaml"], {}),
    # where agoq + TE FP8 loses speed against TE FP8: each of agoq full's three parts alone on TE FP8
    "agoq_te/fp8_policy_only": (ZERO_EDIT, 2, TE_FP8, {}),
    "agoq_te/fp8_adamw_only": (ZERO_EDIT, 2, TE_FP8 + ["--agoq-policy", "configs/policy/bf16.yaml",
                                                       "--agoq-optimizer", "adamw"], {}),
    "agoq_te/fp8_int8_grads_only": (ZERO_EDIT, 2, TE_FP8 + ["--agoq-policy", "configs/policy/bf16.yaml",
                                                            "--agoq-grads", "int8_b256"], {}),
    # the FP8 learning-speed finding: which of agoq full's parts slows FP8's first iterations
    "agoq/fp8_bf16policy_megatron_adam": (DOOR, 2, DOOR_LOCAL + AGOQ_FP8 + ["--agoq-policy",
                                                                           "configs/policy/bf16.yaml"], {}),
    "agoq/fp8_default_policy_megatron_adam": (DOOR, 2, DOOR_LOCAL + AGOQ_FP8, {}),
    "agoq/fp8_bf16policy_agoq_adamw": (DOOR, 2, DOOR_LOCAL + AGOQ_FP8 + ["--agoq-policy", "configs/policy/bf16.yaml",
                                                                       "--agoq-optimizer", "adamw"], {}),
    "agoq/fp8_bf16policy_int8_grads": (DOOR, 2, DOOR_LOCAL + AGOQ_FP8 + ["--agoq-policy", "configs/policy/bf16.yaml",
                                                                       "--agoq-grads", "int8_b256"], {}),
}

_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
_TFLOPS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")


def schedule(micro_batch: int, iters: int, global_batch: int) -> list[str]:
    return ["--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch), "--train-iters",
            str(iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
            "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--seed", "1234",
            "--eval-iters", "0", "--eval-interval", "100000", "--log-interval", "1", "--log-throughput"]


def shape_flags(shape: str, seq: int | None = None) -> list[str]:
    """The shape's model flags, at sequence ``seq`` (None: the shape's own) with as many RoPE positions."""
    flags = list(SHAPES[shape])
    if seq is not None:
        for flag in ("--seq-length", "--max-position-embeddings"):
            flags[flags.index(flag) + 1] = str(seq)
    return flags


def _command(driver: Path | str, extra: list[str], model: list[str], shape: str, micro_batch: int, iters: int,
             global_batch: int, record: Path, port: int, nproc: int) -> list[str]:
    record_flag = ["--agoq-log-json", str(record)] if driver == DOOR else ["--bench-json", str(record)]
    entry = ["--module", "agoq.megatron_lm", str(UPSTREAM)] if driver == ZERO_EDIT else [str(driver)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port), *entry, *model, *LLAMA,
            *schedule(micro_batch, iters, global_batch), *data_flags(shape), *extra, *record_flag]


def row_command(name: str, shape: str, iters: int, global_batch: int, record: Path, port: int,
                micro_batch: int | None = None) -> list[str]:
    """``micro_batch``: overrides the row's own (the 8B shape runs every row at micro-batch 1)."""
    driver, row_micro_batch, extra, _ = ROWS[name]
    return _command(driver, extra, SHAPES[shape], shape, micro_batch or row_micro_batch, iters, global_batch, record,
                    port, 1)


def layout_command(row: te_layouts.LayoutRow, iters: int, record: Path, port: int) -> list[str]:
    """A suite row's torchrun command: its base row's driver and flags, at its shape, layout and batch."""
    driver, _, extra, _ = ROWS[row.base]
    if driver == DOOR:
        raise ValueError(f"{row.base}: the suites run Megatron-LM's driver (te/ and agoq_te/ rows), whose per-rank "
                         "peaks the summary reads; scripts/pretrain_gpt_agoq.py writes no per-rank file")
    given = {*extra, *row.extra}  # a switch the row already gives (--use-distributed-optimizer) is not repeated
    layout = [f for f in te_layouts.layout_flags(row) if not (f in given and f in te_layouts.SWITCHES)]
    extra = [*extra, *layout, *row.extra]
    return _command(driver, extra, shape_flags(row.shape, row.seq), row.shape, row.micro_batch, iters,
                    row.global_batch, record, port, row.nproc)


def read_record(path: Path, driver: Path) -> tuple[list[float], int | None, int | None]:
    """(loss per iteration, peak allocated bytes, peak reserved bytes) from the driver's record file."""
    if not path.exists():
        return [], None, None
    if driver != DOOR:
        rec = json.loads(path.read_text())
        return rec["iterations"], rec.get("peak_allocated_bytes"), rec.get("peak_reserved_bytes")
    losses, peak = {}, None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "lm_loss" in rec:
            losses[rec["iteration"]] = rec["lm_loss"]
        if rec.get("final"):
            peak = rec["peak_bytes"]
    return [losses[i] for i in sorted(losses)], peak, None


def read_rank_records(path: Path) -> list[dict]:
    """The upstream driver's per-rank files (``<--bench-json>.rank<R>``: each rank's layout coordinates and CUDA
    peaks), rank 0 first."""
    recs = [json.loads(f.read_text()) for f in path.parent.glob(path.name + ".rank*")]
    return sorted(recs, key=lambda r: r["rank"])


def timings(output: str, skip: int) -> dict:
    """Median iteration time and TFLOP/s/GPU over Megatron's per-iteration log lines from iteration ``skip`` on."""
    times = {int(i): float(ms) for i, ms in _ITER.findall(output)}
    tflops = {int(i): float(v) for i, v in _TFLOPS.findall(output)}
    kept = [times[i] for i in sorted(times) if i >= skip]
    kept_tflops = [tflops[i] for i in sorted(tflops) if i >= skip]
    return {"iteration_ms": [times[i] for i in sorted(times)],
            "median_iteration_ms": statistics.median(kept) if kept else None,
            "median_tflops_per_gpu": statistics.median(kept_tflops) if kept_tflops else None}


def _execute(name: str, command: list[str], env: dict, driver, record: Path, timeout: int, skip: int,
             global_batch: int, seq: int, nproc: int) -> dict:
    """Run one row's command; its row of the JSON (tokens/s over the whole job, per GPU, peaks, losses)."""
    for stale in [record, *record.parent.glob(record.name + ".rank*")]:
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = -9
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    losses, peak, reserved = read_record(record, driver)
    timing = timings(output, skip)
    ms = timing["median_iteration_ms"]
    tokens = None if not ms else round(global_batch * seq / (ms / 1000.0), 1)
    row = {"name": name, "returncode": rc, "seconds": round(time.perf_counter() - start, 1), "tokens_per_s": tokens,
           "tokens_per_s_per_gpu": tokens and round(tokens / nproc, 1), "peak_allocated_bytes": peak,
           "peak_reserved_bytes": reserved, "losses": losses, **timing,
           "command": [c for c in command if c != sys.executable], "env": env}
    if rc != 0 or not losses:
        row["output_tail"] = output[-5000:]
    return row


def _seq(model: list[str]) -> int:
    return int(model[model.index("--seq-length") + 1])


def profile_flags(name: str, steps: list[int] | None, workdir: Path) -> list[str]:
    """Megatron-LM's own profiler over iterations [A, B) of the row (``--profile A B``): its Chrome trace lands in
    ``<workdir>/<row>/torch_profile/rank-0.json.gz``. Only the megatron.training rows have it."""
    if not steps:
        return []
    if ROWS[name][0] == DOOR:
        raise ValueError(f"--profile: row {name} runs scripts/pretrain_gpt_agoq.py (agoq's trainer; profile it "
                         "with benchmarks/bench_step_profile.py); the te/ and agoq_te/ rows run megatron.training's "
                         "profiler")
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(steps[0]), "--profile-step-end",
            str(steps[1]), "--profile-ranks", "0", "--tensorboard-dir", str(workdir / name.replace("/", "_") / "tb")]


def attach_profile(row: dict, name: str, workdir: Path, keep: Path | None) -> None:
    """The row's trace summarised (benchmarks/trace_summary.py) into ``row["profile"]``; the trace itself copied to
    ``keep``/<row>.trace.json.gz when asked. A missing trace is said in the row, not skipped."""
    import shutil

    import trace_summary  # benchmarks/, beside this file

    trace = workdir / name.replace("/", "_") / "torch_profile" / "rank-0.json.gz"
    if not trace.is_file():
        row["profile"] = {"missing": f"no trace at {trace} (the row ended before the profiled iterations?)"}
        return
    row["profile"] = trace_summary.summarize(trace_summary.load_events(trace))
    row["profile"]["note"] = "the profiled iterations are in the row's timings too (the profiler slows them)"
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(trace, keep / (name.replace("/", "_") + ".trace.json.gz"))


def run_row(name: str, args, port: int, workdir: Path) -> dict:
    driver, row_micro_batch, _, extra_env = ROWS[name]
    record = workdir / (name.replace("/", "_") + ".json")
    command = row_command(name, args.shape, args.iters, args.global_batch, record, port, args.micro_batch)
    command += profile_flags(name, args.profile, workdir)
    row = _execute(name, command, extra_env, driver, record, args.row_timeout, args.skip, args.global_batch,
                   _seq(SHAPES[args.shape]), 1)
    if args.profile:
        attach_profile(row, name, workdir, args.keep_traces)
    return {"name": name, "micro_batch": args.micro_batch or row_micro_batch, **row}


def run_layout_row(name: str, row: te_layouts.LayoutRow, args, port: int, workdir: Path) -> dict:
    """A suite row: every rank's peak (the row's ``peak_allocated_bytes`` is the largest), each stage's, the planner's
    prediction or refusal."""
    record = workdir / (name.replace("/", "_") + ".json")
    command = layout_command(row, args.iters, record, port)
    env = {**ROWS[row.base][3], **te_layouts.row_env(row)}
    out = _execute(name, command, env, ROWS[row.base][0], record, args.row_timeout, args.skip, row.global_batch,
                   _seq(shape_flags(row.shape, row.seq)), row.nproc)
    ranks = read_rank_records(record)
    out.update(side=row.side, nproc=row.nproc, layout={"tp": row.tp, "pp": row.pp, "cp": row.cp, "dp": row.dp},
               micro_batch=row.micro_batch, global_batch=row.global_batch, shape=row.shape,
               seq=_seq(shape_flags(row.shape, row.seq)), rank_peaks=ranks,
               stage_peaks_bytes=te_layouts.stage_peaks(ranks) if ranks else None,
               planner=planner_prediction(command, row))
    if len(ranks) == row.nproc:
        out["peak_allocated_bytes"] = max(r["peak_allocated_bytes"] for r in ranks)
        out["peak_reserved_bytes"] = max(r["peak_reserved_bytes"] for r in ranks)
    elif ranks:  # some ranks did not finish: their peaks are unknown, so the row's is too
        out["peak_allocated_bytes"] = out["peak_reserved_bytes"] = None
        out["rank_peaks_missing"] = sorted(set(range(row.nproc)) - {r["rank"] for r in ranks})
    return out


def planner_prediction(command: list[str], row: te_layouts.LayoutRow) -> dict:
    """agoq.plan's TE-path peak for the row's command (benchmarks/validate_planner_te.py's translation, ``--dp``
    from the layout), or the planner's own refusal as ``not_modelled``: it models one GPU; CP not at all."""
    if row.cp > 1:
        return {"not_modelled": te_layouts.CP_NOT_MODELLED}
    import validate_planner_te

    argv = validate_planner_te.planner_argv(command)
    if row.dp > 1:
        argv[-2:-2] = ["--dp", str(row.dp)]
    try:
        peak = validate_planner_te.predict(argv)
    except ValueError as err:  # the planner's refusal names what it does not model: recorded, not a number
        return {"not_modelled": f"planner: {err}", "argv": argv}
    except SystemExit:  # its parser refused a flag (printed above: "unrecognized arguments: ...")
        return {"not_modelled": "planner: python -m agoq.plan does not take this row's flags (its parser's error "
                "is in the bench's log)", "argv": argv}
    return {"predicted_peak_bytes": peak.peak, "predicted_activation_bytes": peak.held + peak.transient,
            "predicted_persistent_bytes": peak.persistent, "argv": argv}


def summarize(rows: list[dict]) -> dict:
    """The suite tables of rows (one run's or several merged): equal memory, CP against CP=1, planner error."""
    suite_rows = [r for r in rows if "layout" in r]
    return {"equal_memory_8b": te_layouts.equal_memory([r for r in suite_rows if r["name"].startswith("eqmem_8b/")]),
            "cp_losses": te_layouts.cp_losses(suite_rows),
            "planner_error": {r["name"]: te_layouts.planner_error(r) if "predicted_peak_bytes" in r["planner"]
                              else r["planner"]["not_modelled"] for r in suite_rows}}


def versions() -> dict:
    out = {}
    for module in ("torch", "megatron.core", "transformer_engine"):
        try:
            from importlib.metadata import version

            out[module] = version({"megatron.core": "megatron-core", "transformer_engine": "transformer-engine",
                                   "torch": "torch"}[module])
        except Exception as exc:  # noqa: BLE001 - recorded, not raised: a row says what it ran on
            out[module] = f"unavailable ({type(exc).__name__})"
    return out


def _rows_to_run(args) -> list[tuple[str, te_layouts.LayoutRow | None]]:
    if args.suite is None:
        names = args.rows or list(ROWS)
        unknown = [n for n in names if n not in ROWS]
        if unknown or args.nproc not in (None, 1):
            raise SystemExit(f"bench_te.py: {unknown or '--nproc ' + str(args.nproc)} without --suite: the one-GPU "
                             f"rows are {', '.join(ROWS)}; multi-GPU rows come from --suite "
                             f"({', '.join(te_layouts.SUITES)})")
        return [(n, None) for n in names]
    suite = te_layouts.SUITES[args.suite]
    names = args.rows or [n for n, r in suite.items() if args.nproc in (None, r.nproc)]
    unknown = [n for n in names if n not in suite]
    if unknown:
        raise SystemExit(f"bench_te.py: {', '.join(unknown)} not in --suite {args.suite} ({', '.join(suite)})")
    return [(n, suite[n]) for n in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "te.json")
    parser.add_argument("--suite", choices=list(te_layouts.SUITES), default=None,
                        help="multi-GPU rows at their layouts (benchmarks/te_layouts.py); --rows picks some")
    parser.add_argument("--nproc", type=int, default=None, help="with --suite: only its rows of this many GPUs")
    parser.add_argument("--rows", nargs="*", default=None, help="one-GPU rows (default: all), or --suite's rows")
    parser.add_argument("--shape", choices=list(SHAPES), default="1b")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--skip", type=int, default=4, help="first iteration counted in the medians")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=None, help="every row at this micro-batch (default: the "
                        "row's own)")
    parser.add_argument("--row-timeout", type=int, default=420)
    parser.add_argument("--profile", type=int, nargs=2, default=None, metavar=("A", "B"),
                        help="one-GPU rows: Megatron-LM's torch profiler over iterations A..B-1, summarised per row "
                             "(benchmarks/trace_summary.py: GPU busy time and kernel time by category)")
    parser.add_argument("--keep-traces", type=Path, default=None, help="with --profile: copy each trace here")
    parser.add_argument("--summarize", type=Path, nargs="+", default=None,
                        help="print the summary of these result files' rows together, run nothing")
    args = parser.parse_args(argv)
    if args.summarize:
        rows = [row for path in args.summarize for row in json.loads(path.read_text())["rows"]]
        print(json.dumps(summarize(rows), indent=1))
        return
    todo = _rows_to_run(args)
    if args.profile and (args.suite or args.profile[0] < 1 or args.profile[1] <= args.profile[0]
                         or args.profile[1] > args.iters):
        parser.error(f"--profile {args.profile[0]} {args.profile[1]}: one-GPU rows only, 1 <= A < B <= --iters "
                     f"({args.iters})")
    for name, _ in todo:
        profile_flags(name, args.profile, Path("."))  # a row that cannot be profiled stops the run before it starts
    import torch

    result = {"bench": "te", "suite": args.suite, "shape": None if args.suite else args.shape, "iters": args.iters,
              "skip": args.skip, "global_batch": None if args.suite else args.global_batch,
              "gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0)
              if torch.cuda.is_available() else "cpu", "versions": versions(), "date": time.strftime("%Y-%m-%d"),
              "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, layout) in enumerate(todo):
            row = run_row(name, args, 29500 + k, Path(tmp)) if layout is None else \
                run_layout_row(name, layout, args, 29500 + k, Path(tmp))
            result["rows"].append(row)
            if args.suite:
                result["summary"] = summarize(result["rows"])
            print(f"{name}: rc {row['returncode']} {row['tokens_per_s']} tok/s peak "
                  f"{(row['peak_allocated_bytes'] or 0) / 2**30:.2f} GiB losses {row['losses'][:3]}...", flush=True)
            args.out.write_text(json.dumps(result, indent=1))  # after every row: a killed run keeps what it had


if __name__ == "__main__":
    main()
