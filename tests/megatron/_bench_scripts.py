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


def megatron_lm_bench(tmp_path_factory) -> tuple:
    """(benchmarks/bench_megatron_lm.py, a child environment with its own agoq cache, the default dataset) for the GPU
    tests that run Megatron-LM's trainer beside pretrain_llama.py (skips without megatron.training)."""
    import pytest

    from agoq.testing.procs import child_env

    pytest.importorskip("megatron.training", reason="needs megatron-core 0.19.2 (megatron.training)")
    bench = load_bench_script("bench_megatron_lm")
    env = child_env(AGOQ_CACHE=str(tmp_path_factory.mktemp("agoq_cache")), OMP_NUM_THREADS="2")
    return bench, env, bench.default_data(env)
