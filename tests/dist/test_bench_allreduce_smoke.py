"""benchmarks/bench_allreduce.py --smoke runs end to end on CPU (2 gloo ranks) and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist]

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_allreduce_smoke_writes_report(tmp_path):
    out = tmp_path / "grads.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_allreduce.py"), "--smoke", "--sizes-mib", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["size_mib"] for r in rows] == [1]
    row = rows[0]
    assert row["world_size"] == 2 and row["wire_bytes_agoq_allreduce"] < row["wire_bytes_nccl_allreduce_fp32"] / 3
    assert {m["link_gbps"] for m in row["link_model"]} and all(v > 0 for v in row["ms"].values())
    assert {"raw_int8_a2a_ag", "raw_int8_allgather", "agoq_store_allreduce_gather"} <= row["ms"].keys()
    assert row["check"]["store_gather_bitwise_vs_allreduce_blocks"] and row["check"]["ok"]
    assert row["raw_allgather_speedup_vs_allreduce_bf16"] > 0 and row["raw_floor_speedup_vs_allreduce_bf16"] > 0
