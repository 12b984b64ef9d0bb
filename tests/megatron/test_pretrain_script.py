"""scripts/pretrain_llama.py end to end on CPU: 2 gloo ranks, real megatron-core, the built-in corpus.

These run the user's command (torchrun + the script) and read its Megatron-style iteration lines.
Checkpoint resume (layouts, optimizers, fallback, LR schedule, SIGTERM): tests/megatron/test_resume.py.
"""

from __future__ import annotations

import pytest

from agoq.testing.procs import TINY_CONFIG, child_env, iteration_records, run_pretrain

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

TINY = ["--config", str(TINY_CONFIG)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One data cache for the module: the default corpus and tokenizer are built once."""
    return child_env(AGOQ_CACHE=str(tmp_path_factory.mktemp("agoq_cache")))


def _losses(output: str) -> list[float]:
    return [r["loss"] for r in iteration_records(output)]


def test_pp2_1f1b_loss_falls(env):
    """The README's first command (tiny, PP=2, CPU, built-in corpus; more steps at a higher LR): it trains, and
    its start-up output is a report, not noise (issue 21: 43 of 158 lines were per-rank Megatron/torch warnings,
    the policy YAML was echoed with its comments, setup and the corpus build were silent)."""
    args = TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "20", "--lr", "1e-2"]
    proc = run_pretrain(2, args, env=env)
    losses = _losses(proc.stdout)
    assert len(losses) == 20, proc.stdout[-3000:]
    # Initial loss ~ ln(vocab) for a random init; 20 steps of Adam at lr 1e-2 must cut it clearly.
    # The threshold is far from noise: a broken update (lr 0, grads lost in the pipeline) stays flat.
    assert losses[-1] < losses[0] - 1.0, losses
    _assert_startup_output_is_a_report(proc.stdout, proc.stderr)


def _third_party_warnings(output: str) -> list[str]:
    """Warning lines of megatron-core / torch (agoq.train.known_warnings filters the harmless ones);
    torchrun's own banner (the launcher, before our processes start) is not ours to filter."""
    return [line for line in output.splitlines()
            if ("Warning" in line or "warnings.warn" in line or "DEPRECATED" in line or "deprecated" in line
                or line.startswith(("W1", "W0"))) and "torch/distributed/run.py" not in line]


def _assert_startup_output_is_a_report(stdout: str, stderr: str) -> None:
    lines = (stdout + stderr).splitlines()
    noise = _third_party_warnings(stdout + stderr)
    assert noise == [], "third-party warnings in the start-up output:\n" + "\n".join(noise)
    # the policy: its resolved table, once, not the file's text and comments
    assert stdout.count("resolved per layer and role") == 1, stdout[:4000]
    assert not [line for line in lines if line.lstrip().startswith("#")], stdout[:4000]
    # progress lines from rank 0 (once each) before the slow phases
    for phase in ("pretrain_llama.py: arguments checked; loading torch and megatron-core",
                  "]: tokenizer and data files (agoq's built-in corpus)", "]: building the model (4 layers",
                  "]: building the optimizer", "]: building the datasets", "]: setup done; iteration 1 runs next"):
        assert stdout.count(phase) == 1, (phase, stdout[:4000])
    assert "data: built-in corpus" in stdout  # "ready: N documents ..." after a build, "(cached): DIR" after
    assert "done: 20 iterations in " in stdout


def test_layout_that_does_not_divide_stops_before_training(env):
    """Checked before torch and megatron load: one line from the first process, no usage dump, no traceback
    from the script (torchrun's own report of the failed child follows it)."""
    proc = run_pretrain(2, TINY + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"], env=env, check=False)
    assert proc.returncode != 0
    assert "pretrain_llama.py: error: --num-layers 3 is not divisible by 2 model chunks" in proc.stderr
    assert proc.stderr.count("pretrain_llama.py: error:") == 1, proc.stderr  # once, not once per rank
    assert "usage:" not in proc.stderr and "pretrain_llama.py\", line" not in proc.stderr, proc.stderr
    assert iteration_records(proc.stdout) == []


def test_int8_grads_dp2_distopt_track_float_grads(env):
    """--agoq-grads int8_b256 (8-bit main_grad + 8-bit reduction) vs Megatron's fp32 grads, DP=2.

    Band: the 8-bit reduction's relative error is ~1% per element (docs/numerics.md), which moves the
    Adam update direction only slightly; over 6 steps the loss must stay within 1% of the float run.
    """
    args = TINY + ["--use-distributed-optimizer", "--train-iters", "6", "--lr", "1e-2"]
    base = _losses(run_pretrain(2, args, env=env).stdout)
    quant = run_pretrain(2, args + ["--agoq-grads", "int8_b256"], env=env)
    assert "gradients: int8_b256 (store mode)" in quant.stdout
    losses = _losses(quant.stdout)
    assert len(losses) == len(base) == 6
    assert losses[-1] < losses[0] - 0.3  # it trains
    assert losses[-1] == pytest.approx(base[-1], rel=1e-2)


def test_validation_loss_is_reported_and_resumes_on_the_same_batches(env, tmp_path):
    """--eval-interval: forward-only validation on the valid split; a resumed run evaluates the same
    validation batches (the valid iterator restarts where the uninterrupted run would be); the test split is
    evaluated once, when training completes, and a resumed run that completes reports the same test loss."""
    import re

    def validation(stdout: str) -> dict[int, float]:
        return {int(m[1]): float(m[2]) for m in re.finditer(r"validation at iteration (\d+) \| lm loss: (\S+)", stdout)}

    def test_split(stdout: str) -> list[tuple[int, float]]:
        return [(int(m[1]), float(m[2])) for m in re.finditer(r"^test at iteration (\d+) \| lm loss: (\S+)", stdout,
                                                              flags=re.M)]

    args = TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "4", "--lr-warmup-iters", "1",
                   "--eval-interval", "2", "--eval-iters", "1"]
    full_run = run_pretrain(2, args, env=env).stdout
    full = validation(full_run)
    assert sorted(full) == [2, 4] and full[4] < full[2]  # it learns on held-out text
    # the test split once, when training completes (Megatron-LM): other batches than the validation's
    tested = test_split(full_run)
    assert [it for it, _ in tested] == [4] and tested[0][1] != full[4] and tested[0][1] < full[2] + 1.0
    ckpt = tmp_path / "ckpt"
    # first run of a job that always passes --load: the directory does not exist yet (Megatron-LM's behaviour)
    first = run_pretrain(2, args + ["--save", str(ckpt), "--load", str(ckpt), "--exit-interval", "2"], env=env)
    assert f"--load {ckpt}: no checkpoint yet, starting from scratch" in first.stdout
    # resumed with Megatron-LM's manual garbage collection: the same numbers, the collector's schedule said
    again = run_pretrain(2, args + ["--load", str(ckpt), "--manual-gc", "--manual-gc-interval", "1"], env=env)
    resumed = validation(again.stdout)
    assert resumed == {4: full[4]}
    assert test_split(first.stdout) == [] and test_split(again.stdout) == tested  # stopped early: no test yet
    assert "manual garbage collection (--manual-gc): automatic collector off while training; full collection " \
           "every 1 steps; before and after each evaluation" in again.stdout
    # a save (its writer process re-imports the script) and a load print no megatron/torch warnings either;
    # the closing line counts this run's iterations, not the checkpoint's (issue 21)
    noise = _third_party_warnings(first.stdout + first.stderr + again.stdout + again.stderr)
    assert noise == [], noise
    assert "done: 2 iterations in " in first.stdout and "(at 2 of 4)" in first.stdout
    assert "done: 2 iterations in " in again.stdout and "(resumed at iteration 2; now at 4 of 4)" in again.stdout


def test_a_test_split_of_weight_zero_is_said_and_skipped(env):
    """--split with no test weight: the end-of-training test evaluation has no batches; the run says so at start-up
    and completes with its validation (it crashed in the schedule before). The same launch runs with
    --deterministic-mode (sharing it saves CI a launch): every op of the training step, the evaluation and the
    data path has a deterministic kernel (PyTorch raises on one that has none), and the line reads the settings back
    from torch and the rank's environment."""
    proc = run_pretrain(1, TINY + ["--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "2",
                                   "--eval-iters", "1", "--split", "99,1,0", "--deterministic-mode"], env=env)
    assert "test split: weight 0 in --split 99,1,0: no test evaluation when training completes" in proc.stdout
    assert "validation at iteration 2 | lm loss: " in proc.stdout and "test at iteration" not in proc.stdout
    assert ("deterministic mode (--deterministic-mode): torch deterministic algorithms on; NCCL_ALGO=Ring, "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0") in proc.stdout


def test_nonfinite_step_is_skipped_counted_and_training_continues(env):
    """A NaN loss at iteration 3 (fault injection) under PP=2: every rank skips that update (no
    optimizer or LR step), the skip is counted and logged, and training goes on with finite losses."""
    args = TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "5", "--lr-warmup-iters", "1",
                   "--debug-nonfinite-at-iteration", "3"]
    proc = run_pretrain(2, args, env=env)
    records = iteration_records(proc.stdout)
    assert "iteration 3: non-finite loss or gradients on some rank: update skipped (1 skipped so far)" in proc.stdout
    assert [r["skipped"] for r in records] == [0, 0, 1, 1, 1]
    assert records[2]["loss"] != records[2]["loss"]  # NaN
    assert all(r["loss"] == r["loss"] for r in records[3:])  # finite again: the NaN never reached the weights


def test_memory_breakdown_counts_megatron_and_agoq_bytes_per_parameter(env, tmp_path):
    """The measured breakdown in --log-json (weights / grads / optimizer bytes from the live tensors) gives
    Megatron's 2 / 4 / 12 bytes per parameter (bf16 weights, fp32 grad buffer, fp32 main params + Adam
    moments) and agoq's optimizer at ~3.1 (split24 remainder 1 + two 8-bit moments with fp16 scales per
    32 = 2 x 1.0625; small tensors keep fp32 states), up to buffer padding."""
    import json

    from agoq.plan.memory import GIB

    def breakdown(extra: list[str]) -> dict:
        log = tmp_path / f"log{len(extra)}.jsonl"
        run_pretrain(1, TINY + ["--train-iters", "1", "--lr-warmup-iters", "0", "--log-json", str(log)] + extra,
                     env=env)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        return {k: v * GIB for k, v in next(r["memory_breakdown"] for r in records if "memory_breakdown" in r).items()}

    base = breakdown(["--agoq-disable"])
    n_params = base["weights_gib"] / 2  # bf16
    assert 4.0 <= base["grads_gib"] / n_params <= 4.0 * 1.02
    assert 12.0 <= base["optimizer_gib"] / n_params <= 12.0 * 1.02
    lean = breakdown(["--agoq-optimizer", "adamw"])
    assert lean["weights_gib"] == base["weights_gib"]
    assert 3.125 <= lean["optimizer_gib"] / n_params <= 3.125 * 1.1  # small fp32-state tensors: < 10 % extra


def test_bench_pretrain_memory_smoke_records_the_predicted_peak(env, tmp_path):
    """benchmarks/bench_pretrain.py --suite memory --smoke (CPU): every variant carries the planner's predicted
    peak per stage (agoq.plan.peak, written by the script at start-up), the number the GPU run puts next to
    the measured peak (summary: predicted_peak_gib / predicted_peak_error; docs/benchmarks/planner.md)."""
    import json
    import subprocess
    import sys

    from agoq.testing.procs import REPO_ROOT

    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_pretrain.py"), "--suite", "memory",
                           "--smoke", "--only", "mbs2/baseline", "mbs2/agoq full", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert len(report["variants"]) == 2
    for variant in report["variants"]:
        predicted = variant["predicted_memory"]
        assert len(predicted["peak_gib"]) == 1 and predicted["peak_gib"][0] > 0
        assert predicted["phase"][0] in ("forward/backward", "optimizer step")
    base, full = (v["predicted_memory"]["peak_gib"][0] for v in report["variants"])
    assert full < base  # 8-bit grads + lean optimizer + quantized activations
