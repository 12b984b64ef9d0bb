"""Every launch variant of the fused optimizer step compiles for sm_90 with the GPU's Triton (3.6).

The interpreter (the CPU kernel tier) never runs Triton's front end: a Triton 3.6 CompilationError
(a constexpr reassigned inside ``tl.static_range`` in the NF4 state store) shipped past every CPU
test and failed benchmarks/bench_optim.py on the H100. This test records the launches the module makes
for every state format x master mode x optimizer (agoq.testing.xcompile.optim_calls) and compiles
each distinct variant to a cubin, in a subprocess whose ``triton`` comes from $AGOQ_XCOMPILE_TRITON:

    TRITON_INTERPRET=1 AGOQ_XCOMPILE_TRITON=/tmp/t36 python -m pytest tests/kernels/test_xcompile.py

(the kernels tier runs under the interpreter flag; the subprocess drops it).

About 4 minutes on 2 CPU cores the first time (~625 variants), seconds once Triton's cache holds them.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from agoq.testing.procs import REPO_ROOT
from agoq.testing.xcompile import EXPECTED_TRITON, TRITON_ENV_VAR

TIMEOUT_S = 1200


def _triton_dir() -> str:
    path = os.environ.get(TRITON_ENV_VAR, "")
    if not path:
        pytest.skip(f"set {TRITON_ENV_VAR} to a directory holding Triton {EXPECTED_TRITON} (e.g. /tmp/t36)")
    if not os.path.isdir(os.path.join(path, "triton")):
        pytest.skip(f"{TRITON_ENV_VAR}={path} holds no triton package")
    return path


def _env(triton_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real @jit objects, not interpreted
    env["PYTHONPATH"] = os.pathsep.join([triton_dir, str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          timeout=TIMEOUT_S)  # fmt: skip


def test_optim_kernel_variants_compile_for_sm90():
    env = _env(_triton_dir())
    version = _run(["-c", "import triton; print(triton.__version__)"], env)
    if version.returncode != 0 or not version.stdout.strip().startswith(EXPECTED_TRITON):
        pytest.skip(f"{TRITON_ENV_VAR} gives Triton {version.stdout.strip() or version.stderr[-300:]}, "
                    f"not {EXPECTED_TRITON}")  # fmt: skip
    proc = _run(["-m", "agoq.testing.xcompile", "optim"], env)
    out = proc.stdout + proc.stderr
    failures = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert proc.returncode == 0 and not failures, f"{len(failures)} variants failed:\n" + out[-8000:]
    summary = [line for line in out.splitlines() if "variants compiled" in line]
    assert summary, out[-2000:]
    compiled = int(summary[-1].split(": ")[1].split("/")[0])
    assert compiled >= 400, summary  # the table covers every format x master x optimizer, not a handful


@pytest.mark.parametrize("module", ["swiglu_quant_fwd", "swiglu_quant_bwd"])
def test_swiglu_quant_kernel_variants_compile_for_sm90(module):
    """The saved-activation SwiGLU kernels (agoq.kernels.swiglu_quant): every activation format family x
    dtype (x Smooth-SwiGLU scale mode for the backward kernel) compiles with the GPU's Triton."""
    env = _env(_triton_dir())
    proc = _run(["-m", "agoq.testing.xcompile", module], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FAIL" not in out, out[-8000:]
    assert "variants compiled" in out, out[-2000:]


@pytest.mark.parametrize("module", ["smooth_token_amax", "smooth_channel_amax", "smooth_cast", "fp8_fused_cast"])
def test_smooth_swiglu_fp8_kernel_variants_compile_for_sm90(module):
    """The fused Smooth-SwiGLU FP8 kernels (agoq.kernels.smooth_swiglu_fp8: both amaxes, the cast in every layout,
    per token, per channel and plain (no smoothing), bf16 / fp16) and the ``mul`` variants of agoq.kernels.fp8_fused's
    delayed cast compile with the GPU's Triton (3.6 on 2026-11-26: 1 + 1 + 18 + 12 variants)."""
    env = _env(_triton_dir())
    proc = _run(["-m", "agoq.testing.xcompile", module], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FAIL" not in out, out[-8000:]
    assert "variants compiled" in out, out[-2000:]


@pytest.mark.parametrize("module", ["comm_peer_reduce", "comm_peer_dequantize"])
def test_peer_comm_kernel_variants_compile_for_sm90_with_this_triton(module):
    """The peer transport's reduce / dequantize kernels (agoq.kernels.comm ``*_peer_rows``), one-block rows
    included: Triton passes an int argument equal to 1 as a constant, and ``stride.to(tl.int64)`` on it failed to
    compile on the H100 for a one-block chunk of the peer reduce-to-owners (2026-11-26). A front-end error, so
    this Triton (no $AGOQ_XCOMPILE_TRITON needed) catches it; a few seconds."""
    env = _env(os.environ.get(TRITON_ENV_VAR, ""))
    proc = _run(["-m", "agoq.testing.xcompile", module], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FAIL" not in out, out[-8000:]
    assert "variants compiled" in out, out[-2000:]


def _byte_loads(ops: dict) -> int:
    return sum(n for op, n in ops.items() if re.fullmatch(r"ld\.global(\.[\w:]+)*\.[bsu]8", op))


@pytest.mark.parametrize("module", ["comm_peer_reduce", "comm_peer_dequantize"])
def test_peer_comm_code_loads_are_vectorised_on_aligned_rows(module):
    """The peer kernels read each row at an address from an int64 table, which the compiler cannot see through:
    without agoq.kernels.comm's ALIGNED hint it loads the codes one byte at a time (32 ld.global.b8 per thread and
    row, reduce, Triton 3.6 sm_90). Rows at 16-byte aligned addresses (``rows=aligned`` variants of
    agoq.testing.xcompile.comm_peer_calls) must get vector loads of the codes (ld.global.v4 / v2) and no byte loads;
    a row 8 bytes off (``rows=offset``) must get the unhinted kernel (byte loads), which still compiles. The
    variants' scales are fp32, so every byte load is a code load. This Triton or $AGOQ_XCOMPILE_TRITON's."""
    env = _env(os.environ.get(TRITON_ENV_VAR, ""))
    proc = _run(["-m", "agoq.testing.xcompile", module, "--ptx-ops"], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    variants = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    aligned = [v for v in variants if "rows=aligned" in v["label"]]
    offset = [v for v in variants if "rows=offset" in v["label"]]
    assert aligned and offset, out[-4000:]
    for v in aligned:
        ops = v["ptx_ops"]
        vector = sum(n for op, n in ops.items() if op.startswith(("ld.global.v4.", "ld.global.v2.")))
        assert vector and not _byte_loads(ops), v
    for v in offset:
        assert _byte_loads(v["ptx_ops"]), v


def _byte_stores(ops: dict) -> int:
    return sum(n for op, n in ops.items() if re.fullmatch(r"st\.global(\.[\w:]+)*\.[bsu]8", op))


def test_peer_push_code_stores_are_vectorised_on_aligned_rows():
    """The push reduce (agoq.kernels.comm PUSH: the store all-reduce writes its requantized segment into every
    peer's store) stores the codes at addresses from an int64 table as well: with every input and output codes row
    16-byte aligned (``rows=aligned`` push variants) the codes go out as vector stores (st.global.v4 / v2; Triton 3.6
    and 3.8 sm_90: one st.global.v4.b32 per thread and output row, 2026-11-27) with no byte store, and the loads stay
    vectorised; a row PEER_ROW_OFFSET bytes off (``rows=offset``) gets the unhinted kernel (byte stores), which still
    compiles. The scales are fp32: every byte store is a code store. This Triton or $AGOQ_XCOMPILE_TRITON's."""
    env = _env(os.environ.get(TRITON_ENV_VAR, ""))
    proc = _run(["-m", "agoq.testing.xcompile", "comm_peer_reduce", "--ptx-ops", "--match", "push"], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    variants = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    aligned = [v for v in variants if "rows=aligned" in v["label"]]
    offset = [v for v in variants if "rows=offset" in v["label"]]
    assert aligned and offset and all(" push " in v["label"] for v in variants), out[-4000:]
    for v in aligned:
        ops = v["ptx_ops"]
        stores = sum(n for op, n in ops.items() if op.startswith(("st.global.v4.", "st.global.v2.")))
        loads = sum(n for op, n in ops.items() if op.startswith(("ld.global.v4.", "ld.global.v2.")))
        assert stores and loads and not _byte_stores(ops) and not _byte_loads(ops), v
    for v in offset:
        assert _byte_stores(v["ptx_ops"]), v
