"""benchmarks/bench_quant.py --smoke runs every code path of the H100 command on CPU (Triton interpreter):
normal run, --check, --variants (codes equal across launch shapes) and the launch-shape choice."""

import json
import subprocess
import sys

import pytest

from agoq.testing.procs import REPO_ROOT, child_env

pytestmark = pytest.mark.kernels
SCRIPT = REPO_ROOT / "benchmarks" / "bench_quant.py"


def test_bench_quant_smoke_writes_report(tmp_path):
    out = tmp_path / "quant.json"
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--check", "--variants", "--formats", "int6_b64", "int8_b128",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env=child_env(TRITON_INTERPRET="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True
    assert all(r["codes_equal"] and r["scales_equal"] and r["values_equal"] for r in report["check"])
    ops = {(r["format"], r["op"]) for r in report["throughput"]}
    assert ops >= {("int6_b64", "quantize"), ("int6_b64", "dequantize"), ("int8_b128", "quantize")}
    variants = report["variants"]
    assert {r["format"] for r in variants} == {"int6_b64"}  # int8_b128 runs on the byte kernel
    assert {r["effective_split"] for r in variants} == {1, 2, 4}
    assert all(r["codes_equal_default"] for r in variants)
    assert set(report["variant_choice"]) == {"int/6/False"}
    assert "launch shapes to commit" in proc.stdout
