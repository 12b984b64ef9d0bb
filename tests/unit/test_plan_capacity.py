"""python -m agoq.plan --capacity: the fewest GPUs and the layout per preset, checked against the per-layout
predictor (agoq.plan.peak.predict_peaks) called directly, with the layouts written out by hand."""

from __future__ import annotations

import json

import pytest

from agoq.plan import __main__ as plan
from agoq.plan import capacity
from agoq.plan.memory import GIB, Layout
from agoq.plan.peak import Recipe, predict_peaks
from agoq.plan.shape import ModelShape
from agoq.policy import load_policy

LLAMA3_VOCAB = 128256  # meta-llama/Meta-Llama-3-8B config.json vocab_size
LLAMA3_8B = ModelShape(32, 4096, 32, 8, 14336, LLAMA3_VOCAB)  # configs/model/llama3-8b.yaml
LLAMA_32B = ModelShape(64, 5120, 40, 8, 27648, LLAMA3_VOCAB)  # configs/model/llama-32b.yaml
BUDGET = 80 * GIB
SEQ = 4096
GBS = 24  # divisible by every DP size 1..4, 6 and 8: no layout of those is skipped for its batch


@pytest.fixture(scope="module")
def policies():
    return {n: load_policy(plan.POLICY_DIR / f"{n}.yaml") for n in plan.DEFAULT_CANDIDATES}


def _kw(**over):
    return {"seq": SEQ, "vocab": LLAMA3_VOCAB, "divisible_by": 128, "base_flags": {}, "gbs": GBS, **over}


def _preset(name):
    return next(p for p in capacity.PRESETS if p.name == name)


def _baseline_peak(tp, pp, dp, distopt, recompute, policies) -> int:
    """Megatron's baseline at one layout, from predict_peaks directly (no capacity code)."""
    shape = ModelShape(**{**LLAMA3_8B.__dict__, "vocab_size": -(-LLAMA3_VOCAB // (128 * tp)) * 128 * tp})
    layout = Layout(tp=tp, pp=pp, dp=dp, mbs=1, gbs=GBS, seq=SEQ, distributed_optimizer=distopt)
    recipe = Recipe(optimizer="torch", recompute=recompute == "full", selective_recompute=recompute == "selective")
    return max(p.peak for p in predict_peaks(shape, layout, policies["bf16"], recipe))


def test_megatron_needs_more_than_one_gpu_for_the_8b_shape_and_the_answer_is_minimal(policies):
    answer = capacity.find_capacity(LLAMA3_8B, _preset("megatron + distributed optimizer"), policies, BUDGET,
                                    max_gpus=8, **_kw())
    assert answer.fits and answer.best.gpus > 1
    c = answer.best
    assert c.tp * c.pp * c.dp == c.gpus and 32 % c.pp == 0 and 8 % c.tp == 0
    assert _baseline_peak(c.tp, c.pp, c.dp, c.distributed_optimizer, c.recompute, policies) <= BUDGET
    # every layout on one GPU fewer, written out by hand, with every recompute level: none fits
    smaller = {3: [(1, 1, 3)], 2: [(1, 1, 2), (1, 2, 1), (2, 1, 1)], 1: [(1, 1, 1)]}[c.gpus - 1]
    for tp, pp, dp in smaller:
        for distopt in (False, True) if dp > 1 else (False,):
            for recompute in (None, "selective", "full"):
                assert _baseline_peak(tp, pp, dp, distopt, recompute, policies) > BUDGET, (tp, pp, dp, recompute)


def test_the_8b_shape_fits_one_gpu_with_agoq_full_and_the_largest_micro_batch_is_the_limit(policies):
    answer = capacity.find_capacity(LLAMA3_8B, _preset("agoq full"), policies, BUDGET, max_gpus=2, **_kw())
    c = answer.best
    assert answer.fits and (c.gpus, c.tp, c.pp, c.dp) == (1, 1, 1, 1) and c.recompute is None
    recipe = Recipe(optimizer="agoq", grads="int8_b256")  # agoq full: 8-bit store, AdamW, flash moments, split24
    layout = Layout(mbs=1, gbs=GBS, seq=SEQ)
    assert max(p.peak for p in predict_peaks(LLAMA3_8B, layout, policies[c.policy], recipe)) <= BUDGET
    order = list(plan.DEFAULT_CANDIDATES)
    for richer in order[: order.index(c.policy)]:  # the policy it would write is the richest that fits
        assert max(p.peak for p in predict_peaks(LLAMA3_8B, layout, policies[richer], recipe)) > BUDGET
    bigger = Layout(mbs=2 * answer.max_mbs, gbs=GBS * 2 * answer.max_mbs, seq=SEQ)
    assert max(p.peak for p in predict_peaks(LLAMA3_8B, bigger, policies[c.policy], recipe)) > BUDGET


def test_when_nothing_fits_the_dominant_term_is_named_and_the_terms_add_up(policies):
    answer = capacity.find_capacity(LLAMA3_8B, _preset("megatron"), policies, BUDGET, max_gpus=1, **_kw())
    assert not answer.fits and answer.best.gpus == 1
    worst = answer.best.worst
    terms = capacity.terms_of(worst, answer.best.recipe)
    assert sum(terms.values()) == worst.peak and set(terms) <= set(capacity.TERMS)
    # Megatron's AdamW at the step: 8 B/param of moments against 2 weights, 4 master, 4 grads, 4 temporaries
    assert capacity.dominant_term(answer.best) == "optimizer states"
    record = capacity.answer_dict(answer, BUDGET, "configs/policy")
    assert record["fits"] is False and record["what_would_move_it"] == capacity.REMEDIES["optimizer states"]


def test_release_is_searched_only_where_it_runs_and_layouts_respect_heads_and_groups(policies):
    assert all(t == p == d == 1 for g in (1, 2, 4) for t, p, d in capacity.layouts(LLAMA3_8B, g)
               if capacity._allowed(_preset("agoq release"), t, p, d))
    assert (5, 1, 1) not in list(capacity.layouts(LLAMA_32B, 5))  # 40 heads divide by 5, 8 query groups do not
    eight = list(capacity.layouts(LLAMA3_8B, 8))
    assert all(32 % p == 0 for _, p, _ in eight) and (1, 8, 1) in eight and len(eight) == 10
    answer = capacity.find_capacity(LLAMA_32B, _preset("agoq release"), policies, BUDGET, max_gpus=2, **_kw())
    assert not answer.fits and (answer.best.tp, answer.best.pp, answer.best.dp) == (1, 1, 1)


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "cap.json"
    argv = ["--capacity", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--vocab-size", str(LLAMA3_VOCAB),
            "--seq-length", str(SEQ), "--global-batch-size", str(GBS), "--memory-budget", "80GiB", "--max-gpus", "4",
            "--out", str(out)]
    assert plan.main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [a["preset"] for a in report["answers"]] == [p.name for p in capacity.PRESETS]
    full = next(a for a in report["answers"] if a["preset"] == "agoq full")
    assert full["gpus"] == 1 and full["policy"].startswith("configs/policy/") and full["peak_gib"] <= 80
    rows = [line for line in table.splitlines() if line.split()[0] in ("megatron", "agoq")]
    assert len(rows) == len(capacity.PRESETS) and f"wrote {out}" in table


def test_cli_refuses_the_flags_capacity_mode_searches(capsys):
    model = str(plan.POLICY_DIR.parent / "model" / "llama3-8b.yaml")
    assert plan.main(["--capacity", "--config", model, "--memory-budget", "80GiB",
                      "--agoq-optimizer", "adamw", "--recompute-granularity", "full"]) == 2
    err = capsys.readouterr().err
    assert "--agoq-optimizer" in err and "--recompute-granularity" in err and "drop them" in err
