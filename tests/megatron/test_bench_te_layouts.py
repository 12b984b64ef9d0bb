"""benchmarks/bench_te.py's multi-GPU suites (benchmarks/te_layouts.py) as Megatron-LM parses them: every suite row's
command line goes through megatron.training's own parser and validate_args (megatron-core 0.19.2) at its world size,
as a Megatron-LM user's run would, before a GPU lease spends minutes on it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.megatron._bench_scripts import load_bench_script

BENCH = load_bench_script("bench_te")
LAYOUTS = BENCH.te_layouts
ROWS = [(name, row) for suite in LAYOUTS.SUITES.values() for name, row in suite.items()]


@pytest.fixture(scope="module")
def megatron_parser():
    from megatron.training.arguments import add_megatron_arguments

    from agoq.train.megatron_lm import add_agoq_args

    parser = add_agoq_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    parser.add_argument("--bench-json")  # benchmarks/megatron_gpt_upstream.py's _extra_args
    return parser


def test_every_suite_row_parses_and_validates_in_megatron_training(megatron_parser, monkeypatch):
    import megatron.training.arguments as margs

    monkeypatch.setattr(margs, "get_device_arch_version", lambda: 9)  # Hopper: the H100 the plan runs on
    for name, row in ROWS:
        command = BENCH.layout_command(row, 20, Path("/tmp/r.json"), 29500)
        script = command.index(str(BENCH.UPSTREAM))
        args = megatron_parser.parse_args(command[script + 1:])  # an unknown flag exits here
        args.world_size, args.rank, args._is_global_batch_size_explicitly_specified = row.nproc, 0, True
        for key in ("CUDA_DEVICE_MAX_CONNECTIONS",):
            monkeypatch.delenv(key, raising=False)
        for key, value in LAYOUTS.row_env(row).items():
            monkeypatch.setenv(key, value)
        margs.validate_args(args)
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
                args.data_parallel_size) == (row.tp, row.pp, row.cp, row.dp), name
        assert args.use_distributed_optimizer == (row.dp > 1 or "--use-distributed-optimizer" in row.extra), name
        assert args.overlap_grad_reduce == (row.dp > 1) and args.ddp_bucket_size is None, name
        assert args.grad_reduce_in_bf16 == name.endswith("bf16_reduce"), name


def test_tp_and_cp_rows_need_their_environment(megatron_parser, monkeypatch):
    """The check above can fail: without CUDA_DEVICE_MAX_CONNECTIONS=1 Megatron refuses a CP=2 row on Hopper."""
    import megatron.training.arguments as margs

    monkeypatch.setattr(margs, "get_device_arch_version", lambda: 9)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    row = LAYOUTS.SUITES["cp_16k"]["cp_16k/cp2/agoq_te/full"]
    command = BENCH.layout_command(row, 20, Path("/tmp/r.json"), 29500)
    args = megatron_parser.parse_args(command[command.index(str(BENCH.UPSTREAM)) + 1:])
    args.world_size, args.rank, args._is_global_batch_size_explicitly_specified = 2, 0, True
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        margs.validate_args(args)


@pytest.mark.parametrize("name", ["te/fp8_delayed", "agoq_te/full_fp8"])
def test_profiled_rows_parse_in_megatron_training_and_name_the_trace(megatron_parser, name, tmp_path):
    """bench_te.py --profile A B: Megatron-LM's own profiler flags on the one-GPU rows, parsed by megatron.training
    as the run will; the trace path attach_profile reads is where Megatron's trace handler writes it
    (<tensorboard-dir>/../torch_profile/rank-0.json.gz); agoq's own trainer rows are refused with the tool to use."""
    command = BENCH.row_command(name, "1b", 12, 16, Path("/tmp/r.json"), 29500)
    command += BENCH.profile_flags(name, [8, 10], tmp_path)
    args = megatron_parser.parse_args(command[command.index(str(BENCH.UPSTREAM)) + 1:])
    assert (args.profile, args.use_pytorch_profiler, args.profile_step_start, args.profile_step_end,
            args.profile_ranks) == (True, True, 8, 10, [0])
    trace = Path(args.tensorboard_dir) / ".." / "torch_profile" / "rank-0.json.gz"
    row = {}
    BENCH.attach_profile(row, name, tmp_path, None)
    assert row["profile"]["missing"].startswith(f"no trace at {trace.resolve()}")
    with pytest.raises(ValueError, match=r"agoq/full runs .*benchmarks/bench_step_profile.py"):
        BENCH.profile_flags("agoq/full", [8, 10], tmp_path)
