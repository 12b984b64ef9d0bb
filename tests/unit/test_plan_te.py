"""The planner's Transformer Engine path (agoq.plan.te, ``python -m agoq.plan --transformer-impl transformer_engine``)
against the peaks measured on one H100 (benchmarks/results/te.json, te_8b.json), its refusals, and its terms.

The bound: the planner's target is 5 % of the measured peak (docs/benchmarks/planner.md, validate.TARGET). Every
term here is physical (read off what TE / Megatron / agoq allocate) and none is fitted to a row; the Megatron + TE
rows land within 0.05 % and the rows with a quantized policy 0.1-0.5 % under (one bf16 [T, h] tensor per micro-batch
the model does not hold, not identified: docs/benchmarks/planner.md). So the rows are held to ``BOUND`` = 1 %:
twice the largest residual, and a
5x tighter guard than the target, so a term that breaks (the attention mask, 0.2-0.5 % of a row, excepted: its own
test) fails here. The rows are predicted from their own command lines (benchmarks/validate_planner_te.py).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from agoq.plan import te
from agoq.plan.__main__ import main
from agoq.plan.fp8 import linear_shapes
from agoq.plan.memory import GIB, Layout, ModelShape
from agoq.plan.peak import Recipe
from agoq.policy import load_policy

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("validate_planner_te", REPO / "benchmarks/validate_planner_te.py")
validate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate)
CASES = validate.cases()
MEASURED = [c for c in CASES if c["measured"] is not None]
BOUND = 0.01
SHAPE_1B = ModelShape(16, 2048, 32, 8, 8192, 32000)
BASE = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32", "--num-query-groups", "8",
        "--ffn-hidden-size", "8192", "--seq-length", "4096", "--vocab-size", "32000", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--memory-budget", "80GiB", "--no-gradient-accumulation-fusion"]
TE = ["--transformer-impl", "transformer_engine"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]


def test_every_row_of_the_te_results_is_predicted():
    # 12 rows of te.json + the 8B agoq row (expandable segments) + the 8B Megatron + TE OOM row
    assert len(MEASURED) == 13 and len(CASES) == 14


@pytest.mark.parametrize("case", MEASURED, ids=lambda c: f"{c['file']}:{c['name']}")
def test_predicted_peak_within_target_of_the_measured(case):
    peak = validate.predict(case["argv"]).peak
    err = (peak - case["measured"]) / case["measured"]
    assert BOUND <= validate.TARGET
    assert abs(err) <= BOUND, f"{case['name']}: predicted {peak / GIB:.2f} GiB, measured " \
                                        f"{case['measured'] / GIB:.2f} ({err:+.1%})"


def test_8b_megatron_te_with_its_levers_is_predicted_not_to_fit_80gib():
    (case,) = [c for c in CASES if c["measured"] is None]
    assert "--agoq-disable" in case["argv"] and "--use-precision-aware-optimizer" in case["argv"]
    peak = validate.predict(case["argv"])
    assert peak.peak > validate.OOM_BUDGET
    # not an activation question: weights, gradients, optimizer and FP8 weights alone exceed the GPU
    assert peak.persistent > validate.OOM_BUDGET


@pytest.mark.parametrize("name", ["te/fp8_delayed", "agoq_te/full_fp8"])
def test_the_cli_prints_the_prediction(name, capsys):
    (case,) = [c for c in CASES if c["name"] == name and c["file"] == "te.json"]
    assert main(case["argv"]) == 0
    out = capsys.readouterr().out
    printed = float(re.search(r"stage 0: predicted peak ([\d.]+) GiB", out).group(1))
    assert printed == pytest.approx(validate.predict(case["argv"]).peak / GIB, abs=0.006)
    assert "what the TE path changes" in out and "FP8 weight workspaces" in out


def test_a_row_flag_the_planner_does_not_know_fails_the_parse():
    command = ["/x/megatron_gpt_upstream.py", *BASE, "--some-megatron-flag", "1"]
    with pytest.raises(SystemExit):
        validate.predict(validate.planner_argv(command))


@pytest.mark.parametrize("extra, words", [
    (TE + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise"),
    (TE + ["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2"),
    (TE + ["--agoq-fp8", "delayed"], "--agoq-fp8"),
    (TE + ["--agoq-disable", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype",
           "fp8"], "--exp-avg-dtype fp8"),
    (TE + ["--agoq-disable", "--use-precision-aware-optimizer"], "--use-distributed-optimizer"),
    (TE + ["--agoq-disable", "--agoq-optimizer", "adamw"], "--agoq-optimizer"),
    (TE + ["--recompute-granularity", "selective"], "selective"),
    (TE + ["--policies", "configs/policy/aggressive.yaml"], "attn.q"),
    (TE + ["--gpus", "2"], "--gpus N"),
    (FP8, "--fp8-format"),
])
def test_combinations_not_modelled_are_refused_in_one_line(extra, words, capsys):
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_shipped_candidates_the_scopes_refuse_are_skipped_out_loud(capsys):
    assert main(BASE + TE + ["--memory-budget", "2GiB"]) == 3
    out = capsys.readouterr().out
    assert "aggressive: skipped on TE" in out and "attn.q" in out
    assert re.search(r"^\s+agoq\s+stage 0", out, re.M)


def _layer(fp8: bool, policy=None):
    layout = Layout(mbs=2, gbs=16, seq=4096)
    dims = te.layer_dims(SHAPE_1B, layout)
    return te.te_layer_bytes(te.role_formats(policy, 0, layout), dims, fp8), dims


def test_fp8_keeps_the_gemm_inputs_at_one_byte_whatever_the_policy():
    agoq = load_policy(REPO / "configs/policy/agoq.yaml")
    for policy in (None, agoq):
        held, dims = _layer(True, policy)
        t = dims.tokens
        assert held["attn.qkv_input"] == held["mlp.fc1_input"] == t * dims.hidden
        assert held["attn.proj_input"] == t * dims.hidden  # n d = h here
        assert held["mlp.fc2_input"] == t * dims.ffn
    bf16, _ = _layer(False)
    assert bf16["attn.proj_input"] == 0  # the attention's own output tensor
    quantized, _ = _layer(False, agoq)
    assert 0 < quantized["attn.proj_input"] < bf16["attn.out"]  # a copy beside the attention's (a cost in bf16)
    assert quantized["mlp.swiglu_input"] < bf16["mlp.swiglu_input"] / 3


def test_fp8_weight_workspaces_are_two_bytes_per_layer_linear_parameter():
    settings = te.TESettings(fp8=True, amax_history_len=1)
    linears = sum(n * k for n, k in linear_shapes(SHAPE_1B).values())
    history = 4 * te.TE_MODULES_PER_LAYER * (te.DELAYED_FWD_TENSORS + te.DELAYED_BWD_TENSORS)
    assert te.te_fp8_weight_bytes(SHAPE_1B, settings, 16) == 16 * (2 * linears + history)
    assert te.te_fp8_weight_bytes(SHAPE_1B, te.TESettings(fp8=False), 16) == 0


def test_precision_aware_optimizer_keeps_remainder_and_moment_dtypes():
    layout = Layout(mbs=2, gbs=16, seq=4096, distributed_optimizer=True)
    plain = te.predict_te_peak(SHAPE_1B, layout, None, Recipe(), te.TESettings(agoq=False))
    aware = te.predict_te_peak(SHAPE_1B, layout, None, Recipe(), te.TESettings(
        agoq=False, precision_aware=True, exp_avg="bf16", exp_avg_sq="bf16"))
    assert plain.optimizer == 12 * plain.grads // 4 and aware.optimizer == 6 * aware.grads // 4
    assert aware.held == plain.held and aware.fp8 == plain.fp8 == 0


def test_the_attention_mask_and_full_recompute_change_the_held_bytes():
    layout = Layout(mbs=2, gbs=16, seq=4096)
    settings = te.TESettings(agoq=False, grad_accumulation_fusion=False)
    base = te.predict_te_peak(SHAPE_1B, layout, None, Recipe(), settings)
    no_mask = te.predict_te_peak(SHAPE_1B, layout, None, Recipe(),
                                 te.TESettings(agoq=False, grad_accumulation_fusion=False, attention_mask=False))
    assert base.held - no_mask.held == 2 * 4096 * 4096  # bool [b, 1, s, s]
    recompute = te.predict_te_peak(SHAPE_1B, layout, None, Recipe(recompute=True), settings)
    per_layer = sum(te.te_layer_bytes(te.role_formats(None, 0, layout), te.layer_dims(SHAPE_1B, layout),
                                      False).values())
    assert recompute.held == base.held - 16 * per_layer + 16 * 2 * 8192 * 2048 + per_layer
