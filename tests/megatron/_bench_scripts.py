"""Import a script of benchmarks/ as a module (benchmarks/ is bench scaffolding, not an installed package).

Loaded once per process under ``benchmarks_<name>`` and registered in ``sys.modules`` before it runs (its
dataclasses look their module up there); every test file that loads the same script shares the module.
"""

from __future__ import annotations

import importlib.util
import sys

from agoq.testing.procs import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"


def load_bench_script(name: str):
    """``benchmarks/<name>.py`` as a module; a missing file raises FileNotFoundError naming it."""
    module_name = f"benchmarks_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark script {path}")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
