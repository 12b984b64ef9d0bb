"""Every benchmarks/bench_pretrain.py suite (GPU and --smoke forms) passes scripts/pretrain_llama.py's own
argument parser and validation: a misspelt flag or a batch that does not divide fails here, on CPU, instead
of minutes into a GPU lease."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from agoq.testing.procs import REPO_ROOT
from agoq.train.args import parse_args

SCRIPT = REPO_ROOT / "benchmarks" / "bench_pretrain.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_pretrain", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_pretrain", module)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


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
