"""Every benchmarks/bench_pretrain.py suite (GPU and --smoke forms) passes scripts/pretrain_llama.py's own
argument parser and validation: a misspelt flag or a batch that does not divide fails here, on CPU, instead
of minutes into a GPU lease."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from agoq.testing.procs import REPO_ROOT
from agoq.train.args import parse_args
from tests.megatron._bench_scripts import load_bench_script

BENCH = load_bench_script("bench_pretrain")


@pytest.mark.parametrize("smoke", [False, True], ids=["gpu", "smoke"])
@pytest.mark.parametrize("suite", sorted(BENCH.SUITES))
def test_suite_variants_parse(suite, smoke):
    variants = BENCH.SUITES[suite](smoke)
    names = [v["name"] for v in variants]
    assert names and len(set(names)) == len(names), names
    for variant in variants:
        args = parse_args(variant["args"])
        assert args.global_batch_size % args.micro_batch_size == 0, variant["name"]


def test_fp8_scale_suite_compares_like_with_like():
    """Within each shape the FP8 variants differ from bf16 only by FP8 flags (same batch, shape, policy)."""
    variants = {v["name"]: v["args"] for v in BENCH.fp8_scale_suite(False)}
    for shape in ("1b/mbs4", "7b-layers/mbs1"):
        bf16, fp8 = variants[f"{shape}/bf16"], variants[f"{shape}/fp8 delayed"]
        assert fp8[: len(bf16)] == bf16 and fp8[len(bf16):] == ["--agoq-fp8", "delayed"]
    assert parse_args(variants["7b-layers/mbs1/bf16"]).seq_length == 4096


# ---- issue 23: capacity and equal-memory suites ------------------------------------------------------------

CAPACITY_BUDGET_GIB = 80  # one H100's memory: what the capacity suites' expectations are stated against


def _predicted_peaks_gib(variant: dict) -> list[float]:
    """agoq.plan.peak's per-stage peaks of a variant, rebuilt from the trainer's own parse of its flags (the
    built-in tokenizer's rows padded as the trainer pads them)."""
    from agoq.data.tokenizer import DEFAULT_VOCAB_SIZE, padded_vocab_size
    from agoq.plan.memory import GIB, Layout
    from agoq.plan.peak import predict_peaks
    from agoq.plan.recipe import recipe_of
    from agoq.plan.shape import ModelShape
    from agoq.policy import load_policy

    args = parse_args(variant["args"])
    config = args.agoq_config
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    layout = Layout(tp=tp, pp=pp, dp=variant["nproc"] // (tp * pp), mbs=args.micro_batch_size,
                    gbs=args.global_batch_size, seq=args.seq_length,
                    distributed_optimizer=args.use_distributed_optimizer,
                    grad_bytes=0 if config.optimizer.gradient_release else 4)
    rows = padded_vocab_size(args.vocab_size or DEFAULT_VOCAB_SIZE, tp, args.make_vocab_size_divisible_by)
    shape = ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
                       args.ffn_hidden_size, rows)
    policy = config.policy.spec if config.enabled else load_policy(REPO_ROOT / "configs" / "policy" / "bf16.yaml")
    return [p.peak / GIB for p in predict_peaks(shape, layout, policy, recipe_of(config))]


@pytest.mark.parametrize("suite, model, nproc", [("capacity_1gpu", "llama3-8b", 1), ("capacity_4gpu", "llama-32b", 4)])
def test_capacity_suites_run_the_model_files_shape_with_the_real_vocabulary(suite, model, nproc):
    import yaml

    from agoq.data.tokenizer import DEFAULT_VOCAB_SIZE, padded_vocab_size

    cfg = yaml.safe_load((REPO_ROOT / "configs" / "model" / f"{model}.yaml").read_text())
    variants = BENCH.SUITES[suite](False)
    assert {v["side"] for v in variants} == {"baseline", "agoq"}
    for variant in variants:
        args = parse_args(variant["args"])
        assert variant["nproc"] == nproc and args.pipeline_model_parallel_size == nproc
        assert all(getattr(args, key) == cfg[key] for key in BENCH.ARCH_KEYS), variant["name"]
        rows = padded_vocab_size(DEFAULT_VOCAB_SIZE, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by)
        assert rows == BENCH.LLAMA3_VOCAB == 128256
        assert args.seq_length == 4096 and args.train_iters >= 20
        worst = max(_predicted_peaks_gib(variant))
        if variant["side"] == "baseline":  # Megatron bf16 is expected not to start: the planner agrees
            assert variant["expect"] == "oom" and args.agoq_disable and worst > CAPACITY_BUDGET_GIB, worst
        else:
            assert variant["expect"] is None and worst < CAPACITY_BUDGET_GIB, (variant["name"], worst)


def test_the_70b_suite_runs_the_layouts_the_planner_answered_for_one_8_gpu_node():
    """issue 47: every agoq layout is predicted to fit an 80 GB H100 less the CUDA context, the one within the
    allocator's fragmentation runs with expandable segments (as the planner's command), Megatron bf16 is expected
    out of memory, and the suite's global batch 32 gives the same predicted stage peaks as the model file's 512."""
    import yaml

    from agoq.plan import headroom
    from agoq.plan.memory import GIB

    budget_gib = 85017493504 / GIB - headroom.OUTSIDE_ALLOCATOR_GIB  # an H100 80GB, as capacity.md's 70B section
    cfg = yaml.safe_load((REPO_ROOT / "configs" / "model" / "llama3-70b.yaml").read_text())
    variants = BENCH.SUITES["llama70b_8gpu"](False)
    assert {v["side"] for v in variants} == {"baseline", "agoq"}
    for variant in variants:
        args = parse_args(variant["args"])
        assert variant["nproc"] == 8 == args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        assert all(getattr(args, key) == cfg[key] for key in BENCH.ARCH_KEYS), variant["name"]
        assert args.vocab_size == cfg["vocab_size"] and args.seq_length == 4096 and args.train_iters >= 20
        peaks = _predicted_peaks_gib(variant)
        full_batch = {**variant, "args": [*variant["args"], "--global-batch-size", "512"]}
        assert _predicted_peaks_gib(full_batch) == pytest.approx(peaks, rel=1e-12), variant["name"]
        if variant["side"] == "baseline":
            assert variant["expect"] == "oom" and args.agoq_disable and max(peaks) > budget_gib
            continue
        assert variant["expect"] is None and max(peaks) <= budget_gib, (variant["name"], max(peaks))
        tight = budget_gib - max(peaks) < headroom.FRAGMENTATION_GIB
        assert variant.get("env", {}) == (headroom.EXPANDABLE if tight else {}), variant["name"]


def test_equal_memory_8b_variants_are_all_predicted_to_fit_one_h100():
    variants = BENCH.SUITES["equal_memory_8b_pp4"](False)
    assert {v["side"] for v in variants} == {"baseline", "agoq"}
    for variant in variants:
        assert max(_predicted_peaks_gib(variant)) <= CAPACITY_BUDGET_GIB, variant["name"]
        assert parse_args(variant["args"]).seq_length == 4096


def test_equal_memory_table_takes_the_fastest_fitting_run_of_each_side():
    runs = [{"name": "b1", "side": "baseline", "tokens_per_second_median": 100.0, "peak_gib": 30.0, "mfu": 0.3},
            {"name": "b2", "side": "baseline", "tokens_per_second_median": 150.0, "stage_peaks_gib": [70.0, 50.0]},
            {"name": "a1", "side": "agoq", "tokens_per_second_median": 160.0, "peak_gib": 20.0},
            {"name": "a2", "side": "agoq", "failed": True}]
    low, high = BENCH.equal_memory_table(runs, (32, 80))
    assert (low["baseline"], low["agoq"], low["speedup"]) == ("b1", "a1", 1.6)
    assert (high["baseline"], high["baseline_peak_gib"]) == ("b2", 70.0)  # the largest stage peak counts
    assert high["speedup"] == pytest.approx(160 / 150)
    assert BENCH.equal_memory_table(runs, (10,))[0] == {"budget_gib": 10, "baseline": None, "agoq": None}


def test_an_expected_out_of_memory_is_a_result_and_an_unexpected_one_a_failure():
    crash = {"name": "x", "returncode": 1, "out_of_memory": True, "expect": "oom", "side": "baseline",
             "predicted_memory": {"peak_gib": [164.6], "phase": ["optimizer step"]}}
    summary = BENCH.summarise(crash, warmup=3)
    assert summary["outcome"] == "out of memory (expected)" and BENCH.expected_failure(summary)
    assert summary["predicted_stage_peaks_gib"] == [164.6]
    assert not BENCH.expected_failure(BENCH.summarise({**crash, "out_of_memory": False}, warmup=3))
    assert not BENCH.expected_failure(BENCH.summarise({**crash, "expect": None}, warmup=3))


def test_mfu_uses_the_devices_dense_bf16_peak():
    assert BENCH.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert BENCH.peak_tflops("NVIDIA H100 PCIe") == 756.5
    assert BENCH.peak_tflops("NVIDIA H200") == 989.4 and BENCH.peak_tflops("cpu") is None
    steady = [{"tflops_per_gpu": t} for t in (400.0, 500.0, 450.0)]
    assert BENCH._mfu(steady, "NVIDIA H100 80GB HBM3") == {"tflops_per_gpu_median": 450.0, "mfu": 450.0 / 989.4}


def test_list_prints_every_command_and_runs_nothing(tmp_path, capsys):
    assert BENCH.main(["--suite", "capacity_4gpu", "--out", str(tmp_path / "r.json"), "--list"]) == 0
    out = capsys.readouterr().out
    assert out.count("--nproc-per-node 4") == 3 and "--make-vocab-size-divisible-by 128256" in out
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("suite", ["capacity_1gpu", "capacity_4gpu", "equal_memory_1b", "equal_memory_8b_pp4"])
def test_validate_planner_reads_the_issue_23_commands_as_the_trainer_does(suite, tmp_path):
    """benchmarks/validate_planner.py predicts a committed result from its command line: for these suites it must
    read selective / full recompute, the moments, gradient release and the padded vocabulary as the trainer does."""
    validate = load_bench_script("validate_planner")
    from agoq.plan.memory import GIB
    from agoq.plan.peak import predict_peaks
    from agoq.policy import load_policy

    for variant in BENCH.SUITES[suite](False):
        argv, _ = BENCH.variant_command(variant, tmp_path / "log.jsonl")
        shape, layout, policy, recipe = validate.from_pretrain_argv(argv)
        peaks = [p.peak / GIB for p in predict_peaks(shape, layout, load_policy(policy), recipe)]
        assert peaks == pytest.approx(_predicted_peaks_gib(variant), rel=1e-9), variant["name"]


def test_a_variant_past_its_timeout_is_killed_with_its_workers_and_the_suite_goes_on(tmp_path):
    """torchrun starts each worker in a session of its own (start_new_session=True): killing torchrun's process
    group alone would leave them holding GPU memory and the output, and the suite would hang (it did, on GPUs)."""
    pid_file = tmp_path / "worker.pid"
    worker = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    launcher = (f"import subprocess, sys, time; "
                f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); "
                "print('launched', flush=True); time.sleep(60)")

    start = time.monotonic()
    proc = BENCH._run_bounded([sys.executable, "-c", launcher], timeout=3, env=dict(os.environ))
    assert time.monotonic() - start < 30  # a surviving worker would hold the output pipe open for its 60 s
    assert proc.returncode == BENCH.TIMEOUT_RETURNCODE and "launched" in proc.stdout and "--timeout 3" in proc.stderr
    status = Path(f"/proc/{pid_file.read_text()}/status")

    def alive() -> bool:  # SIGKILL is delivered at once, the exit takes a moment; a zombie awaits its reaper
        try:
            return "\nState:\tZ" not in status.read_text()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()
    summary = BENCH.summarise({"name": "x", "returncode": proc.returncode}, warmup=3)
    assert summary["failed"] and summary["timed_out"]


def test_only_refuses_a_filter_that_matches_nothing_even_beside_one_that_matches():
    picked = BENCH.select_variants("fp8_scale", False, ["1b/mbs4/bf16"])
    assert [v["name"] for v in picked] == ["1b/mbs4/bf16"]
    with pytest.raises(SystemExit, match=r"(?s)--only \['1b/mbs4/fp8 delayd'\].*1b/mbs4/fp8 delayed"):
        BENCH.select_variants("fp8_scale", False, ["1b/mbs4/bf16", "1b/mbs4/fp8 delayd"])


def test_graphs_pp2_fp8_suite_compares_like_with_like():
    """FP8 at PP=2 (issue 24's FP8 target): each FP8 run is its bf16-linears run plus the FP8 flag, in the same mode,
    on graphs_pp2's shape and batch."""
    variants = {v["name"]: v["args"] for v in BENCH.SUITES["graphs_pp2_fp8"](False)}
    baseline = next(v["args"] for v in BENCH.SUITES["graphs_pp2"](False) if v["name"].endswith("(Megatron)/eager"))
    for mode, tail in (("eager", []), ("graphs", ["--cuda-graph-impl", "local"])):
        bf16, fp8 = (variants[f"1b/pp2/mbs1/{n} (bf16 policy)/{mode}"] for n in ("bf16 linears", "fp8 delayed"))
        assert bf16[len(bf16) - len(tail):] == tail and fp8[len(fp8) - len(tail):] == tail
        assert fp8[: len(bf16) - len(tail)] == bf16[: len(bf16) - len(tail)]
        assert fp8[len(bf16) - len(tail): len(fp8) - len(tail)] == ["--agoq-fp8", "delayed"]
        assert bf16[: len(baseline) - 1] == baseline[:-1]  # graphs_pp2's flags but --agoq-disable


def test_summary_carries_the_reserved_bytes_next_to_the_allocated_peak():
    """Under CUDA graphs a replay allocates nothing, so the allocated peak misses the graph pool: the summary keeps
    the allocator's reserved bytes of the last step beside it (docs/benchmarks/activations.md)."""
    records = [{"iteration": i, "tokens_per_second": 10.0, "step_seconds": 1.0, "lm_loss": 5.0, "peak_gib": 21.0}
               for i in (1, 2, 3, 4, 5)]
    run = {"name": "x/graphs", "returncode": 0, "records": records,
           "memory_breakdown_last": {"peak_gib": 21.0, "reserved_gib": 27.48, "weights_gib": 1.8}}
    summary = BENCH.summarise(run, warmup=3)
    assert (summary["peak_gib"], summary["reserved_gib"], summary["weights_gib"]) == (21.0, 27.48, 1.8)


def test_summary_gives_the_host_readings_medians_over_steady_iterations_only():
    """The trainer's per-step host readings (hoststats) become medians over the iterations after --warmup: the
    enqueue time, the main and backward threads' CPU and wait, the collections; absent readings add no key."""
    def threads(main_cpu, bwd_cpu):
        return [{"name": "python", "main": True, "cpu_seconds": main_cpu, "wait_seconds": 0.001},
                {"name": BENCH.BACKWARD_THREAD + "1", "main": False, "cpu_seconds": bwd_cpu, "wait_seconds": 0.0}]
    records = [{"iteration": i, "tokens_per_second": 10.0, "step_seconds": 1.0, "lm_loss": 5.0,
                "host_enqueue_seconds": e, "host_threads": threads(c, c / 2), "gc_collections": g}
               for i, e, c, g in ((1, 9.0, 9.0, 50), (2, 0.5, 0.4, 1), (3, 0.7, 0.6, 3), (4, 0.6, 0.5, 2))]
    summary = BENCH.summarise({"name": "x", "returncode": 0, "records": records}, warmup=1)
    assert summary["host_enqueue_ms_median"] == pytest.approx(600.0)
    assert summary["main_thread_cpu_ms_median"] == pytest.approx(500.0)
    assert summary["backward_thread_cpu_ms_median"] == pytest.approx(250.0)
    assert summary["main_thread_wait_ms_median"] == pytest.approx(1.0) and summary["gc_collections_median"] == 2
    bare = [{k: v for k, v in r.items() if not k.startswith(("host_", "gc_"))} for r in records]
    assert not any(k.startswith(("host_", "main_", "backward_", "gc_"))
                   for k in BENCH.summarise({"name": "x", "returncode": 0, "records": bare}, warmup=1))


def test_skip_drops_matching_variants_and_refuses_a_filter_that_matches_nothing():
    eager = BENCH.select_variants("graphs_pp2", False, None, ["manual_gc", "/graphs"])
    assert [v["name"].rsplit("/", 1)[1] for v in eager] == ["eager", "eager", "eager"]
    rope_only = [v for v in eager if "Megatron + agoq RoPE only" in v["name"]]  # the RoPE kernel's part apart
    assert len(rope_only) == 1 and rope_only[0]["args"][-3:] == ["--agoq-disable", "--rope-fusion", "agoq"]
    with pytest.raises(SystemExit, match=r"--skip \['manual-gc'\]"):
        BENCH.select_variants("graphs_pp2", False, None, ["manual-gc"])
    with pytest.raises(SystemExit, match="leaves no variant of suite 'graphs_pp2' to run"):
        BENCH.select_variants("graphs_pp2", False, None, ["1b/"])


def test_rounds_alternate_the_variants_and_summarise_each_over_its_rounds():
    runs = BENCH.round_robin([{"name": "a", "nproc": 1}, {"name": "b", "nproc": 1}], 3)
    assert [r["name"] for r in runs] == ["a #round 1", "b #round 1", "a #round 2", "b #round 2",
                                         "a #round 3", "b #round 3"]
    assert BENCH.round_robin(runs[:1], 1) == runs[:1]  # one round: the names stay as the suite gives them
    speeds = {"a": [100.0, 90.0, 110.0], "b": [50.0, 60.0, 55.0]}
    summaries = [{"name": r["name"], "tokens_per_second_median": speeds[r["name"][0]][int(r["name"][-1]) - 1]}
                 for r in runs] + [{"name": "b #round 4", "failed": True}, {"name": "c #round 1", "failed": True}]
    table = {row["name"]: row for row in BENCH.rounds_summary(summaries)}
    assert (table["b"]["failed_rounds"], table["a"]["failed_rounds"]) == (1, 0)
    assert table["c"] == {"name": "c", "tokens_per_second_rounds": [], "tokens_per_second_median_of_rounds": None,
                          "spread": None, "failed_rounds": 1}  # every round failed: listed, no number
    assert table["a"]["tokens_per_second_rounds"] == [100.0, 90.0, 110.0]
    assert table["a"]["tokens_per_second_median_of_rounds"] == 100.0
    assert table["b"]["tokens_per_second_median_of_rounds"] == 55.0  # the failed round is not a number
    assert table["a"]["spread"] == pytest.approx(110 / 90 - 1)


def test_step_profile_profiles_only_the_chosen_iterations_and_writes_each_ranks_report(tmp_path):
    """benchmarks/bench_step_profile.py around the real script on the CPU: a report per rank, of the two chosen
    iterations only (their wall time is a fraction of the run's), with host time on the main thread."""
    import json
    import subprocess

    from agoq.testing.procs import child_env, torchrun_command

    script = REPO_ROOT / "benchmarks" / "bench_step_profile.py"
    out = tmp_path / "p.json"
    args = ["--iterations", "2", "3", "--out", str(out), "--", "--config", "configs/model/tiny.yaml",
            "--train-iters", "4", "--lr-warmup-iters", "1", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--seq-length", "64"]
    proc = subprocess.run(torchrun_command(1, script, args), capture_output=True, text=True, timeout=300,
                          env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "p.rank0.json").read_text())
    assert report["iterations"] == [2, 3] and report["rank"] == 0
    assert 0 < report["wall_ms"] and max(report["host_ms_per_thread"].values()) > 0
    assert report["top_ops"] and all(op["calls"] > 0 for op in report["top_ops"])
    import torch

    if not torch.cuda.is_available():  # no CUDA activity: nothing invented
        assert report["gpu_busy_ms"] == 0 and report["kernels"] == 0
    gap = subprocess.run([sys.executable, str(script), "--iterations", "2", "4", "--out", str(out), "--"],
                         capture_output=True, text=True, timeout=60, env=child_env(), cwd=REPO_ROOT)
    assert gap.returncode == 2 and "consecutive training iterations" in gap.stderr  # wall and profile: same steps
