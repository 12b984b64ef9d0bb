"""Launch agoq's scripts under torchrun from tests and benchmarks, and read their iteration lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PRETRAIN_SCRIPT = REPO_ROOT / "scripts" / "pretrain_llama.py"
TINY_CONFIG = REPO_ROOT / "configs" / "model" / "tiny.yaml"

# A tree exported without .git (git archive, a device machine's copy) names its commit in this file
# (benchmarks/device/README.md); benchmark reports record it.
COMMIT_FILE = ".commit"


def source_commit(root: Path = REPO_ROOT) -> str:
    """The commit the code under ``root`` is: the first line of ``root/.commit`` when present (written by whoever
    exported or carried the tree: a copy's own ``.git`` may lag behind it, benchmarks/device/README.md); else git's
    HEAD, with "+dirty" when tracked files differ from it; else "unknown"."""
    marker = (root / COMMIT_FILE).read_text().strip() if (root / COMMIT_FILE).is_file() else ""
    if marker:
        return marker.splitlines()[0]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
        if head.returncode == 0 and (root / ".git").exists():
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


_ITERATION_RE = re.compile(
    r"^iteration\s+(?P<iteration>\d+)/(?P<total>\d+) \|.*?lm loss: (?P<loss>\S+) \|"
    r".*?grad norm: (?P<grad_norm>\S+) \|.*?skipped iterations: (?P<skipped>\d+)",
    re.MULTILINE,
)


def child_env(**extra: str) -> dict[str, str]:
    """The parent environment with the checkout first on PYTHONPATH, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def torchrun_command(nproc: int, script: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", str(script), *args]


def run_pretrain(nproc: int, args: list[str], *, timeout: float = 300, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """Run scripts/pretrain_llama.py under torchrun; raise with the output tail when it fails."""
    proc = subprocess.run(
        torchrun_command(nproc, PRETRAIN_SCRIPT, args), capture_output=True, text=True,
        timeout=timeout, env=env or child_env(), cwd=REPO_ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain_llama.py exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def iteration_records(output: str) -> list[dict]:
    """Parse Megatron-style iteration lines into {iteration, loss, grad_norm, skipped}."""
    records = []
    for m in _ITERATION_RE.finditer(output):
        records.append({
            "iteration": int(m["iteration"]),
            "loss": float(m["loss"]) if m["loss"] != "n/a" else None,
            "grad_norm": float(m["grad_norm"]) if m["grad_norm"] != "n/a" else None,
            "skipped": int(m["skipped"]),
        })
    return records
