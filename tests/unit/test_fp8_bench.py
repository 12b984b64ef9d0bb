"""benchmarks/bench_fp8.py --smoke runs on CPU (argument checks, plan, bf16 harness) and writes its JSON."""

import json
import subprocess
import sys

from agoq.testing.procs import REPO_ROOT, child_env

SCRIPT = REPO_ROOT / "benchmarks" / "bench_fp8.py"


def test_bench_fp8_smoke_writes_report(tmp_path):
    out = tmp_path / "fp8.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--profile", "--host", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["whole_step"] is None
    rows = report["linears"]["rows"]
    names = {(r["kind"], r["name"]) for r in rows}
    assert names == {("linear", "qkv"), ("linear", "proj"), ("linear", "fc1"), ("linear", "fc2"), ("mlp", "mlp")}
    assert all(r["ms"] > 0 for r in rows)
    summary = report["linears"]["summary"]["128"]
    assert summary["four_linears_ms"]["bf16"]["speedup_vs_bf16"] == 1.0
    assert set(summary["layer_linears_and_swiglu_ms"]) == {"bf16", "bf16_smooth_per_token"}
    assert all("ms_synced" in r for r in rows)
    profile = report["profile"]  # --smoke profiles the harness on the CPU (bf16 only)
    assert len(profile["linears"]) == 4 and set(profile["four_linears"]) == {"bf16"}
    one = next(iter(profile["linears"].values()))["bf16"]
    assert one["host_ms"] > 0 and one["cpu_ops"] and one["bound"] in ("host", "gpu")
    host = report["host"]  # --host: benchmarks/bench_fp8_host.py on the smoke shape (bf16 on the CPU)
    assert set(host["linears"]["summary"]) == {"bf16"} and len(host["linears"]["rows"]) == 4


def test_bench_fp8_rejects_tokens_not_multiple_of_16():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--tokens", "100"], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT, env=child_env())
    assert proc.returncode != 0 and "multiple of 16" in proc.stderr


def test_bench_fp8_host_smoke_writes_report(tmp_path):
    """benchmarks/bench_fp8_host.py --smoke (CPU, bf16 only): host ms per linear, the four linears' sum,
    host us per primitive."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_fp8_host.py"), "--smoke", "--out",
                           str(out)], capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = report["linears"]["rows"]
    assert [(r["linear"], r["mode"]) for r in rows] == [(n, "bf16") for n in ("qkv", "proj", "fc1", "fc2")]
    assert all(r["host_ms"] > 0 for r in rows)
    assert report["linears"]["summary"]["bf16"]["host_ms"] == sum(r["host_ms"] for r in rows)
    assert {"torch.add", "torch.empty", "select meta[0]"} <= set(report["primitives_host_us"])
