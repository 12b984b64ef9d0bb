"""agoq.plan: per-stage memory prediction, choice of the richest policy that fits, CLI.

The per-layer agoq bytes the planner uses are checked against bytes counted at run time in
tests/megatron/test_activations.py (test_saved_bytes_equal_planner_formula); here: the stage
arithmetic, the choice, and the command line. Pure Python (no Megatron needed)."""

from __future__ import annotations

from pathlib import Path

from agoq.plan.__main__ import main
from agoq.plan.memory import GIB, Layout, plan_stages
from agoq.plan.peak import choose_by_peak, predict_peaks
from agoq.plan.shape import ModelShape
from agoq.plan.storage import LayerDims, agoq_bytes, layer_storage, megatron_bytes
from agoq.policy import ScheduleInfo, Site, load_policy

POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policy"
SHAPE = ModelShape(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                   ffn_hidden_size=5632, vocab_size=32000)
LAYOUT = Layout(pp=2, mbs=4, gbs=64, seq=4096)
CANDIDATES = [(n, load_policy(POLICIES / f"{n}.yaml")) for n in ("bf16", "int8", "agoq", "int4")]


def test_stage_activations_are_inflight_times_layer_bytes():
    policy = load_policy(POLICIES / "agoq.yaml")
    stages = plan_stages(SHAPE, LAYOUT, policy)
    schedule = ScheduleInfo(2, None, LAYOUT.num_microbatches)
    dims = LayerDims(seq=4096, micro_batch=4, hidden=2048, ffn=5632, heads=32, groups=8)
    for stage in stages[:1]:  # first stage: no LM head term
        per_layer = 0
        for idx in stage.layers:
            st = layer_storage(policy, lambda role, i=idx, r=stage.pp_rank: Site(i, r, 2, None, None, role), schedule)
            per_layer += sum(agoq_bytes(st, dims).values()) + sum(megatron_bytes(st, dims).values())
        assert stage.inflight == 2 and stage.activations == per_layer * 2
    assert stages[0].layers == tuple(range(8)) and stages[1].layers == tuple(range(8, 16))


def test_richer_policies_cost_more_and_the_choice_follows_the_budget():
    peaks = {n: max(s.peak for s in predict_peaks(SHAPE, LAYOUT, p)) for n, p in CANDIDATES}
    assert peaks["bf16"] > peaks["int8"] > peaks["agoq"]
    assert choose_by_peak(SHAPE, LAYOUT, CANDIDATES, int(peaks["bf16"]) + 1)[0] == "bf16"
    assert choose_by_peak(SHAPE, LAYOUT, CANDIDATES, int(peaks["int8"]) + 1)[0] == "int8"
    assert choose_by_peak(SHAPE, LAYOUT, CANDIDATES, int(peaks["agoq"]) + 1)[0] in ("agoq",)
    assert choose_by_peak(SHAPE, LAYOUT, CANDIDATES, 1 * GIB)[0] is None


def test_cli_writes_the_chosen_policy_and_reports_no_fit(tmp_path, capsys):
    flags = ["--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads",
             "32", "--num-query-groups", "8", "--vocab-size", "32000", "--pipeline-model-parallel-size", "2",
             "--micro-batch-size", "4", "--global-batch-size", "64", "--seq-length", "4096"]
    out = tmp_path / "chosen.yaml"
    assert main(flags + ["--memory-budget", "1000GiB", "--out", str(out)]) == 0
    assert out.read_text() == (POLICIES / "bf16.yaml").read_text()
    assert main(flags + ["--memory-budget", "2GiB"]) == 3  # 0.71 GiB for PyTorch: 1.29 GiB is outside its allocator
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--memory-budget", "80GiB"]) == 2  # no model shape
