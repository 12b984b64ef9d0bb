"""House rule 2 at the command lines: ``python -m agoq.plan`` and ``python -m agoq.convert`` parse argv once into a
frozen, typed request (agoq.plan.request.PlanRequest, agoq.convert.request.ImportRequest / ExportRequest); only
their ``request_of`` reads the argparse Namespace, and a bad value raises naming its flag."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from agoq.convert import __main__ as convert
from agoq.convert.request import ExportRequest, ImportRequest
from agoq.plan import __main__ as plan
from agoq.plan.memory import GIB
from agoq.plan.request import PlanRequest
from agoq.testing.procs import REPO_ROOT

EVERY_PLAN_FLAG = ["--config", "m.yaml", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                   "--num-query-groups", "2", "--ffn-hidden-size", "128", "--vocab-size", "1000",
                   "--tensor-model-parallel-size", "1",
                   "--pipeline-model-parallel-size", "2", "--dp", "3", "--micro-batch-size", "1",
                   "--global-batch-size", "6", "--seq-length", "128", "--num-layers-per-virtual-pipeline-stage", "1",
                   "--use-distributed-optimizer", "--agoq-optimizer", "adamw", "--agoq-moments", "fp8",
                   "--agoq-master", "split24", "--agoq-grads", "int8_b256", "--grad-reduce-in-bf16",
                   "--agoq-gradient-release", "--recompute-granularity", "selective", "--agoq-fp8", "current",
                   "--agoq-smooth-swiglu", "per-token", "--agoq-fp8-bf16-first-layers", "1",
                   "--agoq-fp8-bf16-last-layers", "1", "--memory-budget", "80GiB", "--policies", "a.yaml", "b.yaml",
                   "--out", "o.yaml", "--capacity", "--max-gpus", "4", "--max-mbs", "2",
                   "--tokenizer-model", "t.model", "--make-vocab-size-divisible-by", "64",
                   "--lr", "1e-4", "--data-path", "a", "b"]  # the trainer's flags that change no memory: passed on


def test_plan_request_carries_every_flag_typed():
    request = plan.parse(EVERY_PLAN_FLAG)
    assert isinstance(request, PlanRequest)
    assert request.policies == ("a.yaml", "b.yaml") and request.memory_budget_bytes == 80 * GIB
    assert (request.dp, request.agoq_fp8, request.grad_reduce_in_bf16, request.max_gpus) == (3, "current", True, 4)
    assert (request.tensor_model_parallel_size, request.num_layers_per_virtual_pipeline_stage) == (1, 1)
    assert (request.config, request.tokenizer_model, request.make_vocab_size_divisible_by) == ("m.yaml", "t.model", 64)
    assert request.trainer == (("lr", 1e-4), ("data_path", ("a", "b")))  # typed by the trainer's own flags
    defaults = plan.parse(["--memory-budget", "1e9"])
    assert defaults == PlanRequest(memory_budget="1e9") and defaults.memory_budget_bytes == 10**9


def test_plan_request_is_frozen():
    request = plan.parse(["--memory-budget", "80GiB"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.dp = 2


@pytest.mark.parametrize("field, value, named", [
    ("agoq_optimizer", "adam", "--agoq-optimizer 'adam': choose one of ['torch', 'adamw', 'lion', 'sgd']"),
    ("agoq_fp8", "te", "--agoq-fp8 'te': choose one of ['off', 'current', 'delayed', 'rowwise']"),
    ("recompute_granularity", "block", "--recompute-granularity 'block': choose one of ['full', 'selective']"),
    ("policies", ["a.yaml"], "--policies"),
])  # fmt: skip
def test_plan_request_names_the_flag_of_a_bad_value(field, value, named):
    with pytest.raises(ValueError) as err:
        PlanRequest(memory_budget="80GiB", **{field: value})
    assert named in str(err.value)


def test_plan_memory_budget_error_names_the_flag():
    with pytest.raises(ValueError, match="--memory-budget '80' is 80 bytes"):
        PlanRequest(memory_budget="80").memory_budget_bytes  # noqa: B018


def test_convert_requests_are_typed_and_frozen(tmp_path):
    imp = convert.request_of(convert.build_parser().parse_args(["hf-to-agoq", "hf", "--output", "ckpt"]))
    assert isinstance(imp, ImportRequest) and imp.COMMAND == "hf-to-agoq" and imp.dtype == "auto"
    exp = convert.request_of(convert.build_parser().parse_args(
        ["agoq-to-hf", "ckpt", "--output", "hf", "--max-shard-size", "1000", "--dtype", "fp32"]))
    assert isinstance(exp, ExportRequest) and (exp.max_shard_bytes, exp.dtype, exp.iteration) == (1000, "fp32", None)
    for request, field in ((imp, "output"), (exp, "vocab_size")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(request, field, None)


@pytest.mark.parametrize("make, named", [
    (lambda: ImportRequest(hf_dir="hf", output="o", dtype="fp16"), "--dtype 'fp16': choose one of ['auto', 'bf16',"),
    (lambda: ExportRequest(load_dir="c", output="o", dtype="auto"), "--dtype 'auto': choose one of ['bf16', 'fp32']"),
])  # fmt: skip
def test_convert_request_names_the_flag_of_a_bad_value(make, named):
    with pytest.raises(ValueError) as err:
        make()
    assert named in str(err.value)


def _namespace_readers(rel: str) -> set[str]:
    """Functions of ``rel`` that take or read an argparse Namespace (an argparse.Namespace annotation, or an
    attribute / vars() / getattr() of a name called args / namespace / ns)."""
    names = ("args", "namespace", "ns")
    readers = set()
    for fn in ast.parse((REPO_ROOT / rel).read_text()).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            annotated = isinstance(node, ast.arg) and "Namespace" in ast.unparse(node.annotation or ast.Constant(""))
            read = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names
                    or isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("vars", "getattr") and node.args and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in names)  # fmt: skip
            if annotated or read:
                readers.add(fn.name)
    return readers


@pytest.mark.parametrize("rel", ["agoq/plan/__main__.py", "agoq/convert/__main__.py"])
def test_only_request_of_reads_the_namespace(rel):
    assert _namespace_readers(rel) == {"request_of"}
