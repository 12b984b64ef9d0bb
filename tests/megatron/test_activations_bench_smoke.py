"""scripts/bench_memory.py --smoke runs on CPU and reports the agoq policy exactly as the planner predicts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agoq.testing.procs import REPO_ROOT, child_env

pytestmark = pytest.mark.megatron


def test_bench_memory_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = child_env()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)  # an in-process megatron test may have set them (its port is still taken)
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_memory.py"), "--smoke",
                           "--policies", "bf16", "agoq", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["agoq"]["planner_error"] == 0.0  # CPU: every layer save of the agoq policy is modelled exactly
    assert rows["agoq"]["activation_ratio_vs_bf16"] < 0.5
