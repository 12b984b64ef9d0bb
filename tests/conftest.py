"""Shared pytest configuration: markers are declared in pyproject.toml; capability skips live here.

Parallel runs (pytest-xdist, ``scripts/run_tests.sh`` passes ``-n 2 --dist loadgroup``): a test that uses a
module- or class-scoped fixture is put in one xdist group per module, so the fixture is built once, on one
worker (a module fixture may hold a whole torchrun training run). Every other test is scheduled on its own.
"""

import os
from pathlib import Path

import pytest

# One OpenMP thread per process (unless the caller sets it), for this process and every child it starts
# (child_env copies os.environ): read when torch loads, so set before any test module imports torch. With two
# xdist workers and their children on the 2-core CI machine, torch's default of 2 intra-op threads per process
# oversubscribes the cores and the waiting threads burn them. Measured under load: a 1-rank 6-iteration
# pretrain_llama.py launch trained in 13-22 s (19-28 s CPU) with 2 threads against 1-3 s (7 s CPU) with 1;
# on a quiet machine, 7 in-process Megatron/unit files under -n 2: 146 -> 118 CPU-s. torchrun already does
# this for >= 2 ranks per node and spawn_ranks sets 1 thread per rank. Runs compared bit for bit run under the
# same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
_GROUPED_SCOPES = ("module", "class", "package")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Skip (never exit) tests whose hardware is missing; the reason says what to run instead. Group tests
    that share a module-scoped fixture (see the module docstring)."""
    try:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a hard dependency
        num_gpus = 0
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: pytest -m gpu on a GPU machine"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs >= 2 CUDA GPUs"))
        if "kernels" in item.keywords and num_gpus < 1 and not interpret:
            item.add_marker(
                pytest.mark.skip(reason="Triton kernel test: run with TRITON_INTERPRET=1 in its own process")
            )
        group = _shared_fixture_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")  # after xdist's hook
def pytest_collection_modifyitems_xdist_groups(config, items):
    """pytest-xdist 3.8's ``--dist loadgroup`` appends ``@group`` to ``item._nodeid``, which pytest >= 9.2 no
    longer reads (node ids are ``item._id``): without this the marks are ignored and a module fixture is
    built on every worker. Appends the suffix the same way where xdist's did not take."""
    if not config.getoption("loadgroup", default=False):  # set on xdist workers only
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            _set_nodeid(item, f"{item.nodeid}@{'_'.join(names)}")


def _set_nodeid(item, nodeid: str) -> None:
    try:
        from _pytest.nodeid import NodeId  # pytest >= 9.2
    except ImportError:  # older pytest: xdist's own hook already worked, this is not reached
        item._nodeid = nodeid
        return
    item._id = NodeId.parse(nodeid)


def _shared_fixture_group(item) -> str | None:
    """The module path if ``item`` uses (directly or through other fixtures) a fixture wider than a
    function and narrower than the session; None otherwise."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for defs in info.name2fixturedefs.values():
        if defs and defs[-1].scope in _GROUPED_SCOPES:
            return item.nodeid.split("::", 1)[0]
    return None


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def agoq_cache(tmp_path_factory) -> Path:
    """One ``AGOQ_CACHE`` for the whole run, shared by the xdist workers: the default dataset (corpus +
    tokenizer, ~13 s on 2 cores) is built once, under the file lock of agoq.train.data, not once per
    test. Tests of the cache itself (tests/megatron/test_data.py) use their own directories."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' common directory (each worker's basetemp is popen-gwN below it)
    path = base / "agoq_cache"
    path.mkdir(exist_ok=True)
    return path
