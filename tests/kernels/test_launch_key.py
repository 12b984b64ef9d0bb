"""agoq.kernels.fastlaunch.arg_key: the key FastKernel caches compiled kernels under partitions runtime
arguments at least as finely as Triton's own specialization, so a cached compiled kernel is the one
Triton would pick (constexprs are keyed by value; the launcher's caching and fall-backs are tested in
tests/unit/test_fastlaunch.py).

The partition is checked against Triton's C++ specializer of the installed Triton (3.8 here) and, with
``AGOQ_XCOMPILE_TRITON=/tmp/t36`` (a directory holding Triton 3.6, as tests/kernels/test_xcompile.py),
against 3.6 in a subprocess. On GPU, tests/gpu/test_fp8_linear_gpu.py and tests/gpu/test_saved_act_gpu.py
compare direct and dispatched launches bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agoq.kernels.fastlaunch import arg_key

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
        groups.setdefault(arg_key(a), set()).add(repr(spec(a)))
    return [f"{k}: {v}" for k, v in groups.items() if len(v) > 1]


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
from tests.kernels.test_launch_key import _partition_violations, _triton_spec
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
