"""--agoq-gradient-release in agoq's Megatron path (agoq/megatron/optim/release.py), one gloo rank on CPU.

Claims checked:
  * a tiny LLaMA trained with release equals the same run without release (Megatron's DDP + fp32
    main_grad buffer + agoq's optimizer in FP32Optimizer) bit for bit: losses and every parameter after
    every step, and the optimizer's step counters. Why exact: with one micro-batch and one rank the
    fp32 main_grad is the bf16 autograd gradient converted exactly (times Megatron's 1/DP = 1.0), and
    agoq's reference step casts the gradient to fp32 either way, so both paths do the same arithmetic;
  * no gradient buffer: no ``main_grad``, no DDP buffers, the measured gradient bytes are 0, and during
    backward at most one parameter's ``.grad`` is alive at a time;
  * every conflicting flag stops the run with a message naming it (table below);
  * a backward inside ``no_sync`` (micro-batch accumulation) and a non-finite gradient raise, naming
    the cause (and the parameter and iteration).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.megatron]

from agoq.testing.procs import TINY_CONFIG  # noqa: E402
from agoq.train.args import parse_args  # noqa: E402

SEQ, MBS, VOCAB, STEPS = 32, 2, 256, 6  # 6 steps at lr 1e-2: the norm gains' fp32-vs-bf16 gradient showed at step 3
VALID = ["--config", str(TINY_CONFIG), "--seq-length", str(SEQ), "--micro-batch-size", str(MBS),
         "--global-batch-size", str(MBS), "--clip-grad", "0", "--agoq-optimizer", "adamw",
         "--lr-warmup-iters", "1", "--train-iters", "10", "--lr", "1e-2", "--agoq-gradient-release"]  # fmt: skip


def _args(extra=(), release=True):
    argv = VALID + list(extra)
    return parse_args(argv if release else [a for a in argv if a != "--agoq-gradient-release"])


def _batches(num_microbatches=1):
    g = torch.Generator().manual_seed(7)
    while True:
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        for _ in range(num_microbatches):
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
                   "position_ids": torch.arange(SEQ).expand(MBS, -1)}


def _build(args, device, release: bool, num_microbatches=1, alive_probe=None):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from agoq.megatron.model import (
        ParallelLayout,
        agoq_layer_spec,
        build_model_chunks,
        llama_transformer_config,
        wrap_ddp,
    )
    from agoq.megatron.optim.release import wrap_release
    from agoq.policy import ScheduleInfo
    from agoq.train.megatron_setup import build_optimizer, build_scheduler, ddp_config
    from agoq.train.training import StepRunner, configure_grad_hooks
    from tests.megatron._tiny import tiny_shape

    dtype = torch.float32 if args.fp32 else torch.bfloat16
    shape = tiny_shape(ffn_hidden_size=192, seq_length=SEQ, vocab_size=VOCAB)  # tiny.yaml's FFN, a wider vocabulary
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=dtype, use_cpu_initialization=True)
    policy = args.agoq_policy  # None: Megatron's modules; a path: agoq's activation storage
    spec = agoq_layer_spec("sdpa", policy=policy,
                           schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=num_microbatches))
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    chunks = build_model_chunks(shape, config, spec, None)
    if alive_probe is not None:  # registered before the release hooks, so it fires first for each param
        for p in chunks[0].parameters():
            p.register_post_accumulate_grad_hook(alive_probe)
    if release:
        model = wrap_release(chunks, config, device)
    else:
        model = wrap_ddp(chunks, config, ddp_config(args, dtype), device)
    configure_grad_hooks(model, config)
    optimizer = build_optimizer(args, model, dtype)
    scheduler = build_scheduler(args, optimizer, OptimizerParamScheduler)
    runner = StepRunner(model_chunks=model, optimizer=optimizer, scheduler=scheduler, device=device,
                        seq_length=SEQ, micro_batch_size=MBS, global_batch_size=MBS * num_microbatches,
                        num_microbatches=num_microbatches, forward_backward_func=get_forward_backward_func())
    return model, optimizer, scheduler, runner


def _train(args, device, release):
    model, optimizer, scheduler, runner = _build(args, device, release)
    data, trace = _batches(), []
    for it in range(1, STEPS + 1):
        runner.iteration = it
        result = runner.run([data])
        assert result.update_successful and result.grad_norm is None  # --clip-grad 0: no norm either way
        trace.append((result.loss, [p.detach().clone() for p in model[0].parameters()]))
    inner = optimizer.optimizer
    steps = {float(inner.state[p]["step"]) for g in inner.param_groups for p in g["params"]}
    return trace, steps, scheduler.num_steps


POLICY_BF16 = str(TINY_CONFIG.parents[1] / "policy" / "bf16.yaml")
POLICY_AGOQ = str(TINY_CONFIG.parents[1] / "policy" / "agoq.yaml")


@pytest.mark.parametrize("extra", [
    ["--agoq-moments", "fp32", "--agoq-master", "fp32", "--agoq-policy", POLICY_BF16],  # plain AdamW states
    ["--agoq-policy", POLICY_BF16],  # FlashOptim defaults: split24 master, companded int8 moments
    ["--agoq-policy", POLICY_AGOQ],  # + agoq's 4-bit activations with norm / SwiGLU recompute in backward
    ["--fp32", "--agoq-policy", POLICY_BF16],  # fp32 params: fp32 grads, no split master
], ids=["fp32-states", "flash", "flash+agoq-activations", "fp32-params"])  # fmt: skip
def test_release_equals_the_buffered_run_bit_for_bit(mcore_world1, extra):
    with_release = _train(_args(extra), mcore_world1, release=True)
    without = _train(_args(extra, release=False), mcore_world1, release=False)
    (trace_r, steps_r, sched_r), (trace_b, steps_b, sched_b) = with_release, without
    for (loss_r, params_r), (loss_b, params_b) in zip(trace_r, trace_b, strict=True):
        assert loss_r == loss_b
        for a, b in zip(params_r, params_b, strict=True):
            assert torch.equal(a, b)
    assert trace_r[0][1][0].ne(trace_r[-1][1][0]).any()  # the weights moved (a no-op would also be "equal")
    assert steps_r == steps_b == {float(STEPS)} and sched_r == sched_b == STEPS * MBS


@pytest.mark.kernels
@pytest.mark.slow
def test_fused_release_equals_the_fused_multi_tensor_run():
    """The GPU path's kernels under Triton's interpreter (own process): release steps each parameter with the
    per-tensor fused kernel, the buffered run with the multi-tensor launches; bit for bit the same (flash
    defaults; ~3.5 min on a 2-core CPU)."""
    import subprocess
    import sys

    from agoq.testing.procs import REPO_ROOT, child_env

    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                           "-k", "bit_for_bit and flash and not agoq"], capture_output=True, text=True,
                          timeout=1200, cwd=REPO_ROOT, env=child_env(TRITON_INTERPRET="1"))  # fmt: skip
    assert proc.returncode == 0 and "1 passed" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


def test_no_gradient_buffer_and_one_gradient_alive_at_a_time(mcore_world1):
    from agoq.train.memory_report import static_breakdown_gib

    alive = []

    def probe(_p):  # bytes of every .grad alive when this parameter's gradient is final
        alive.append(sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))

    args = _args(["--agoq-policy", POLICY_BF16])
    model, optimizer, _, runner = _build(args, mcore_world1, release=True, alive_probe=probe)
    params = list(model[0].parameters())
    runner.iteration = 1
    runner.run([_batches()])
    largest = max(p.numel() * p.element_size() for p in params)
    assert len(alive) == len(params) and max(alive) <= largest
    assert all(p.grad is None and not hasattr(p, "main_grad") for p in params)
    assert model[0].buffers == [] and static_breakdown_gib(model, optimizer)["grads_gib"] == 0.0
    # the same probe on Megatron's DDP: .grad is freed there too, but into the full fp32 main_grad buffer
    model_b, optimizer_b, _, runner_b = _build(_args(["--agoq-policy", POLICY_BF16], release=False),
                                               mcore_world1, release=False)
    runner_b.run([_batches()])
    assert static_breakdown_gib(model_b, optimizer_b)["grads_bytes_per_param"] == pytest.approx(4.0, rel=0.01)


CONFLICTS = [
    (["--agoq-optimizer", "torch"], "--agoq-optimizer torch"),
    (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--agoq-grads", "int8_b256"], "--agoq-grads int8_b256"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2"),
    (["--clip-grad", "1.0"], "--clip-grad 1.0"),
    (["--overlap-grad-reduce"], "--overlap-grad-reduce"),
]


@pytest.mark.parametrize("extra,named", CONFLICTS, ids=[c[1].split()[0].lstrip("-") for c in CONFLICTS])
def test_each_conflicting_flag_is_named(extra, named, capsys):
    with pytest.raises(SystemExit):
        _args(extra)
    err = capsys.readouterr().err
    assert "--agoq-gradient-release conflicts with" in err and named in err, err


def test_the_batch_is_checked_against_the_real_data_parallel_size_before_torch_loads():
    """Micro-batches per step depend on the data-parallel size, known from the world size in the script's preflight:
    one process accumulating 4 micro-batches is named as accumulation, two ranks with one micro-batch each as DP."""
    from agoq.train.preflight import preflight

    accumulating = _args(["--global-batch-size", str(4 * MBS)])  # parsing alone cannot tell: no error yet
    with pytest.raises(ValueError, match="gradient accumulation over 4 micro-batches"):
        preflight(accumulating, world_size=1)
    with pytest.raises(ValueError, match="data-parallel size 2"):  # not "accumulation over 2 micro-batches"
        preflight(_args(["--global-batch-size", str(2 * MBS)]), world_size=2)


def test_data_parallel_and_policy_grads_are_named(tmp_path, capsys):
    from agoq.cli.optim_args import check_release_flags

    args = _args(["--global-batch-size", str(2 * MBS)], release=False)  # DP=2 x MBS: one micro-batch each
    args.agoq_gradient_release = True
    with pytest.raises(ValueError, match="data-parallel size 2"):
        check_release_flags(args, data_parallel=2)
    policy = tmp_path / "grads.yaml"  # a policy's `default: {grads: ...}` (the config resolves it at parse time)
    policy.write_text("version: 1\ndefault: {activations: bf16, grads: int8_b256}\n")
    with pytest.raises(SystemExit):
        _args(["--agoq-policy", str(policy)])
    assert "--agoq-gradient-release conflicts with --agoq-grads int8_b256" in capsys.readouterr().err
    check_release_flags(_args())  # the valid setting passes


def test_accumulation_inside_no_sync_raises(mcore_world1):
    args = _args(["--agoq-policy", POLICY_BF16])
    _, _, _, runner = _build(args, mcore_world1, release=True, num_microbatches=2)
    with pytest.raises(RuntimeError, match="inside no_sync"):
        runner.run([_batches(2)])


def test_nonfinite_gradient_raises_with_iteration_and_parameter(mcore_world1):
    args = _args(["--agoq-policy", POLICY_BF16])
    model, _, _, runner = _build(args, mcore_world1, release=True)
    before = [p.detach().clone() for p in model[0].parameters()]
    runner.iteration, runner.poison["now"] = 5, True
    from agoq.megatron.optim.release import TrainingStopped

    with pytest.raises(TrainingStopped, match=r"non-finite gradient .* of output_layer\.weight at iteration 5"):
        runner.run([_batches()])
    # the first gradient checked (the output layer's) was bad: nothing was updated
    assert all(torch.equal(a, b) for a, b in zip(before, model[0].parameters(), strict=True))


def test_script_prints_a_release_stop_in_one_line(monkeypatch, capsys):
    """The documented stop reaches the user as one line and exit status 1, not as a traceback (issue 21)."""
    import importlib.util

    from agoq.megatron.optim.release import TrainingStopped
    from agoq.testing.procs import PRETRAIN_SCRIPT

    spec = importlib.util.spec_from_file_location("agoq_pretrain_script_release", PRETRAIN_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def stop(*_args, **_kwargs):
        raise TrainingStopped("--agoq-gradient-release: non-finite gradient (NaN/Inf) of w at iteration 3. ...")

    monkeypatch.setattr(script, "pretrain", stop)
    assert script.main(args=_args()) == 1
    err = capsys.readouterr().err
    assert err == ("pretrain_llama.py: stopped: --agoq-gradient-release: non-finite gradient (NaN/Inf) of w at "
                   "iteration 3. ...\n")


@pytest.mark.dist
def test_script_release_trains_like_the_buffered_run_and_resumes(tmp_path, agoq_cache):
    """scripts/pretrain_llama.py, one CPU rank: the logged losses with release equal the buffered run's; a
    checkpoint saved with release (at iteration 3 of that run) resumes identically with release, and without
    it (same format)."""
    from agoq.testing.procs import child_env, iteration_records, run_pretrain

    env = child_env(AGOQ_CACHE=str(agoq_cache))
    base = ["--config", str(TINY_CONFIG), "--micro-batch-size", "2", "--global-batch-size", "2", "--clip-grad", "0",
            "--agoq-optimizer", "adamw", "--train-iters", "6", "--lr-warmup-iters", "1", "--lr", "1e-2"]
    release = base + ["--agoq-gradient-release"]

    def losses(args):
        proc = run_pretrain(1, args, env=env)
        return proc, [(r["iteration"], r["loss"]) for r in iteration_records(proc.stdout)]

    ckpt = tmp_path / "ckpt"
    _, buffered = losses(base)
    proc, released = losses(release + ["--save", str(ckpt), "--save-interval", "3"])
    assert released == buffered and len(released) == 6
    assert released[-1][1] < released[0][1]  # it trains
    assert "gradient release: no gradient buffer" in proc.stdout
    assert "gradients: no buffer (--agoq-gradient-release" in proc.stdout
    assert "no gradient buffer (gradient release)" in proc.stdout  # the planner's line counts 0 grad bytes
    assert "grads 0.000" in proc.stdout  # measured breakdown: no gradient bytes held
    assert (ckpt / "iter_0000003").is_dir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3\n")  # resume from iteration 3's checkpoint
    assert losses(release + ["--load", str(ckpt)])[1] == released[3:]
    assert losses(base + ["--load", str(ckpt)])[1] == buffered[3:]


@pytest.mark.dist
@pytest.mark.extended  # the release path itself: test_script_release_trains_like_the_buffered_run_and_resumes
def test_bench_pretrain_release_suite_smoke(tmp_path, agoq_cache):
    """benchmarks/bench_pretrain.py --suite release --smoke (CPU): the three variants run, the release one holds
    no gradient bytes (measured breakdown), and every variant carries the planner's predicted peak."""
    import json
    import subprocess
    import sys

    from agoq.testing.procs import REPO_ROOT, child_env

    out = tmp_path / "release.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_pretrain.py"), "--suite", "release",
                           "--smoke", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env=child_env(AGOQ_CACHE=str(agoq_cache)))  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = {s["name"].rsplit("/", 1)[1]: s for s in json.loads(out.read_text())["summary"]}
    assert sorted(summary) == ["agoq adamw, bf16 grad buffer", "agoq adamw, fp32 grad buffer",
                               "agoq adamw, gradient release"]
    fp32, bf16, release = (summary[f"agoq adamw, {k}"] for k in ("fp32 grad buffer", "bf16 grad buffer",
                                                                "gradient release"))
    assert release["grads_gib"] == 0.0 < bf16["grads_gib"] < fp32["grads_gib"]
    report = json.loads(out.read_text())
    # the predicted peak is recorded next to the measured one (the release step's term, the largest parameter's
    # bf16 gradient + one non-finite check slice, against the 1B and 8B GPU runs:
    # tests/megatron/test_plan_peak.py::test_gradient_release_counts_no_gradient_buffer, benchmarks/validate_planner.py)
    assert all(v["predicted_memory"]["peak_gib"][0] > 0 for v in report["variants"])


@pytest.mark.dist
def test_script_with_two_data_parallel_ranks_stops_naming_it(agoq_cache):
    """The data-parallel size is known only at start-up: two ranks stop before any model is built."""
    from agoq.testing.procs import child_env, iteration_records, run_pretrain

    # a global batch that two data-parallel ranks can split (the batch check comes first since fa2fdb7)
    args = ["--config", str(TINY_CONFIG), "--micro-batch-size", "2", "--global-batch-size", "4", "--clip-grad", "0",
            "--agoq-optimizer", "adamw", "--agoq-gradient-release", "--train-iters", "2", "--lr-warmup-iters", "1"]
    proc = run_pretrain(2, args, env=child_env(AGOQ_CACHE=str(agoq_cache)), check=False)
    assert proc.returncode != 0
    assert "--agoq-gradient-release conflicts with data-parallel size 2" in proc.stderr, proc.stderr[-3000:]
    assert iteration_records(proc.stdout) == []
