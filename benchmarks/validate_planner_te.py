"""The planner's TE path (agoq.plan.te, ``python -m agoq.plan --transformer-impl transformer_engine``) next to the
peaks measured on one H100 in benchmarks/results/te.json and te_8b.json (benchmarks/bench_te.py, 2026-12-07).

Each row's own command line (``command``: Megatron-LM's flags to benchmarks/megatron_gpt_upstream.py, with or
without agoq's door ``--module agoq.megatron_lm``) is turned into the planner's (``planner_argv``):

- Megatron-LM flags that change nothing the planner models are dropped, each listed with why in ``DROPPED``; any
  other flag the planner does not take fails the parse (nothing is skipped silently);
- ``--transformer-impl transformer_engine`` is Megatron-LM's default (megatron.core TransformerConfig), so it is
  added where the row does not name an implementation;
- a row without agoq's door is Megatron + TE alone: ``--agoq-disable``;
- the door's policy is ``--agoq-policy`` or its default configs/policy/agoq.yaml: the planner's ``--policies``.

measured = ``peak_allocated_bytes`` (``torch.cuda.max_memory_allocated``). A row that ran out of memory
(``returncode`` 1, no peak) is checked as "predicted not to fit 80 GiB" where the OOM is the planner's question (the
8B Megatron + TE row); the 8B agoq row with the default allocator ran out of memory with 6.4 GiB reserved but
unallocated (fragmentation: its expandable-segments rerun is the measured row), which is not a planner term.

``python benchmarks/validate_planner_te.py`` prints the table of docs/benchmarks/planner.md's TE section;
tests/unit/test_plan_te.py checks every row against ``TARGET``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agoq.plan import __main__ as plan_cli  # noqa: E402
from agoq.plan import capacity, te  # noqa: E402
from agoq.plan.memory import GIB  # noqa: E402
from agoq.plan.peak import StagePeak  # noqa: E402
from agoq.plan.recipe import recipe_of  # noqa: E402
from agoq.policy import load_policy  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DEFAULT_DOOR_POLICY = "configs/policy/agoq.yaml"  # agoq.train.megatron_lm: --agoq-policy's default
TARGET = 0.05  # the planner's target (docs/benchmarks/planner.md): within 5 % of the measured peak
OOM_BUDGET = 80 * GIB  # the 8B rows ran on one H100 80GB (79.18 GiB usable, the OOM messages)
# Megatron-LM flags of the rows the planner does not take: flag -> (takes a value, why it changes no modelled byte)
DROPPED = {
    "--group-query-attention": (False, "GQA follows --num-query-groups"),
    "--max-position-embeddings": (True, "RoPE: no learned position table"),
    "--normalization": (True, "RMSNorm (the model is LLaMA's)"),
    "--swiglu": (False, "SwiGLU (the model is LLaMA's)"),
    "--disable-bias-linear": (False, "no biases (the model is LLaMA's)"),
    "--position-embedding-type": (True, "RoPE (the model is LLaMA's)"),
    "--hidden-dropout": (True, "0: dropout keeps no mask"),
    "--attention-dropout": (True, "0: dropout keeps no mask"),
    "--bf16": (False, "bf16 is the planner's training dtype"),
    "--log-throughput": (False, "logging"),
    "--mock-data": (False, "data source (the batch's bytes are agoq.plan.te.batch_bytes)"),
    "--tokenizer-type": (True, "NullTokenizer: the vocabulary is --vocab-size"),
    "--bench-json": (True, "the bench's output file"),
}
# rows left out of the validation, and why
NOT_VALIDATED = {
    ("te_8b.json", "agoq_te/full_fp8 (default allocator)"): "OOM from fragmentation (6.4 GiB reserved, unallocated); "
    "its expandable-segments rerun is validated",
    ("te_8b.json", "agoq/full_fp8"): "agoq's local spec through Megatron-LM's trainer, not the TE path",
}


def planner_argv(command: list[str]) -> list[str]:
    """The planner's command line of a bench row's ``command`` (module docstring)."""
    script = next(i for i, w in enumerate(command) if w.endswith(".py"))
    door = "agoq.megatron_lm" in command[:script]
    words, out = command[script + 1:], []
    i = 0
    while i < len(words):
        word = words[i]
        if word in DROPPED:
            i += 2 if DROPPED[word][0] else 1
            continue
        if word == "--agoq-policy":
            out += ["--policies", words[i + 1]]
            i += 2
            continue
        out.append(word)
        i += 1
    if "--transformer-impl" not in out:
        out += ["--transformer-impl", te.TE_IMPL]
    if not door:
        out.append("--agoq-disable")
    elif "--policies" not in out:
        out += ["--policies", DEFAULT_DOOR_POLICY]
    return out + ["--memory-budget", "80GiB"]


def predict(argv: list[str]) -> StagePeak:
    """The TE path's StagePeak for ``argv``, through python -m agoq.plan's own steps (run_plan's: the merged
    values, the run's AgoqConfig, layout and shape, the padded vocabulary, the TE settings); the first --policies
    file (or none with --agoq-disable)."""
    request = plan_cli.parse(argv)
    values = plan_cli.values_of(request, plan_cli.read_model_file(request.config))
    config = plan_cli.config_of(values)
    layout = plan_cli.layout_of(values, config)
    shape = plan_cli.shape_of(values, request.config)
    shape = replace(shape, vocab_size=capacity.padded_vocab(shape.vocab_size, layout.tp,
                                                            plan_cli.divisible_by(values)))
    plan_cli.check_run_flags(values, layout)
    settings = te.settings_of(values, layout)
    policy = load_policy(REPO / request.policies[0]) if request.policies else None
    return te.predict_te_peak(shape, layout, policy, recipe_of(plan_cli.config_of(values, policy)), settings)


def cases() -> list[dict]:
    """Every validated row: file, name, micro-batch, the planner's argv, measured bytes (None: out of memory)."""
    out = []
    for file in ("te.json", "te_8b.json"):
        for row in json.loads((RESULTS / file).read_text())["rows"]:
            if (file, row["name"]) in NOT_VALIDATED:
                continue
            out.append({"file": file, "name": row["name"], "mbs": row["micro_batch"],
                        "argv": planner_argv(row["command"]), "measured": row["peak_allocated_bytes"],
                        "env": row.get("env") or {}})
    return out


def table() -> str:
    lines = ["| file | row | mbs | predicted GiB | measured GiB | error |", "|---|---|---|---|---|---|"]
    for case in cases():
        peak = predict(case["argv"])
        if case["measured"] is None:
            fits = "fits" if peak.peak <= OOM_BUDGET else "does not fit"
            lines.append(f"| {case['file']} | {case['name']} | {case['mbs']} | {peak.peak / GIB:.2f} ({fits} 80 "
                         f"GiB; persistent {peak.persistent / GIB:.2f}) | out of memory | — |")
            continue
        err = (peak.peak - case["measured"]) / case["measured"]
        lines.append(f"| {case['file']} | {case['name']} | {case['mbs']} | {peak.peak / GIB:.2f} | "
                     f"{case['measured'] / GIB:.2f} | {err:+.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
