"""House rule 2, one typed config: below the trainer, agoq's code reads ``agoq.config.AgoqConfig`` (or a
section of it), never an argparse Namespace or the environment (AST scan of agoq/: only agoq/train, the
trainer,
reads the environment, plus the short list of argued exceptions below); the config is frozen, built by one
function with one set of defaults, and survives the JSON a checkpoint saves."""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest

from agoq.config import AgoqConfig
from agoq.config.sections import GradsConfig, OptimizerOptions, PolicyConfig
from agoq.config.values import DEFAULT_MOMENTS
from agoq.testing.procs import REPO_ROOT

AGOQ = REPO_ROOT / "agoq"

# The reference trainer (every module of the package): it parses the command line, reads torchrun's environment,
# keeps Megatron's own flags on its Namespace and builds the config it passes below.
TRAINER_PACKAGE = "agoq/train/"
# The tools' entry points: they parse command lines (a Namespace) and build the config.
ENTRY_POINTS = {
    "agoq/plan/__main__.py": "python -m agoq.plan: the planner's command line",
    "agoq/cli/flags.py": "the trainer's flags (agoq.cli): policy_path of the parsed flags",
    "agoq/cli/optim_args.py": "the trainer's flags (agoq.cli): checks of the parsed optimizer flags",
    "agoq/cli/graph_args.py": "the trainer's flags (agoq.cli): checks of the parsed CUDA-graph flags",
    "agoq/cli/seqpar_args.py": "the trainer's flags (agoq.cli): checks of the parsed sequence-parallel flags",
    "agoq/testing/xcompile.py": "python -m agoq.testing.xcompile: a tool's command line",
    "agoq/convert/__main__.py": "python -m agoq.convert: a tool's command line",
}
# Environment reads outside the trainer package, each argued; everything else (the plugin, kernels, ops, ...)
# takes what the environment said as an argument: torchrun's variables as agoq.megatron.runtime.LaunchInfo,
# AGOQ_TRITON_FAST_LAUNCH through fastlaunch.set_fast_launch, TRITON_INTERPRET as AgoqConfig.triton_interpret
# (agoq.train.environment reads them), and Triton's interpreter switch from Triton (triton.knobs).
ENV_READERS = {
    "agoq/convert/__main__.py": "a command line's launch code, the counterpart of scripts/pretrain_llama.py: "
                                "AGOQ_SHOW_KNOWN_WARNINGS before torch loads (torchrun's variables it takes from "
                                "agoq.train.environment)",
    "agoq/testing/procs.py": "test harness: a child process gets the parent's environment plus the checkout on "
                             "PYTHONPATH, so copying os.environ is its job",
    "agoq/testing/dist.py": "test harness: a rank forked by the fork server starts with the server's environment, "
                            "so handing it the caller's os.environ is its job",
}
NAMESPACE_NAMES = ("args", "namespace", "ns", "flags")


def _reads(path) -> tuple[list[str], list[str]]:
    """(Namespace reads, environment reads) of one file, as 'line: code'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    namespace, environ = [], []
    for node in ast.walk(tree):
        where = f"{node.lineno}: {ast.unparse(node)[:80]}" if hasattr(node, "lineno") else ""
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "vars")
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in NAMESPACE_NAMES):
            namespace.append(where)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in NAMESPACE_NAMES and isinstance(node.ctx, ast.Load)):
            namespace.append(where)
        elif isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            environ.append(where)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            environ.append(where)
    return namespace, environ


def _library_files():
    for path in sorted(AGOQ.rglob("*.py")):
        yield path.relative_to(REPO_ROOT).as_posix(), path


def test_library_code_reads_no_namespace_and_no_environment_ast_scan():
    offenders = []
    for rel, path in _library_files():
        if rel.startswith(TRAINER_PACKAGE):
            continue
        namespace, environ = _reads(path)
        if rel not in ENTRY_POINTS:
            offenders += [f"{rel}:{w} (Namespace)" for w in namespace]
        if rel not in ENV_READERS:
            offenders += [f"{rel}:{w} (environment)" for w in environ]
    assert offenders == [], "read AgoqConfig (agoq.config) instead:\n" + "\n".join(offenders)


def test_the_scan_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom os import environ\n\ndef f(args):\n"
                   "    return getattr(args, 'agoq_grads', None), args.lr, os.environ.get('X'), os.getenv('Y')\n")
    namespace, environ = _reads(bad)
    assert len(namespace) == 2 and len(environ) == 3


def test_exemptions_name_existing_files():
    for rel in {**ENV_READERS, **ENTRY_POINTS}:
        assert (REPO_ROOT / rel).is_file(), rel
    assert (REPO_ROOT / TRAINER_PACKAGE / "__init__.py").is_file()


def test_every_environment_exemption_is_used():
    """An exemption whose file no longer reads the environment is stale: drop it, so the list stays the short
    list of real readers."""
    stale = [rel for rel in ENV_READERS if not _reads(REPO_ROOT / rel)[1]]
    assert stale == []


def test_the_trainer_is_where_the_namespace_is_read():
    """The exemption is not vacuous: the trainer package does read its Namespace and the environment."""
    reads = [_reads(path) for path in sorted((REPO_ROOT / TRAINER_PACKAGE).glob("*.py"))]
    assert any(namespace for namespace, _ in reads) and any(environ for _, environ in reads)


def test_config_is_frozen_section_by_section():
    config = AgoqConfig.from_flags({"agoq_optimizer": "adamw"})
    for obj, name in ((config, "enabled"), (config.optimizer, "kind"), (config.grads, "format"),
                      (config.policy, "path"), (config.activations, "recompute"), (config.fp8, "recipe")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)


def test_config_round_trips_through_checkpoint_json():
    config = AgoqConfig.from_flags({"agoq_optimizer": "lion", "agoq_moments": "fp8", "agoq_grads": "int8_b256",
                                    "agoq_grads_mode": "reduce", "agoq_smooth_swiglu": "per-channel",
                                    "recompute_granularity": "full", "agoq_policy": "configs/policy/int8.yaml",
                                    "agoq_device": "cpu"})
    saved = json.loads(json.dumps(config.as_dict()))
    assert AgoqConfig.from_dict(saved) == config  # the policy spec was not loaded here
    assert AgoqConfig.from_dict(saved).as_dict() == saved


def test_one_builder_one_set_of_defaults():
    """The trainer's parse_args, the planner and the memory report build with AgoqConfig.from_flags."""
    from agoq.plan.__main__ import config_of
    from agoq.train.args import parse_args

    trainer = parse_args([]).agoq_config
    planner = config_of({})
    assert trainer.optimizer == planner.optimizer == OptimizerOptions()
    assert trainer.optimizer.moments == DEFAULT_MOMENTS == "flash"
    assert trainer.grads == planner.grads == GradsConfig()
    assert trainer.policy.spec is not None and planner.policy == PolicyConfig()  # the trainer loads it once


def test_policy_grads_and_fp8_resolve_under_the_flags(tmp_path):
    from agoq.policy import load_policy

    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\ndefault: {activations: bf16, grads: int8_b256}\n"
                      "fp8: {smooth_swiglu: per-token}\n")
    spec = load_policy(policy)
    assert AgoqConfig.from_flags({}, policy=spec).grads.format_name == "int8_b256"
    assert AgoqConfig.from_flags({"agoq_grads": "int4_b128"}, policy=spec).grads.format_name == "int4_b128"
    assert AgoqConfig.from_flags({}, policy=spec).fp8.smooth_swiglu == "per-token"
    assert AgoqConfig.from_flags({"agoq_disable": True}, policy=spec).grads.format is None


@pytest.mark.parametrize("flags, named", [
    ({"agoq_grads": "uint8_b256"}, "--agoq-grads uint8_b256"),
    ({"agoq_grads_error_feedback": True}, "--agoq-grads-error-feedback needs --agoq-grads"),
    ({"agoq_grads": "int8_b256", "grad_reduce_in_bf16": True}, "--grad-reduce-in-bf16 with --agoq-grads"),
    ({"agoq_gradient_release": True}, "--agoq-gradient-release conflicts with --agoq-optimizer torch"),
    ({"agoq_optimizer": "adamw", "agoq_moments": "a,b,c"}, "--agoq-moments"),
    ({"agoq_optimizer": "adam"}, "--agoq-optimizer 'adam'"),
    ({"recompute_num_layers": 0}, "--recompute-num-layers"),
])
def test_errors_name_the_flag(flags, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        AgoqConfig.from_flags(flags)
