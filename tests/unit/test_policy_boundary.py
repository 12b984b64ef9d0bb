"""agoq.policy imports no torch, triton or megatron (architecture.md §8.3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Blocking a module by setting sys.modules[name] = None makes any `import name` raise ImportError.
CHILD = r"""
import sys
for name in ("torch", "triton", "megatron", "numpy"):
    sys.modules[name] = None
import glob
from agoq.policy import ScheduleInfo, format_table, load_policy, model_sites, policy_table
schedule = ScheduleInfo(pp_size=4, vp_size=2, num_microbatches=8)
for path in sorted(glob.glob("configs/policy/*.yaml")):
    spec = load_policy(path)
    rows = policy_table(spec, model_sites(16, schedule), schedule)
    assert rows and format_table(rows)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "megatron", "numpy")
                and sys.modules[m] is not None)
print("LOADED", loaded)
"""


def test_policy_imports_and_resolves_without_torch():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
