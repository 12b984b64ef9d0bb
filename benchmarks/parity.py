"""Behaviour parity across a restructuring: record what a commit prints and saves, then hold a later commit to it.

A restructuring that claims to change no behaviour must leave, for the same flags, the same losses and gradient
norms, the same policy table, saved-activation tables and memory predictions, the same planner output, and it must
resume the old commit's checkpoints exactly as the old commit does. This tool records those for six settings of
the tiny model on the CPU (the README's job and five variants) and compares a later checkout against the record.

    python benchmarks/parity.py record /tmp/parity/BEFORE        # on the commit before the change (~4 min)
    python benchmarks/parity.py compare /tmp/parity/BEFORE        # on the commit after it: exit 1 on any difference

``record`` runs each setting for 15 iterations with a checkpoint at iteration 15, then resumes that checkpoint for
5 more. ``compare`` reruns both halves with this checkout's code; its resumed half loads the checkpoints that
``record`` wrote, so an old checkpoint read differently by the new code shows up as a different loss. Numbers are
compared exactly (same machine, same threads): on the CPU these runs are deterministic.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
TINY = ["scripts/pretrain_llama.py", "--config", "configs/model/tiny.yaml"]
FIRST_ITERS, RESUMED_ITERS = 15, 20

# name -> (processes, flags): the README's job and five settings around it
SETTINGS: dict[str, tuple[int, list[str]]] = {
    "readme": (2, ["--pipeline-model-parallel-size", "2"]),
    "default_pp1": (1, []),
    "disable": (2, ["--pipeline-model-parallel-size", "2", "--agoq-disable"]),
    "full": (2, ["--pipeline-model-parallel-size", "2", "--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256"]),
    "smooth_swiglu": (2, ["--pipeline-model-parallel-size", "2", "--agoq-smooth-swiglu", "per-channel"]),
    "selective": (2, ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "selective"]),
}
PLANNER = [sys.executable, "-m", "agoq.plan", "--config", "configs/model/llama3-8b.yaml"]
PLANS: dict[str, list[str]] = {
    "plan_8b_default": [],
    "plan_8b_full_pp2": ["--pipeline-model-parallel-size", "2", "--agoq-optimizer", "adamw", "--agoq-grads",
                         "int8_b256"],
}
# log-json keys that hold measurements of time or host memory, not behaviour
_TIMING_KEYS = {"step_seconds", "tokens_per_second", "tflops_per_gpu", "host_steal_cpu_seconds",
                "host_enqueue_seconds", "host_threads", "gc_collections", "gc_seconds", "rss_gib"}
# printed lines that carry times, paths, free disk or host memory
_VOLATILE = re.compile(r"^(W\d{4}|iteration\s|measured memory|setup \[|done:|data:|--save |saved checkpoint|"
                       r"loaded checkpoint|versions:|\s*$)|elapsed|GiB free|rss|"
                       # printed on resume when the policy file's path differs from the one saved (another checkout);
                       # the policy table itself is compared in the first half's output
                       r"the resolved policy table differs from the checkpoint's")


def _canon(line: str) -> str:
    """A printed line with this checkout's and this interpreter's paths replaced (compare may run elsewhere)."""
    line = line.replace(sys.prefix, "<VENV>").replace("<REPO>/.venv", "<VENV>")
    return line.replace(str(REPO), "<REPO>")


def _clean_json(line: str) -> dict:
    rec = json.loads(line)
    out = {k: v for k, v in rec.items() if k not in _TIMING_KEYS}
    if "memory_breakdown" in out:
        out["memory_breakdown"] = {k: v for k, v in out["memory_breakdown"].items() if k not in _TIMING_KEYS}
    return out


def _stable_stdout(text: str, paths: list[str]) -> list[str]:
    lines = []
    for line in text.splitlines():
        if _VOLATILE.search(line):
            continue
        for path in paths:
            line = line.replace(path, "<DIR>")
        lines.append(_canon(line))
    return lines


def _run(command: list[str], log: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"parity: {' '.join(command)} failed (exit {proc.returncode}); its output: {log}")
    return proc.stdout + proc.stderr


def run_setting(name: str, work: Path, ckpt: Path, fresh: bool) -> dict:
    """Both halves of one setting; ``fresh``: write the first half's checkpoint into ``ckpt`` (record)."""
    procs, flags = SETTINGS[name]
    work.mkdir(parents=True, exist_ok=True)
    launch = [*TRAIN, "--nproc-per-node", str(procs), *TINY, *flags]
    first_json, resumed_json = work / f"{name}.first.jsonl", work / f"{name}.resumed.jsonl"
    for path in (first_json, resumed_json):
        path.unlink(missing_ok=True)
    first_ckpt = ckpt if fresh else work / f"{name}.ckpt_new"
    if not fresh:
        shutil.rmtree(first_ckpt, ignore_errors=True)
    first = _run([*launch, "--train-iters", str(FIRST_ITERS), "--save", str(first_ckpt), "--save-interval",
                  str(FIRST_ITERS), "--log-json", str(first_json)], work / f"{name}.first.log")
    # the resumed half reads the recorded checkpoint (a copy: resuming may write into its folder)
    resume_from = work / f"{name}.resume_from"
    shutil.rmtree(resume_from, ignore_errors=True)
    shutil.copytree(ckpt, resume_from)
    resumed = _run([*launch, "--train-iters", str(RESUMED_ITERS), "--load", str(resume_from), "--log-json",
                    str(resumed_json)], work / f"{name}.resumed.log")
    paths = [str(first_ckpt), str(resume_from), str(work)]
    return {"first_log": [_clean_json(x) for x in first_json.read_text().splitlines()],
            "resumed_log": [_clean_json(x) for x in resumed_json.read_text().splitlines()],
            "first_stdout": _stable_stdout(first, paths), "resumed_stdout": _stable_stdout(resumed, paths)}


def run_plan(name: str, work: Path) -> dict:
    out = _run([*PLANNER, *PLANS[name]], work / f"{name}.log")
    return {"stdout": _stable_stdout(out, [])}


def record(root: Path, names: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    for name in names:
        rec = run_setting(name, root / "work", root / "ckpt" / name, fresh=True)
        (root / f"{name}.json").write_text(json.dumps({"commit": commit, **rec}, indent=1))
        print(f"parity: recorded {name}", flush=True)
    for name in PLANS:
        (root / f"{name}.json").write_text(json.dumps({"commit": commit, **run_plan(name, root / "work")}, indent=1))
        print(f"parity: recorded {name}", flush=True)


def _diff(name: str, key: str, old, new) -> list[str]:
    if key.endswith("stdout"):
        old = [_canon(x) for x in old if not _VOLATILE.search(x)]
        new = [_canon(x) for x in new]
    if old == new:
        return []
    to_lines = (lambda v: v) if isinstance(old, list) and all(isinstance(x, str) for x in old) else \
        (lambda v: [json.dumps(x, sort_keys=True) for x in v])
    return [f"--- {name}: {key}", *difflib.unified_diff(to_lines(old), to_lines(new), lineterm="", n=1)]


def compare(root: Path, names: list[str]) -> int:
    problems: list[str] = []
    work = root / f"compare-{os.getpid()}"  # several checkouts may compare against one record at once
    for name in names:
        old = json.loads((root / f"{name}.json").read_text())
        new = run_setting(name, work, root / "ckpt" / name, fresh=False)
        for key in ("first_log", "resumed_log", "first_stdout", "resumed_stdout"):
            problems += _diff(name, key, old[key], new[key])
        print(f"parity: {name}: {'same' if not problems else 'differs'}", flush=True)
    for name in PLANS:
        old = json.loads((root / f"{name}.json").read_text())
        problems += _diff(name, "stdout", old["stdout"], run_plan(name, work)["stdout"])
    print("\n".join(problems) if problems else f"parity: every setting and plan equals the record in {root}")
    return 1 if problems else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["record", "compare"])
    parser.add_argument("root", type=Path, help="the record's folder")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args()
    if args.action == "record":
        record(args.root, args.settings)
    else:
        sys.exit(compare(args.root, args.settings))


if __name__ == "__main__":
    main()
