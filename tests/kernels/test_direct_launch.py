"""agoq.kernels.direct_launch: the agoq key partitions launches at least as finely as Triton's own
specialization (so a cached compiled kernel is the one Triton would pick), and the launcher's caching
and fall-backs (CPU, with a stand-in for Triton's JITFunction / CompiledKernel).

The partition is checked against Triton's C++ specializer of the installed Triton (3.8 here) and, with
``AGOQ_XCOMPILE_TRITON=/tmp/t36`` (a directory holding Triton 3.6, as tests/kernels/test_xcompile.py),
against 3.6 in a subprocess. On GPU, tests/gpu/test_fp8_linear_gpu.py compares direct and dispatched
launches of the FP8 casts bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agoq.kernels import direct_launch as dl

REPO_ROOT = Path(__file__).resolve().parents[2]
_INTS = [0, 1, 2, 15, 16, 17, 31, 32, 48, 1024, 1025, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 16, 2**32,
         2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16, 2**64 - 1, -1, -16, -17, -(2**31), -(2**31) - 16, -(2**63)]
_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.uint8]


def _sample_args():
    """Tensors of several dtypes at every byte offset 0..31 of one allocation, and ints around every
    boundary Triton knows (1, multiples of 16, int32 / uint64 ranges)."""
    base = torch.zeros(256, dtype=torch.uint8)
    tensors = []
    for dtype in _DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        for offset in range(0, 32, size):
            tensors.append(base[offset: offset + 64].view(dtype))
    return tensors + _INTS + [True, False]


def _partition_violations(spec) -> list[str]:
    groups: dict = {}
    for a in _sample_args():
        groups.setdefault(dl.arg_key(a), set()).add(repr(spec(a)))
    return [f"{k}: {v}" for k, v in groups.items() if len(v) > 1]


def test_launch_key_is_the_per_argument_key():
    args = _sample_args() + [2.5, None, "constexpr"]
    assert dl.launch_key(args) == tuple(map(dl.arg_key, args))


def _triton_spec():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))  # what JITFunction's binder passes (no GPU needed)
    return lambda a: native_specialize_impl(backend, a, False, True, True)


def test_agoq_key_is_at_least_as_fine_as_tritons_specialization():
    assert _partition_violations(_triton_spec()) == []


def test_agoq_key_separates_what_triton_separates_in_the_samples():
    """Sanity of the check itself: the samples do hit several Triton specializations."""
    spec = _triton_spec()
    kinds = {repr(spec(a)) for a in _sample_args()}
    assert {"('*bf16', 'D')", "('*bf16', '')", "('constexpr', 1)", "('i32', 'D')", "('i64', '')",
            "('u64', 'D')"} <= kinds


_T36_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import triton
assert triton.__version__.startswith("3.6"), triton.__version__
from tests.kernels.test_direct_launch import _partition_violations, _triton_spec
bad = _partition_violations(_triton_spec())
print("VIOLATIONS", bad)
sys.exit(1 if bad else 0)
"""


def test_agoq_key_partition_with_triton_3_6():
    path = os.environ.get("AGOQ_XCOMPILE_TRITON")
    if not path or not os.path.isdir(os.path.join(path, "triton")):
        pytest.skip("set AGOQ_XCOMPILE_TRITON to a directory holding Triton 3.6 (e.g. /tmp/t36)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, str(REPO_ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _T36_SCRIPT.format(root=str(REPO_ROOT))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ launcher logic (stand-ins) ----

class _FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *call):
        self.log.append(("direct", call))


class _FakeJIT:
    """JITFunction stand-in: ``fn[grid](*args, **options)`` records the call and returns one compiled
    kernel per distinct Triton-like key."""

    def __init__(self, num_params):
        self.params = [None] * num_params
        self.pre_run_hooks = []
        self.log, self.compiled = [], {}

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("dispatch", grid, args, options))
            return self.compiled.setdefault(tuple(map(dl.arg_key, args)), _FakeCompiled(self.log))
        return launch


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(dl, "_enabled", True)
    monkeypatch.setattr(dl, "_current_device", lambda: 0)
    monkeypatch.setattr(dl, "_stream_getter", lambda: (lambda device: 1234))
    monkeypatch.setattr(dl, "_hooks_registered", lambda: False)


def test_first_call_dispatches_then_direct_with_the_same_arguments(fake_cuda):
    fn = _FakeJIT(3)
    launcher = dl.DirectLauncher(fn, num_warps=4)
    x = torch.zeros(32, dtype=torch.bfloat16)
    launcher((2, 3), (x, 64, "CONST"))
    launcher((5, 1), (x, 128, "CONST"))  # same key: 64 and 128 are both multiples of 16
    assert [e[0] for e in fn.log] == ["dispatch", "direct"]
    assert fn.log[0][3] == {"num_warps": 4}
    assert fn.log[1][1] == (5, 1, 1, 1234, "fn", "meta", None, None, None, x, 128, "CONST")
    assert (launcher.dispatch_calls, launcher.direct_calls) == (1, 1)


@pytest.mark.parametrize("change", ["misaligned", "int_one", "int_odd", "dtype", "constexpr"])
def test_a_different_specialization_dispatches_again(fake_cuda, change):
    fn = _FakeJIT(3)
    launcher = dl.DirectLauncher(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    launcher((1,), (x, 64, "A"))
    other = {"misaligned": (x[1:], 64, "A"), "int_one": (x, 1, "A"), "int_odd": (x, 65, "A"),
             "dtype": (x.view(torch.float16), 64, "A"), "constexpr": (x, 64, "B")}[change]
    launcher((1,), other)
    assert [e[0] for e in fn.log] == ["dispatch", "dispatch"]


def test_disabled_hooks_and_wrong_arity_fall_back(fake_cuda, monkeypatch):
    fn = _FakeJIT(2)
    launcher = dl.DirectLauncher(fn)
    x = torch.zeros(64)
    launcher((1,), (x, 16))
    previous = dl.set_direct_launch(False)
    try:
        launcher((1,), (x, 16))
    finally:
        dl.set_direct_launch(previous)
    monkeypatch.setattr(dl, "_enabled", True)
    monkeypatch.setattr(dl, "_hooks_registered", lambda: True)  # a profiler registered a launch hook
    launcher((1,), (x, 16))
    monkeypatch.setattr(dl, "_hooks_registered", lambda: False)
    fn.pre_run_hooks.append(lambda *a, **k: None)
    launcher((1,), (x, 16))
    assert [e[0] for e in fn.log] == ["dispatch"] * 4
    with pytest.raises(TypeError, match="2 parameters"):
        launcher((1,), (x,))
