"""benchmarks/bench_optim.py --smoke runs on CPU (unfused path) and writes every field the GPU run reports."""

import json
import subprocess
import sys

from agoq.testing.procs import REPO_ROOT, child_env

SCRIPT = REPO_ROOT / "benchmarks" / "bench_optim.py"


def test_bench_optim_smoke_writes_report(tmp_path):
    out = tmp_path / "optim.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--configs", "flash_split24",
                           "lion_flash_split24"], capture_output=True, text=True, timeout=240, cwd=REPO_ROOT,
                          env=child_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"matrices", "llama1b"}
    for name, case in report["cases"].items():
        assert set(case["configs"]) == {"flash_split24", "lion_flash_split24", "flash_split24_per_tensor"}, name
        flash = case["configs"]["flash_split24"]
        assert flash["finite"] and case["torch_adamw_fp32"]["finite"]
        assert flash["ms"] > 0 and flash["host_ms"] > 0 and flash["ratio_vs_torch"] > 0
        assert flash["device_ms"] is None  # no device timing on CPU
        assert "meets_target" not in case  # no timing claim on CPU
    # split24 (2 + 1) + cint8_b32 / cuint8_b32 (1 + 2/32 each) + bf16 grads (2) = 7.125 bytes/param
    assert abs(report["cases"]["matrices"]["configs"]["flash_split24"]["bytes_per_param"] - 7.125) < 1e-9
    llama = report["cases"]["llama1b"]
    assert llama["num_tensors"] == 2 * 6 + 3  # --smoke: 2 layers + embedding, output, final norm
