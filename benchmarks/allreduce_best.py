"""agoq's 8-bit store reductions against the fastest bf16 reduction measured, per size (issue 46 item 1).

Reads a full ``bench_allreduce.py`` report (the agoq cases, NCCL's plain bf16 calls, the torch symmetric-memory and
NCCL-window baselines, the link's peak) and, optionally, an NCCL_ALGO / NCCL_PROTO sweep (``nccl_sweep.py``'s
index.json and reports). Per size and collective it picks the fastest bf16 baseline among all of them (candidates:
allreduce_baselines.BF16_BASELINES, from every source; left out: a case whose correctness check failed or that
raised, listed under ``excluded``), and divides its time by agoq's:

  all-reduce       agoq_peer_store_allreduce          vs the fastest bf16 all-reduce
  reduce-scatter   agoq_peer_store_reduce_to_owners   vs the fastest bf16 reduce-scatter

on device time (``device_ms``; the issue's 2.07x was device time) and on single-call time (``ms``). Targets
(issue 46): >= 1.3x at 64-256 MiB, >= 1.6x at >= 1 GiB; 16 MiB is not judged.

Why a ratio is what it is: speed-up = bytes_bound x rate_ratio, exactly, where bytes_bound = the bf16 collective's
bus bytes / agoq's wire bytes per rank (2 (W-1)/W x 2 N vs 2 (W-1) x 1.02 N / W for the all-reduce: ~1.97x; the
reduce-scatter likewise) and rate_ratio = agoq's wire rate (wire bytes / time) / the baseline's bus bandwidth. A
baseline at the link's peak and agoq at the same rate give the bound; each rate is also reported as a fraction of
the link's measured peak.

Sources measured minutes apart on the same machine (the full run, then the sweep's launches): the comparison is
across launches, which the output says per candidate (``source``).

    python benchmarks/allreduce_best.py --grads $OUT/grads.json --sweep $OUT/nccl_sweep_2gpu \\
        --out $OUT/grads_best_baseline.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # allreduce_baselines.py beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allreduce_baselines import (  # noqa: E402
    ALLREDUCE,
    BF16_BASELINES,
    COLLECTIVES,
    REDUCE_SCATTER,
    bus_bandwidth_gbps,
    bus_factor,
    case_bytes,
)

AGOQ_CASE = {ALLREDUCE: "agoq_peer_store_allreduce", REDUCE_SCATTER: "agoq_peer_store_reduce_to_owners"}
# (smallest MiB, largest MiB or None, target speed-up): issue 46 item 1
TARGETS = [(64, 256, 1.3), (1024, None, 1.6)]
METRICS = ("device_ms", "ms")


def target_for(size_mib: int) -> float | None:
    return next((t for lo, hi, t in TARGETS if size_mib >= lo and (hi is None or size_mib <= hi)), None)


def candidates(report: dict, source: str, collective: str, metric: str) -> tuple[list[dict], list[dict]]:
    """(usable, excluded) bf16 baselines of ``collective`` in a report's rows: every case of BF16_BASELINES timed on
    ``metric``; excluded: those whose check failed or that recorded an error."""
    usable, excluded = [], []
    for row in report.get("rows", []):
        times = row.get(metric) or {}
        for case in BF16_BASELINES[collective]:
            if case not in times:
                continue
            cand = {"size_mib": row["size_mib"], "case": case, "source": source, metric: times[case],
                    "numel": row["numel"], "world_size": row["world_size"]}
            check = row.get("baseline_check", {}).get(case)
            if case in row.get("baseline_errors", {}):
                excluded.append({**cand, "why": row["baseline_errors"][case]})
            elif check is not None and not check["ok"]:
                excluded.append({**cand, "why": f"check failed: {check}"})
            else:
                usable.append(cand)
    return usable, excluded


def best_per_size(cands: list[dict], metric: str) -> dict[int, dict]:
    best: dict[int, dict] = {}
    for c in cands:
        if c["size_mib"] not in best or c[metric] < best[c["size_mib"]][metric]:
            best[c["size_mib"]] = c
    return best


def _described(c: dict, collective: str, metric: str, peak: float | None) -> dict:
    """A candidate with its bus bandwidth (and fraction of the link's peak)."""
    bw = bus_bandwidth_gbps(collective, case_bytes(c["case"], c["numel"], c["world_size"]), c[metric],
                            c["world_size"])
    out = {"case": c["case"], "source": c["source"], metric: c[metric], "busbw_gbps": bw}
    if peak:
        out["link_fraction"] = bw / peak
    return out


def agoq_wire_bytes(numel: int, world: int, fmt: str, collective: str) -> int:
    from agoq.comm.reduce import wire_bytes

    return wire_bytes(numel, world, fmt, all_gather=collective == ALLREDUCE)


def judge(grads: dict, sweep: list[tuple[str, dict]], metric: str, wire_bytes_fn=agoq_wire_bytes) -> dict:
    """Per (collective, size) of the full run: the fastest usable bf16 baseline over the full run and the sweep,
    agoq's speed-up over it, the target and the explanation (module docstring)."""
    peak = (grads.get("link_peak") or {}).get("link_peak_gbps")
    sources = [("full run", grads), *sweep]
    out = {"metric": metric, "link_peak_gbps": peak, "rows": [], "excluded": []}
    for coll in COLLECTIVES:
        usable = []
        for source, report in sources:
            u, x = candidates(report, source, coll, metric)
            usable += u
            out["excluded"] += x
        best = best_per_size(usable, metric)
        for row in grads.get("rows", []):
            size, agoq_case = row["size_mib"], AGOQ_CASE[coll]
            agoq_ms = (row.get(metric) or {}).get(agoq_case)
            entry = {"collective": coll, "size_mib": size, "agoq_case": agoq_case, "agoq_" + metric: agoq_ms,
                     "target": target_for(size)}
            b = best.get(size)
            if b is None or agoq_ms is None:
                entry["verdict"] = "not judged: " + ("no bf16 baseline timed" if b is None else f"{agoq_case} not "
                                                     f"timed on {metric}")
                out["rows"].append(entry)
                continue
            world, numel = row["world_size"], row["numel"]
            busbw = bus_bandwidth_gbps(coll, case_bytes(b["case"], numel, world), b[metric], world)
            bus_bytes = case_bytes(b["case"], numel, world) * bus_factor(coll, world)
            wire = wire_bytes_fn(numel, world, row["format"], coll)
            wire_rate = wire / (agoq_ms * 1e6)
            entry.update(best={"case": b["case"], "source": b["source"], metric: b[metric], "busbw_gbps": busbw},
                         speedup=b[metric] / agoq_ms, bytes_bound=bus_bytes / wire, agoq_wire_gbps=wire_rate,
                         rate_ratio=wire_rate / busbw,
                         runners_up=sorted((_described(c, coll, metric, peak)
                                            for c in usable if c["size_mib"] == size and c is not b),
                                           key=lambda c: c[metric]))
            if peak:
                entry["best"]["link_fraction"] = busbw / peak
                entry["agoq_wire_link_fraction"] = wire_rate / peak
            tgt = entry["target"]
            entry["verdict"] = ("not judged (below 64 MiB)" if tgt is None else
                                ("met" if entry["speedup"] >= tgt else "MISSED") + f" (>= {tgt}x)")
            out["rows"].append(entry)
    return out


def load_sweep(sweep_dir: Path) -> tuple[list[tuple[str, dict]], list[dict]]:
    """(source name, report) of every sweep setting that wrote a report; the index entries of those with recorded
    failures (exit code, errors)."""
    index = json.loads((sweep_dir / "index.json").read_text())
    reports, failures = [], []
    for e in index["settings"]:
        if e.get("json"):
            env = " ".join(f"{k}={v}" for k, v in e["env"].items()) or "NCCL default"
            reports.append((f"sweep {e['name']} ({env})", json.loads((sweep_dir / e["json"]).read_text())))
        if e["returncode"] != 0 or e.get("errors"):
            failures.append({k: e.get(k) for k in ("name", "env", "returncode", "errors")})
    return reports, failures


def lines_of(result: dict) -> list[str]:
    m = result["metric"]
    out = [f"== {m}: agoq store vs the fastest bf16 baseline (link peak {result['link_peak_gbps'] or float('nan'):.0f}"
           " GB/s)"]
    for e in result["rows"]:
        if "best" not in e:
            out.append(f"{e['collective']:>14} {e['size_mib']:>5} MiB | {e['verdict']}")
            continue
        b = e["best"]
        frac = f" {b['link_fraction']:.0%} of link" if "link_fraction" in b else ""
        out.append(f"{e['collective']:>14} {e['size_mib']:>5} MiB | best {b['case']} [{b['source']}] {b[m]:.3f} ms "
                   f"{b['busbw_gbps']:.0f} GB/s{frac} | agoq {e['agoq_' + m]:.3f} ms, wire {e['agoq_wire_gbps']:.0f} "
                   f"GB/s | {e['speedup']:.2f}x = bound {e['bytes_bound']:.2f} x rates {e['rate_ratio']:.2f} | "
                   f"{e['verdict']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grads", type=Path, required=True, help="a full bench_allreduce.py report (grads.json)")
    p.add_argument("--sweep", type=Path, default=None, help="nccl_sweep.py's output folder (its index.json)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    grads = json.loads(args.grads.read_text())
    if any(r.get("baseline_only") for r in grads.get("rows", [])):
        p.error(f"--grads {args.grads} is a --baseline-only report: pass the full run's (it holds agoq's cases)")
    sweep, failures = load_sweep(args.sweep) if args.sweep else ([], [])
    results = {m: judge(grads, sweep, m) for m in METRICS}
    for m in METRICS:
        for line in lines_of(results[m]):
            print(line)
    for f in failures:
        print(f"sweep setting {f['name']} {f['env']}: exit {f['returncode']}, recorded: {f['errors']}")
    excluded = results["device_ms"]["excluded"]
    if excluded:
        print(f"left out of the best (failed or raised): {[(x['size_mib'], x['case'], x['source']) for x in excluded]}")
    if args.out:
        report = {"grads": str(args.grads), "grads_env": grads.get("env"), "grads_commit": grads.get("agoq_commit"),
                  "sweep": str(args.sweep) if args.sweep else None, "sweep_failures": failures,
                  "targets": TARGETS, "link_peak": grads.get("link_peak"), "by_metric": results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
