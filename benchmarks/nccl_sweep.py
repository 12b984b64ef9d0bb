"""NCCL_ALGO x NCCL_PROTO sweep of NCCL's bf16 all-reduce and reduce-scatter (issue 46 item 1).

NCCL reads NCCL_ALGO / NCCL_PROTO when a communicator is created, so every setting is its own torchrun launch of
``bench_allreduce.py --baseline-only --collectives C`` (one collective per launch: a setting NCCL refuses for one
collective cannot disturb the other's timings). The settings (``settings()``), per collective C:

  C_default          no NCCL_ALGO / NCCL_PROTO (NCCL's own choice), with --baselines symm window: the torch
                     symmetric-memory and NCCL-window baselines in the same launch
  C_<algo>_<proto>   NCCL_ALGO=<algo> NCCL_PROTO=<proto>, algo in Ring Tree, proto in LL LL128 Simple

Tree is not an algorithm of NCCL's reduce-scatter: those settings are launched anyway and what NCCL did is
recorded, either a refusal (the case's error in the JSON's ``baseline_errors``, or the launch's exit code and
output tail in the index) or another algorithm (NCCL's TUNING log below says which one ran).

Every launch writes ``<out-dir>/<name>.json`` (the bench's report), ``<name>.log`` (its output) and, with the tuning
log (default), NCCL's ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`` lines in ``<name>.nccl.<host>.<pid>.log``: rank 0
logs the algorithm and protocol of every collective it launches, and "[Symmetric]" where NCCL took a symmetric
kernel. ``<out-dir>/index.json`` lists every setting: environment, command, exit code, seconds, the cases' errors,
and the (collective, bytes, algorithm, protocol) counts read from NCCL's log. The log costs host time per call (the
single-call ``ms``); the device time (``device_ms``, what the summary judges) does not include the host.
allreduce_best.py picks the fastest bf16 baseline per size over this sweep and the full run.

    python benchmarks/nccl_sweep.py --nproc 2 --out-dir $OUT/nccl_sweep_2gpu
    python benchmarks/nccl_sweep.py --list                  # the settings and their command lines, nothing run
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from agoq.testing.procs import child_env, torchrun_command  # noqa: E402

BENCH = REPO_ROOT / "benchmarks" / "bench_allreduce.py"
COLLECTIVES = ("allreduce", "reduce_scatter")  # bench_allreduce.py --collectives
ALGOS = ("Ring", "Tree")
PROTOS = ("LL", "LL128", "Simple")
DEFAULT_SIZES_MIB = [16, 64, 160, 256, 1024]
SWEPT_ENV = ("NCCL_ALGO", "NCCL_PROTO")  # taken out of the parent's environment: each setting sets its own
TUNING_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING"}
LAUNCH_TIMEOUT_S = 420
# rank 0's line per launched collective (NCCL src/enqueue.cc): "AllReduce: 83886080 Bytes -> Algo RING proto SIMPLE"
TUNING_RE = re.compile(r"NCCL INFO (\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)")


@dataclass(frozen=True)
class Setting:
    name: str
    collective: str
    env: dict = field(default_factory=dict)
    baselines: tuple = ()


def settings(collectives: tuple[str, ...] = COLLECTIVES) -> list[Setting]:
    out = []
    for coll in collectives:
        out.append(Setting(f"{coll}_default", coll, {}, ("symm", "window")))
        out.extend(Setting(f"{coll}_{algo.lower()}_{proto.lower()}", coll, {"NCCL_ALGO": algo, "NCCL_PROTO": proto})
                   for algo in ALGOS for proto in PROTOS)
    return out


def command(setting: Setting, nproc: int, sizes_mib: list[int], out_dir: Path, warmup: int, iters: int) -> list[str]:
    args = ["--baseline-only", "--collectives", setting.collective, "--sizes-mib", *map(str, sizes_mib),
            "--warmup", str(warmup), "--iters", str(iters), "--out", str(out_dir / f"{setting.name}.json"),
            "--baselines", *setting.baselines]
    return torchrun_command(nproc, BENCH, args)


def launch_env(setting: Setting, out_dir: Path, tuning_log: bool, base: dict | None = None) -> dict:
    """The launch's environment: the parent's (checkout first on PYTHONPATH) without NCCL_ALGO / NCCL_PROTO, then the
    setting's, then NCCL's TUNING log into ``out_dir`` (one file per process)."""
    env = dict(base) if base is not None else child_env()
    for key in SWEPT_ENV:
        env.pop(key, None)
    env.update(setting.env)
    if tuning_log:
        env.update(TUNING_ENV, NCCL_DEBUG_FILE=str(out_dir / f"{setting.name}.nccl.%h.%p.log"))
    return env


def tally_tuning(text: str) -> dict:
    """Counts of (collective, bytes, algorithm, protocol) in NCCL TUNING lines, and the "[Symmetric]" lines."""
    counts = collections.Counter(" ".join(m.groups()) for m in TUNING_RE.finditer(text))
    symmetric = [line for line in text.splitlines() if "[Symmetric]" in line]
    return {"algo_proto_counts": dict(sorted(counts.items())), "symmetric_lines": len(symmetric),
            "symmetric_examples": sorted(set(symmetric))[:4],
            "note": "" if counts or symmetric else "no TUNING line found (NCCL's log format differs, or no log)"}


def _errors_of(report: dict) -> dict:
    return {f"{r['size_mib']} MiB {case}": err for r in report.get("rows", [])
            for case, err in r.get("baseline_errors", {}).items()}


def run_setting(setting: Setting, cmd: list[str], env: dict, out_dir: Path, timeout_s: float,
                runner=subprocess.run) -> dict:
    """Launch one setting; its index entry (never raises for the launch's own failure: it is recorded)."""
    log = out_dir / f"{setting.name}.log"
    entry = {"name": setting.name, "collective": setting.collective, "env": setting.env,
             "baselines": list(setting.baselines), "command": cmd}
    t0 = time.time()
    try:
        proc = runner(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
        output, entry["returncode"] = (proc.stdout or "") + (proc.stderr or ""), proc.returncode
    except subprocess.TimeoutExpired as err:
        output, entry["returncode"] = f"{err.stdout or ''}{err.stderr or ''}\nTIMEOUT after {timeout_s} s", "timeout"
    entry["seconds"] = round(time.time() - t0, 1)
    log.write_text(output if isinstance(output, str) else output.decode(errors="replace"))
    report_path = out_dir / f"{setting.name}.json"
    if report_path.is_file():
        entry["json"] = report_path.name
        entry["errors"] = _errors_of(json.loads(report_path.read_text()))
    else:
        entry["json"] = None
        entry["errors"] = {"launch": f"no report written (exit {entry['returncode']})"}
    if entry["returncode"] != 0:
        entry["output_tail"] = output[-3000:]
    logs = sorted(glob.glob(str(out_dir / f"{setting.name}.nccl.*.log")))
    entry["nccl_tuning"] = tally_tuning("".join(Path(p).read_text(errors="replace") for p in logs))
    status = "ok" if entry["returncode"] == 0 and not entry["errors"] else "RECORDED FAILURES"
    print(f"== {setting.name} {setting.env or '(NCCL default)'}: exit {entry['returncode']} after {entry['seconds']} s,"
          f" {status}" + (f": {entry['errors']}" if entry["errors"] else ""), flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="GPUs (torchrun --nproc-per-node)")
    p.add_argument("--out-dir", type=Path, default=None, help="default $OUT/nccl_sweep_<nproc>gpu")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=DEFAULT_SIZES_MIB)
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument("--only", nargs="+", default=None, help="run only these setting names")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--timeout", type=float, default=LAUNCH_TIMEOUT_S, help="seconds per launch")
    p.add_argument("--no-tuning-log", action="store_true", help="no NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING log")
    p.add_argument("--list", action="store_true", help="print the settings and their commands, run nothing")
    args = p.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = Path(os.environ.get("OUT", "/tmp")) / f"nccl_sweep_{args.nproc}gpu"
    chosen = settings(tuple(args.collectives))
    if args.only:
        unknown = set(args.only) - {s.name for s in chosen}
        if unknown:
            p.error(f"--only: unknown settings {sorted(unknown)} (allowed: {[s.name for s in chosen]})")
        chosen = [s for s in chosen if s.name in args.only]
    cmds = [command(s, args.nproc, args.sizes_mib, args.out_dir, args.warmup, args.iters) for s in chosen]
    if args.list:
        for s, cmd in zip(chosen, cmds, strict=True):
            print(" ".join(f"{k}={v}" for k, v in s.env.items()), " ".join(cmd))
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    index = {"nproc": args.nproc, "sizes_mib": args.sizes_mib, "tuning_log": not args.no_tuning_log, "settings": []}
    for s, cmd in zip(chosen, cmds, strict=True):
        env = launch_env(s, args.out_dir, not args.no_tuning_log)
        index["settings"].append(run_setting(s, cmd, env, args.out_dir, args.timeout))
        (args.out_dir / "index.json").write_text(json.dumps(index, indent=1))  # after every launch: a cut run keeps it
    failed = [e["name"] for e in index["settings"] if e["returncode"] != 0 or e["errors"]]
    print(f"wrote {args.out_dir / 'index.json'}; settings with recorded failures: {failed or 'none'}")
    return 0  # a refused setting is a result (recorded), not a failure of the sweep


if __name__ == "__main__":
    sys.exit(main())
