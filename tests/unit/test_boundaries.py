"""House rule 1: layers by what code may know. Only agoq/megatron imports megatron; agoq.policy and
agoq.formats import no torch; importing agoq initialises no CUDA."""

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
    # the converter's package: megatron only through agoq.megatron.hf_checkpoint, imported when a command runs
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


def test_only_agoq_megatron_imports_megatron_ast_scan():
    offenders = []
    for path in AGOQ.rglob("*.py"):
        if path.relative_to(AGOQ).parts[0] == "megatron":
            continue
        if any(name == "megatron" or name.startswith("megatron.") for name in _imported_modules(path)):
            offenders.append(str(path.relative_to(REPO_ROOT)))
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
