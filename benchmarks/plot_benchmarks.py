"""Figures for docs/benchmarks/ from the JSON the bench scripts wrote (matplotlib, PNG).

    python benchmarks/plot_benchmarks.py convergence benchmarks/results/conv_*.json \
        --out docs/benchmarks/convergence.png
    python benchmarks/plot_benchmarks.py memory benchmarks/results/pretrain_memory.json --out docs/benchmarks/memory.png
    python benchmarks/plot_benchmarks.py stages benchmarks/results/pp4_distopt.json benchmarks/results/dp2_pp2.json \
        --out docs/benchmarks/stage_peaks.png
    python benchmarks/plot_benchmarks.py fc2_amax benchmarks/results/fc2_amax.json --out docs/benchmarks/fc2_amax.png

Needs matplotlib (``pip install matplotlib``; not a dependency of agoq itself).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SMOOTH_WINDOW = 10  # training-loss records (x log interval steps) in the moving average


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_convergence(paths: list[Path], out: Path) -> None:
    """Training (moving average) and validation curves of every run, and each run's training curve against the
    mean of the baseline's seeds (issue 25: the spread between baseline seeds is the yardstick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid, ax_diff) = plt.subplots(1, 3, figsize=(17, 4.5))
    curves = {}
    for path in paths:
        run = json.loads(path.read_text())
        tokens = run["tokens_per_step"]
        train = [r for r in run["records"] if "lm_loss" in r]
        valid = [r for r in run["records"] if "validation_lm_loss" in r]
        x = [r["iteration"] * tokens / 1e6 for r in train]
        smooth = _moving_average([r["lm_loss"] for r in train], SMOOTH_WINDOW)
        label = f"{run['preset']} s{run['seed']}" if "seed" in run else run["preset"]
        curves[label] = (run["preset"], x, smooth)
        ax_train.plot(x, smooth, label=label, lw=1.2)
        ax_valid.plot([r["iteration"] * tokens / 1e6 for r in valid], [r["validation_lm_loss"] for r in valid],
                      marker="o", ms=3, label=label)  # fmt: skip
    for ax, title in ((ax_train, f"training loss (moving average of {SMOOTH_WINDOW} logs)"),
                      (ax_valid, "validation loss")):  # fmt: skip
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    baselines = [(x, smooth) for preset, x, smooth in curves.values() if preset == "baseline"]
    if baselines and all(x == baselines[0][0] for x, _ in baselines):
        base_x = baselines[0][0]
        base_mean = [sum(vals) / len(vals) for vals in zip(*(smooth for _, smooth in baselines), strict=True)]
        for label, (_, x, smooth) in curves.items():
            if x == base_x:
                ax_diff.plot(x, [100 * (a / b - 1) for a, b in zip(smooth, base_mean, strict=True)], label=label,
                             lw=1.0, ls="--" if label.startswith("baseline") else "-")
        ax_diff.axhline(0.0, color="black", lw=0.8)
        ax_diff.set_xlabel("tokens (millions)")
        ax_diff.set_ylabel(f"% vs the mean of {len(baselines)} baseline run(s)")
        ax_diff.set_title("training loss vs baseline mean (moving averages)")
        ax_diff.set_ylim(-3, 3)
        ax_diff.grid(alpha=0.3)
        ax_diff.legend(fontsize=7)
    ax_train.set_ylim(top=min(6.0, ax_train.get_ylim()[1]))
    ax_valid.set_ylim(top=min(6.0, ax_valid.get_ylim()[1]))
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_memory(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(path.read_text())
    rows = [s for s in report["summary"] if not s.get("failed")]
    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(13, 0.5 * len(rows) + 1.5), sharey=True)
    names = [s["name"] for s in rows]
    ax_mem.barh(names, [s["peak_gib"] for s in rows], color="tab:blue")
    ax_tps.barh(names, [s["tokens_per_second_median"] / 1e3 for s in rows], color="tab:green")
    ax_mem.set_xlabel("peak GPU memory (GiB)")
    ax_tps.set_xlabel("throughput (thousand tokens/s)")
    ax_mem.invert_yaxis()
    for ax in (ax_mem, ax_tps):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{report['environment'].get('device', '')}: {report['suite']} suite")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_stages(paths: list[Path], out: Path) -> None:
    """One panel per bench JSON: each run's measured peak per pipeline stage (bars) and the planner's
    prediction for it (black ticks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [json.loads(path.read_text()) for path in paths]
    fig, axes = plt.subplots(1, len(reports), figsize=(6.5 * len(reports), 4.2), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        rows = [s for s in report["summary"] if s.get("stage_peaks_gib")]
        width = 0.8 / max(1, len(rows))
        for i, row in enumerate(rows):
            stages = range(len(row["stage_peaks_gib"]))
            xs = [st + (i - (len(rows) - 1) / 2) * width for st in stages]
            ax.bar(xs, row["stage_peaks_gib"], width, label="/".join(row["name"].split("/")[1:]))  # less the shape
            predicted = row.get("predicted_stage_peaks_gib") or []
            ax.scatter(xs[: len(predicted)], predicted, marker="_", s=300, color="black", zorder=3)
        ax.set_xticks(range(max(len(r["stage_peaks_gib"]) for r in rows)))
        ax.set_xlabel("pipeline stage")
        ax.set_ylabel("peak GPU memory (GiB)")
        env = report["environment"]
        gpus = f"{env.get('num_gpus', '?')} x {env.get('device', '?')}"
        ax.set_title(f"{report['suite']} ({gpus}, {report['date'][:10]})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("per-stage peaks, measured (bars) and predicted by agoq.plan (black ticks)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_fc2_amax(path: Path, out: Path) -> None:
    """Issue 27's long-horizon proxy: per run of fc2_amax.json, the largest fc2-input amax over the FP8 layers and
    their median per iteration (log scale), and the training loss."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(path.read_text())
    fig, (ax_amax, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2))
    for run, records in report["runs"].items():
        its = [r["iteration"] for r in records]
        per_layer = [[v for k, v in r.items() if k.startswith("fc2_input_amax/")] for r in records]
        line = ax_amax.plot(its, [r["fc2_input_amax_max"] for r in records], lw=1.0, label=f"{run}: max over layers")
        ax_amax.plot(its, [statistics.median(v) for v in per_layer], lw=1.0, ls="--", color=line[0].get_color(),
                     label=f"{run}: median layer")
        ax_loss.plot(its, _moving_average([r["lm_loss"] for r in records], SMOOTH_WINDOW), lw=1.0, label=run)
    ax_amax.set_yscale("log")
    ax_amax.set_ylabel("fc2 input amax (E4M3 cast's history)")
    ax_loss.set_ylabel(f"training loss (moving average of {SMOOTH_WINDOW})")
    for ax in (ax_amax, ax_loss):
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['environment'].get('device', '')}, {report['date'][:10]}: fc2 input amax with and "
                 "without Smooth-SwiGLU")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("convergence", "memory", "stages", "fc2_amax"))
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.kind == "convergence":
        plot_convergence(args.inputs, args.out)
    elif args.kind == "stages":
        plot_stages(args.inputs, args.out)
    elif args.kind == "fc2_amax":
        plot_fc2_amax(args.inputs[0], args.out)
    else:
        plot_memory(args.inputs[0], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
