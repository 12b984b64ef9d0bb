"""House rule 1: layers by what code may know. Only the plugin (agoq/megatron) imports megatron; the reference
trainer (agoq/train, the plugin's client) reaches megatron-core only through the plugin's functions; the plugin has
no command line and no training loop, and no library package imports the trainer; agoq.policy and agoq.formats import
no torch; importing agoq initialises no CUDA."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from agoq.testing.procs import REPO_ROOT, child_env

AGOQ = REPO_ROOT / "agoq"

# package -> top-level modules it must not import (architecture.md 8.3)
FORBIDDEN = {
    "agoq.policy": ("torch", "triton", "megatron"),
    "agoq.formats": ("torch", "triton", "megatron"),
    "agoq.ref": ("triton", "megatron"),
    "agoq.kernels": ("megatron",),
    "agoq.ops": ("megatron",),
    "agoq.optim": ("megatron",),
    "agoq.comm": ("megatron",),
    "agoq.data": ("megatron",),
    "agoq.testing": ("megatron",),
    "agoq.config": ("torch", "megatron"),
    # the trainer's flags and config-file loader, shared with python -m agoq.plan: argparse and yaml only
    "agoq.cli": ("torch", "megatron"),
    "agoq.plan": ("torch", "megatron"),
    # the converter's package: megatron only through agoq.megatron.ckpt.hf_checkpoint, imported when a command runs
    "agoq.convert": ("megatron", "transformers", "safetensors", "tokenizers"),
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


MEGATRON_PACKAGES = ("megatron",)  # agoq/megatron: the plugin, the one package that imports megatron
# The trainer, relative to agoq/: outside the plugin, so it needs no exception; it imports no megatron (the rule
# below holds wherever it lives) and reads megatron-core through agoq.megatron's functions.
TRAINER_DIR = ("train",)

# The plugin (agoq/megatron) must not hold a trainer: no command line (argparse), no training loop (running
# Megatron's forward/backward schedules or an LR schedule is the trainer's job), no import of the trainer.
PLUGIN_FORBIDDEN_MODULES = ("argparse", "agoq.train")
PLUGIN_FORBIDDEN_NAMES = ("get_forward_backward_func", "OptimizerParamScheduler", "ArgumentParser")
# Modules outside agoq/train that may import it: command-line tools above the trainer (python -m agoq.convert
# filters the trainer's known start-up warnings; python -m agoq.megatron_lm runs a Megatron-LM script through agoq's
# door, agoq.train.megatron_lm_door). python -m agoq.plan takes the trainer's flags and --config files from
# agoq.cli, below the trainer, and must not reach up into it.
TRAINER_IMPORTERS = ("agoq/convert/__main__.py", "agoq/megatron_lm.py")
# Plugin files that name a training loop's parts, each with its reason (a stale entry fails). None: megatron-core's
# schedule and LR schedule reach the trainer from its entry script (agoq.train.megatron_setup.MegatronLoop).
PLUGIN_EXCEPTIONS: dict[str, str] = {}


def _is_module(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def _plugin_offences(path: Path) -> list[str]:
    """'line: what' for each import of a forbidden module or use of a forbidden name in one file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if any(_is_module(a.name, m) for m in PLUGIN_FORBIDDEN_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if any(_is_module(node.module, m) for m in PLUGIN_FORBIDDEN_MODULES):
                found.append(f"{node.lineno}: from {node.module} import ...")
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name in PLUGIN_FORBIDDEN_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr in PLUGIN_FORBIDDEN_NAMES:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in PLUGIN_FORBIDDEN_NAMES:
            found.append(f"{node.lineno}: {node.id}")
    return found


def _in_trainer(path: Path) -> bool:
    return path.relative_to(AGOQ).parts[:len(TRAINER_DIR)] == TRAINER_DIR


def test_only_agoq_megatron_imports_megatron_ast_scan():
    """Only the plugin imports megatron; the trainer is not the plugin wherever it lives (also inside agoq/megatron),
    and reads megatron-core through agoq.megatron's functions (runtime, configs, datasets, optimizer,
    megatron_training)."""
    offenders = []
    for path in AGOQ.rglob("*.py"):
        if path.relative_to(AGOQ).parts[0] in MEGATRON_PACKAGES and not _in_trainer(path):
            continue
        if any(_is_module(name, "megatron") for name in _imported_modules(path)):
            offenders.append(str(path.relative_to(REPO_ROOT)))
    assert offenders == [], "import megatron-core through a function of agoq.megatron:\n" + "\n".join(offenders)


def test_plugin_has_no_command_line_and_no_training_loop_ast_scan():
    """agoq/megatron is the plugin only: argparse, the schedules' driver, the LR schedule and
    agoq.train belong to the trainer (agoq/train)."""
    offenders = [f"{path.relative_to(REPO_ROOT)}:{where}"
                 for path in sorted((AGOQ / "megatron").rglob("*.py")) if not _in_trainer(path)
                 if path.relative_to(REPO_ROOT).as_posix() not in PLUGIN_EXCEPTIONS for where in _plugin_offences(path)]
    fix = "move it to agoq/train (the trainer) or take it as an argument"
    assert offenders == [], fix + ":\n" + "\n".join(offenders)


def test_plugin_exceptions_are_still_needed():
    stale = [rel for rel in PLUGIN_EXCEPTIONS
             if not (REPO_ROOT / rel).is_file() or not _plugin_offences(REPO_ROOT / rel)]
    assert stale == [], f"no longer needed: drop {stale} from PLUGIN_EXCEPTIONS"


def test_no_plugin_module_uses_the_training_parts_it_hands_to_the_trainer():
    users = [path.relative_to(REPO_ROOT).as_posix() for path in sorted((AGOQ / "megatron").rglob("*.py"))
             if not _in_trainer(path) and any(_is_module(name, "agoq.megatron.training_parts")
                                              or name == "agoq.megatron" and "training_parts" in path.read_text()
                                              for name in _imported_modules(path))]
    assert users == []


def test_the_plugin_scan_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import argparse\nfrom agoq.train.args import parse_args\nimport agoq.train\n"
                   "from megatron.core.pipeline_parallel import get_forward_backward_func\n"
                   "from megatron.core import optimizer_param_scheduler as ops\n"
                   "def f():\n    return ops.OptimizerParamScheduler, argparse.ArgumentParser()\n")
    assert len(_plugin_offences(bad)) == 6
    good = tmp_path / "good.py"
    good.write_text("from megatron.core import parallel_state\nimport agoq.config\n")
    assert _plugin_offences(good) == []


def test_no_library_package_imports_the_trainer_ast_scan():
    offenders = []
    for path in AGOQ.rglob("*.py"):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if _in_trainer(path) or rel in TRAINER_IMPORTERS:
            continue
        if any(_is_module(name, "agoq.train") for name in _imported_modules(path)):
            offenders.append(rel)
    assert offenders == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_without_forbidden_modules(package):
    """Import in a fresh interpreter where the forbidden top-level modules cannot be imported."""
    blocked = FORBIDDEN[package]
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
        + f"import importlib, pkgutil\nmod = importlib.import_module({package!r})\n"
        + "for info in pkgutil.walk_packages(getattr(mod, '__path__', []), mod.__name__ + '.'):\n"
        + "    importlib.import_module(info.name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_import_agoq_does_not_initialise_cuda():
    """torchao's lean-import idea: make every CUDA initialisation path raise, then import agoq's CPU-side
    packages (megatron-core itself probes CUDA at import, so agoq.megatron is excluded)."""
    code = (
        "import torch\n"
        "def boom(*a, **k): raise RuntimeError('CUDA initialised at import')\n"
        "torch.cuda.current_device = boom\ntorch.cuda.init = boom\ntorch.cuda._lazy_init = boom\n"
        "import agoq, agoq.config, agoq.formats, agoq.policy, agoq.ref, agoq.kernels, agoq.data\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
