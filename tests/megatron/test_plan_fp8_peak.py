"""The planner's FP8 / Smooth-SwiGLU terms (agoq.plan.fp8) against hand arithmetic and the committed H100 runs
(benchmarks/results/fp8_step.json, fp8_scale_1b.json, fp8_scale_7b.json). Pure Python besides the flag
parser of agoq.train.args."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from agoq.cli.agoq_flags import TRAINER_UNSET, add_agoq_flags
from agoq.config import AGOQ_FLAGS, AgoqConfig
from agoq.plan import memory, peak
from agoq.plan.memory import GIB, Layout, plan_stages
from agoq.plan.peak import Recipe, predict_peaks
from agoq.plan.shape import ModelShape
from agoq.policy import FP8Spec, load_policy
from tests.megatron._bench_scripts import load_bench_script

validate = load_bench_script("validate_planner")

BF16 = load_policy(validate.POLICIES / "bf16.yaml")
DELAYED = FP8Spec(recipe="delayed")


def _fp8_cases():
    return [c for name in validate.FP8_RUNS for c in validate.pretrain_cases(validate.BENCH / name)]


def test_fp8_runs_are_predicted_within_target():
    cases = _fp8_cases()
    assert len(cases) == 4 + 5 + 5 and validate.failures(cases) == []  # fp8_step, fp8_scale_1b, fp8_scale_7b
    assert sum("fp8" in c.name for c in cases) == 3 + 4 + 2
    # issue 27: the fused Smooth-SwiGLU rows of the fp8_scale suite within 1 % (its done-criterion)
    smooth = [c for c in cases if c.source.startswith("fp8_scale") and "smooth-swiglu" in c.name]
    assert len(smooth) == 4 and all(abs(c.error) <= 0.01 for c in smooth), [(c.name, c.error) for c in smooth]


def test_the_fp8_rows_fail_without_the_fp8_terms(monkeypatch):
    with monkeypatch.context() as m:  # no weight cache: the 7B-layer FP8 rows fall 6 % short
        m.setattr(peak, "fp8_persistent_bytes", lambda *a: 0)
        bad = validate.failures(_fp8_cases())
        assert any("7b-layers/mbs1/fp8 delayed" in b for b in bad) and not any("/bf16" in b for b in bad)
    with monkeypatch.context() as m:  # no saved-activation change: Smooth-SwiGLU at mbs 4 over-predicted 11 %
        m.setattr(memory, "saved_delta_bytes", lambda *a: 0)
        bad = validate.failures(_fp8_cases())
        assert any("1b/mbs4/fp8 delayed + smooth-swiglu" in b for b in bad)


def test_fp8_peak_in_the_step_is_the_weight_cache():
    """Tiny activations: the step is the peak, and FP8 adds exactly 2 B per linear weight element of every FP8
    layer (the first and last stay bf16) plus delayed scaling's state (3 slots x 64 x 20 fp32 + int32[2])."""
    shape = ModelShape(6, 256, 4, 2, 512, 1000)
    layout = Layout(mbs=1, gbs=1, seq=16)
    (bf16,) = predict_peaks(shape, layout, BF16)
    (fp8,) = predict_peaks(shape, layout, BF16, Recipe(fp8=DELAYED))
    assert bf16.phase == fp8.phase == "optimizer step"
    linear_elements = shape.layer_params() - 2 * shape.hidden_size  # minus the two norm weights
    state = 4 * 3 * (64 * 20 * 4 + 8)
    assert fp8.peak - bf16.peak == fp8.fp8 == (shape.num_layers - 2) * (2 * linear_elements + state)
    (first_two,) = predict_peaks(shape, layout, BF16, Recipe(fp8=FP8Spec(recipe="current", bf16_first_layers=0,
                                                                         bf16_last_layers=4)))
    assert first_two.fp8 == 2 * 2 * linear_elements  # current scaling: no state


def test_fp8_and_smooth_swiglu_held_bytes():
    """bf16 policy: an FP8 layer keeps qkv / fc1 / fc2 inputs in 1 B instead of 2 and adds a 1 B copy of the
    attention output (its bf16 save was a view): -T (h + f) per FP8 layer (Megatron's SwiGLU before the FP8 fc2:
    the code before the plain fusion); per-token Smooth-SwiGLU drops Megatron's x_linear + 0 tensor and keeps s:
    -T (2 f - 4) per layer (all layers), and fused with the FP8 fc2 (delayed scaling, agoq.ops.smooth_swiglu_fp8)
    keeps no silu output either: -2 T f per FP8 layer."""
    shape = ModelShape(6, 256, 4, 2, 512, 1000)
    layout = Layout(mbs=2, gbs=2, seq=64)
    tokens, h, f = 128, 256, 512
    (base,) = plan_stages(shape, layout, BF16)
    (fp8,) = plan_stages(shape, layout, BF16, fp8=DELAYED, plain_swiglu_fusion=False)
    (smooth,) = plan_stages(shape, layout, BF16, fp8=FP8Spec(recipe="delayed", smooth_swiglu="per-token"))
    assert base.activations - fp8.activations == 4 * tokens * (h + f)
    fp8_layers = sum(DELAYED.uses_fp8(i, shape.num_layers) for i in range(shape.num_layers))
    assert fp8.activations - smooth.activations == 6 * tokens * (2 * f - 4) + fp8_layers * 2 * tokens * f
    (channel_fp8,) = plan_stages(shape, layout, BF16, fp8=FP8Spec(recipe="delayed", smooth_swiglu="per-channel"))
    # per channel: s is [f] not [T]; each FP8 layer holds its micro-batch's FP8 W * s (2 layouts, 1 B), each
    # bf16 layer Megatron's saved bf16 W * s
    assert channel_fp8.activations - smooth.activations == 6 * 4 * (f - tokens) + 6 * 2 * h * f
    (channel,) = plan_stages(shape, layout, BF16, fp8=FP8Spec(smooth_swiglu="per-channel"))  # bf16 linears
    assert channel.activations - base.activations == 6 * (-2 * tokens * f + 4 * f + 2 * h * f)


def test_fused_plain_swiglu_fp8_held_bytes():
    """Plain SwiGLU fused with the FP8 fc2 (delayed scaling, agoq.ops.smooth_swiglu_fp8.swiglu_fp8_fc2): with a bf16
    fc1 output the op keeps h and fc2's FP8 input, not Megatron's silu output and x_linear + 0 tensor: -2 x 2 B x T f
    per FP8 layer; with the fc1 output stored quantized (agoq policy) both paths keep the same codes; current
    scaling and the bf16 first / last layers never fuse."""
    shape = ModelShape(6, 256, 4, 2, 512, 1000)
    layout = Layout(mbs=2, gbs=2, seq=64)
    tokens, f = 128, 512
    fp8_layers = sum(DELAYED.uses_fp8(i, shape.num_layers) for i in range(shape.num_layers))
    agoq = load_policy(validate.POLICIES / "agoq.yaml")
    for policy, saved in ((BF16, fp8_layers * 4 * tokens * f), (agoq, 0)):
        (unfused,) = plan_stages(shape, layout, policy, fp8=DELAYED, plain_swiglu_fusion=False)
        (fused,) = plan_stages(shape, layout, policy, fp8=DELAYED)
        assert unfused.activations - fused.activations == saved
    current = FP8Spec(recipe="current")
    assert plan_stages(shape, layout, BF16, fp8=current) == plan_stages(shape, layout, BF16, fp8=current,
                                                                         plain_swiglu_fusion=False)


FC2_QUANTIZED_POLICY = """version: 1
default: {activations: bf16}
rules:
  - when: {role: [mlp.fc2_input]}
    set: {activations: nf4_b64}
"""


@pytest.mark.parametrize("smooth", ["off", "per-token"])
def test_a_quantized_fc2_request_keeps_the_unfused_path_and_its_bytes(tmp_path, smooth):
    """SwiGLU input bf16 and mlp.fc2_input nf4 on FP8 layers under delayed scaling: the fused SwiGLU -> FP8 fc2 op
    would keep fc2's input as E4M3 (1 B) where the policy asks NF4, so it does not run (agoq.megatron.mlp) and the
    planner counts the NF4 copy: the fusion switch changes nothing, and the request saves bytes against a bf16 fc2
    input by exactly the NF4 codes + scales vs the FP8 linear's 1 B copy (per FP8 layer)."""
    from agoq.formats import parse_format

    path = tmp_path / "fc2_nf4.yaml"
    path.write_text(FC2_QUANTIZED_POLICY)
    policy = load_policy(path)
    shape = ModelShape(6, 256, 4, 2, 512, 1000)
    layout = Layout(mbs=2, gbs=2, seq=64)
    spec = FP8Spec(recipe="delayed", smooth_swiglu=smooth)
    (fused,) = plan_stages(shape, layout, policy, fp8=spec)
    (unfused,) = plan_stages(shape, layout, policy, fp8=spec, plain_swiglu_fusion=False)
    assert fused.activations == unfused.activations
    tokens, f = 128, 512
    nf4 = parse_format("nf4_b64")
    nf4_bytes = nf4.code_bytes(tokens * f) + nf4.num_blocks(tokens * f) * 4  # codes + fp32 block scales
    (bf16_fc2,) = plan_stages(shape, layout, BF16, fp8=spec, plain_swiglu_fusion=False)
    fp8_layers = sum(spec.uses_fp8(i, shape.num_layers) for i in range(shape.num_layers))
    bf16_layers = shape.num_layers - fp8_layers
    # FP8 layers: NF4 copy instead of the FP8 linear's 1 B copy; bf16 layers: NF4 copy instead of the bf16 input
    expected = fp8_layers * (1 * tokens * f - nf4_bytes) + bf16_layers * (2 * tokens * f - nf4_bytes)
    if smooth != "off":  # the bf16 request's fused Smooth-SwiGLU op also keeps no silu output (-2 B T f per FP8 layer)
        expected -= fp8_layers * 2 * tokens * f
    assert bf16_fc2.activations - unfused.activations == expected


def test_committed_plain_fp8_rows_predate_the_fused_path():
    """The committed plain FP8 runs (fp8_step.json, fp8_scale_*.json) ran Megatron's SwiGLU before the FP8 fc2: the
    validation predicts them with the code of their date (Recipe.fuse_plain_swiglu_fp8 False, within 0.5 %). The
    current code predicts the 1b/mbs4 row (forward/backward peak) 14 FP8 layers x 4 B x T f = 3.5 GiB lower, a gap
    to the committed measurement until the fused path is measured (docs/numerics.md gives the command); the other plain
    rows peak in the optimizer step and do not move."""
    report = json.loads((validate.BENCH / "fp8_scale_1b.json").read_text())
    assert report["date"] < validate.PLAIN_SWIGLU_FP8_FUSION_SINCE
    moved = {}
    for name in validate.FP8_RUNS:
        report = json.loads((validate.BENCH / name).read_text())
        for v in report["variants"]:
            if "fp8 delayed" not in v["name"] or "smooth" in v["name"]:
                continue
            shape, layout, policy, recipe = validate.from_pretrain_argv(v["command"].split())
            dated, past = validate._dated(recipe, report, v["name"])
            assert not dated.fuse_plain_swiglu_fp8
            (old,) = validate.predict_dated(shape, layout, load_policy(validate._policy_path(policy)), (dated, past))
            (new,) = validate.predict_dated(shape, layout, load_policy(validate._policy_path(policy)),
                                            (dataclasses.replace(dated, fuse_plain_swiglu_fp8=True), past))
            moved[v["name"]] = old.peak - new.peak
    assert moved.pop("1b/mbs4/fp8 delayed") == 14 * 4 * (4 * 2048) * 8192 == 3.5 * GIB
    assert moved and all(d == 0 for d in moved.values()), moved


@pytest.mark.parametrize("extra", [[], ["--agoq-fp8", "delayed"],
                                   ["--agoq-fp8", "rowwise", "--agoq-smooth-swiglu", "per-channel",
                                    "--agoq-fp8-bf16-first-layers", "0", "--agoq-fp8-amax-history-len", "32"],
                                   ["--agoq-fp8", "current", "--agoq-fp8-bf16-last-layers", "3", "--agoq-disable"]])
def test_validate_reads_the_fp8_flags_as_pretrain_llama(extra):
    assert validate.FP8_FLAGS == {f.name: f.flag for f in AGOQ_FLAGS if f.section == "fp8"}
    argv = ["--num-layers", "8", "--agoq-policy", "configs/policy/bf16.yaml", *extra]
    parser = argparse.ArgumentParser()
    add_agoq_flags(parser, unset=TRAINER_UNSET)
    args, _ = parser.parse_known_args(argv)
    expected = FP8Spec() if "--agoq-disable" in argv else AgoqConfig.from_flags(vars(args), policy=BF16).fp8
    assert validate.fp8_spec_of(argv, "configs/policy/bf16.yaml") == expected


@pytest.mark.parametrize("name", validate.FP8_RUNS)
def test_fp8_persistent_bytes_match_the_allocated_after_the_step(name):
    """What each FP8 run had allocated after its last step beyond the bf16 run (same shape) is the predicted
    cache + state, to 1 % (the rest, 3 MB at 1B and 15 MB at 7B, is not modelled: docs/benchmarks/planner.md)."""
    variants = {v["name"]: v for v in json.loads((validate.BENCH / name).read_text())["variants"]}
    bf16 = next(v for n, v in variants.items() if n.endswith("/bf16"))
    for n, v in variants.items():
        shape, layout, policy, recipe = validate.from_pretrain_argv(v["command"].split())
        (p,) = predict_peaks(shape, layout, load_policy(validate._policy_path(policy)), recipe)
        extra = (v["memory_breakdown_last"]["allocated_gib"] - bf16["memory_breakdown_last"]["allocated_gib"]) * GIB
        assert extra == pytest.approx(p.fp8, rel=0.01, abs=2**20), n


def test_cli_takes_the_fp8_flags(capsys):
    from agoq.plan.__main__ import main

    argv = ["--num-layers", "6", "--hidden-size", "1024", "--num-attention-heads", "8", "--num-query-groups", "8",
            "--ffn-hidden-size", "4096", "--vocab-size", "1000", "--micro-batch-size", "1", "--global-batch-size",
            "1", "--seq-length", "16",
            "--memory-budget", "80GiB", "--policies", str(validate.POLICIES / "bf16.yaml")]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--agoq-fp8", "delayed", "--agoq-fp8-bf16-last-layers", "0"]) == 0
    fp8 = capsys.readouterr().out
    persistent = [float(out.split("persistent")[1].split()[0]) for out in (plain, fp8)]
    shape = ModelShape(6, 1024, 8, 8, 4096, 1000)
    cache = 5 * 2 * (shape.layer_params() - 2 * 1024)  # 5 FP8 layers (first stays bf16), 2 B per weight element
    assert cache / GIB > 0.15 and persistent[1] - persistent[0] == pytest.approx(cache / GIB, abs=0.011)  # 2 decimals


def test_pretrain_llama_start_up_prediction_carries_the_fp8_spec():
    """agoq.train.memory_report.recipe_from_config (the script's start-up prediction and bench_pretrain's
    predicted_peak_gib) on the fp8_scale suite's own command lines."""
    import importlib.util

    from agoq.testing.procs import REPO_ROOT
    from agoq.train.args import parse_args
    from agoq.train.memory_report import recipe_from_config

    script = REPO_ROOT / "benchmarks" / "bench_pretrain.py"
    spec = importlib.util.spec_from_file_location("bench_pretrain_fp8plan", script)
    bench_pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_pretrain)

    for variant in bench_pretrain.fp8_scale_suite(False):
        args = parse_args(variant["args"])
        fp8 = recipe_from_config(args.agoq_config).fp8
        assert fp8 == validate.fp8_spec_of(variant["args"], args.agoq_policy or validate.POLICIES / "agoq.yaml")
        assert fp8.fp8_enabled == ("fp8" in variant["name"]), variant["name"]
        assert fp8.smooth_swiglu == ("per-token" if "per-token" in variant["name"] else
                                     "per-channel" if "per-channel" in variant["name"] else "off")


def test_start_up_prediction_follows_the_plain_fusion_switch():
    """The trainer's start-up prediction (memory_report.recipe_from_config) models what the run will do: the fused
    path by default, Megatron's SwiGLU under AGOQ_FP8_SWIGLU_FUSION=0 (AgoqConfig.kernels.fuse_swiglu_fp8)."""
    from agoq.config.sections import KernelsConfig
    from agoq.train.memory_report import recipe_from_config

    assert recipe_from_config(AgoqConfig()).fuse_plain_swiglu_fp8
    assert not recipe_from_config(AgoqConfig(kernels=KernelsConfig(fuse_swiglu_fp8=False))).fuse_plain_swiglu_fp8


def test_validate_reads_the_plain_fusion_switch_off_a_recorded_command():
    """bench_pretrain records a variant's environment ahead of its command: its plain-FP8 A/B row
    (AGOQ_FP8_SWIGLU_FUSION=0) is predicted with Megatron's SwiGLU, the others with the fused path."""
    from agoq.testing.procs import REPO_ROOT
    from agoq.train.environment import PLAIN_FUSION_ENV

    assert validate.PLAIN_FUSION_ENV == PLAIN_FUSION_ENV
    bench = load_bench_script("bench_pretrain")
    rows = {v["name"]: v for v in bench.fp8_scale_suite(False)}
    for name, fused in (("1b/mbs4/fp8 delayed", True), ("1b/mbs4/fp8 delayed, unfused swiglu", False)):
        line = bench.variant_command(rows[name], REPO_ROOT / "log.jsonl")[1]
        assert validate.from_pretrain_argv(line.split())[3].fuse_plain_swiglu_fp8 is fused, name
