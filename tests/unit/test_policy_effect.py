"""A policy rule that names a layer role explicitly must change what that role stores somewhere in the model
(agoq.plan.storage.ineffective_requests / check_requests_take_effect): otherwise the run, the preflight and the
planner refuse it, naming the file, the rule, the role, why and the fix (house rule 5: nothing silent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agoq.plan.storage import NOT_APPLIED, RECOMPUTED, check_requests_take_effect, ineffective_requests
from agoq.policy import ScheduleInfo, load_policy, model_sites, policy_from_dict

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"
LAYOUTS = [(1, None, 8), (2, None, 8), (4, None, 16), (2, 2, 8), (4, 2, 16)]


def _spec(default: str, *rules: tuple[dict, str]) -> object:
    return policy_from_dict({"version": 1, "default": {"activations": default},
                             "rules": [{"when": when, "set": {"activations": fmt}} for when, fmt in rules]},
                            source="p.yaml")


def _bad(spec, pp=1, vp=None, microbatches=8, layers=8) -> list[tuple[int, str, str]]:
    schedule = ScheduleInfo(pp_size=pp, vp_size=vp, num_microbatches=microbatches)
    return [(b.rule, b.role, b.how) for b in ineffective_requests(spec, model_sites(layers, schedule), schedule)]


def test_a_role_rebuilt_from_another_roles_codes_cannot_be_set():
    # the norm input is quantized (int8 default): QKV / fc1 rebuild their input from it, whatever the rule says
    assert _bad(_spec("int8_b128", ({"role": ["attn.qkv_input", "attn.proj_input"]}, "bf16"))) == [
        (0, "attn.qkv_input", RECOMPUTED)]  # proj_input is stored as asked: only the dead half is named
    assert _bad(_spec("int8_b128", ({"role": "mlp.fc2_input"}, "int4_b64"))) == [(0, "mlp.fc2_input", RECOMPUTED)]
    # keep the norm in bf16 first and the same request takes effect
    assert _bad(_spec("int8_b128", ({"role": "norm.input"}, "bf16"), ({"role": "attn.qkv_input"}, "int4_b64"))) == []
    # a rule without roles sets every role by design: never named
    assert _bad(_spec("bf16", ({"layers": "0-3"}, "int8_b128"))) == []


def test_a_quantized_attention_internal_is_refused_and_bf16_is_honoured():
    assert _bad(_spec("bf16", ({"role": ["attn.q", "attn.v"]}, "int8_b128"))) == [(0, "attn.q", NOT_APPLIED),
                                                                                   (0, "attn.v", NOT_APPLIED)]
    assert _bad(_spec("int8_b128", ({"role": ["attn.q", "attn.k", "attn.v", "attn.out"]}, "bf16"))) == []


def test_a_request_that_takes_effect_on_one_stage_only_is_kept(tmp_path):
    """Under auto the last stage of PP=4 gets bf16 (agoq.yaml's ladder): its norm is not recomputed, so a rule for
    attn.qkv_input takes effect there, and on that layout only."""
    text = (POLICY_DIR / "agoq.yaml").read_text().replace(
        "rules:\n", "rules:\n  - when: {role: attn.qkv_input}\n    set: {activations: int8_b128}\n", 1)
    path = tmp_path / "stage.yaml"
    path.write_text(text)
    spec = load_policy(path)
    assert _bad(spec, pp=4, microbatches=16) == []
    assert _bad(spec, pp=1) == [(0, "attn.qkv_input", RECOMPUTED)]


@pytest.mark.parametrize("name", sorted(p.stem for p in POLICY_DIR.glob("*.yaml")))
def test_the_shipped_policies_ask_nothing_that_never_takes_effect(name):
    spec = load_policy(POLICY_DIR / f"{name}.yaml")
    for pp, vp, microbatches in LAYOUTS:
        assert _bad(spec, pp, vp, microbatches, layers=16) == [], (pp, vp)


def test_the_error_names_the_file_rule_role_cause_and_fix():
    spec = _spec("int8_b128", ({"role": "mlp.fc2_input"}, "bf16"), ({"role": "attn.out"}, "int4_b64"))
    schedule = ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=4)
    with pytest.raises(ValueError) as err:
        check_requests_take_effect(spec, model_sites(4, schedule), schedule)
    first, second = str(err.value).splitlines()
    assert first.startswith("p.yaml: rules[0] sets activations: bf16 for mlp.fc2_input, which never takes effect")
    assert "mlp.swiglu_input is quantized" in first and "Delete mlp.fc2_input from rules[0].when.role" in first
    assert second.startswith("p.yaml: rules[1] sets activations: int4_b64 for attn.out")
    assert "does not quantize the attention kernel's saved tensors" in second


def test_preflight_and_the_planner_refuse_it(tmp_path, capsys):
    from agoq.plan.__main__ import main as plan_main
    from agoq.train.args import parse_args, preflight

    path = tmp_path / "dead.yaml"
    path.write_text("version: 1\ndefault: {activations: int8_b128}\n"
                    "rules:\n  - when: {role: mlp.fc1_input}\n    set: {activations: bf16}\n")
    with pytest.raises(ValueError, match=r"dead.yaml: rules\[0\] sets activations: bf16 for mlp.fc1_input"):
        preflight(parse_args(["--agoq-policy", str(path)]), world_size=1)
    model = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"
    assert plan_main(["--config", str(model), "--vocab-size", "4096", "--policies", str(path),
                      "--memory-budget", "80GiB"]) != 0
    assert "dead.yaml: rules[0] sets activations: bf16 for mlp.fc1_input" in capsys.readouterr().err
