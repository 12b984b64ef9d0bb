"""resolve() as a table: sites in, (format, winning rule) out; plus the rank-0 table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agoq.policy import (
    ScheduleInfo,
    Site,
    check_rules_used,
    format_table,
    load_policy,
    model_sites,
    policy_from_dict,
    policy_table,
    resolve,
    resolve_name,
    to_json,
    unmatched_rules,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"

POLICY = policy_from_dict(
    {
        "version": 1,
        "default": {"activations": "int8_b128"},
        "rules": [
            {
                "when": {"role": ["attn.q", "attn.k", "attn.v", "attn.out"]},
                "set": {"activations": "bf16"},
            },  # 0
            {"when": {"layers": [0, 1]}, "set": {"activations": "bf16"}},  # 1
            {
                "when": {"pp_stage": "last", "role": "mlp.swiglu_input"},
                "set": {"activations": "int4_b64"},
            },  # 2
            {"when": {"pp_stage": 1, "vp_stage": 1}, "set": {"activations": "int6_b64"}},  # 3
            {"when": {"role": "embedding.output"}, "set": {"activations": "bf16"}},  # 4
            {"when": {"layers": "4-7", "role": "norm.input"}, "set": {"activations": "nf4_b64"}},  # 5
            {
                "when": {"pp_stage": "first", "vp_stage": 0, "role": "head.input"},
                "set": {"activations": "nf4_b64"},
            },  # 6
        ],
    },
    source="table-policy",
)

# (layer_idx, pp_rank, pp_size, vp_stage, vp_size, role) -> (format name, winning source)
RESOLVE_CASES = [
    # PP=1: one stage is both first and last.
    ((0, 0, 1, None, None, "norm.input"), ("bf16", "rules[1]")),
    ((0, 0, 1, None, None, "attn.q"), ("bf16", "rules[0]")),  # first match wins over rules[1]
    ((2, 0, 1, None, None, "mlp.swiglu_input"), ("int4_b64", "rules[2]")),  # rank 0 is last when P=1
    ((5, 0, 1, None, None, "norm.input"), ("nf4_b64", "rules[5]")),
    ((5, 0, 1, None, None, "attn.proj_input"), ("int8_b128", "default")),
    ((None, 0, 1, None, None, "head.input"), ("nf4_b64", "rules[6]")),  # first == last, vp None == chunk 0
    # PP=2, no virtual pipeline.
    ((3, 0, 2, None, None, "mlp.swiglu_input"), ("int8_b128", "default")),  # rank 0 is not last
    ((3, 1, 2, None, None, "mlp.swiglu_input"), ("int4_b64", "rules[2]")),
    ((3, 1, 2, None, None, "norm.input"), ("int8_b128", "default")),  # vp None counts as chunk 0, not 1
    ((None, 0, 2, None, None, "embedding.output"), ("bf16", "rules[4]")),
    ((None, 1, 2, None, None, "head.input"), ("int8_b128", "default")),  # rules[6] wants the first stage
    ((None, 1, 2, None, None, "loss.logits"), ("int8_b128", "default")),
    # PP=4: 'last' is rank 3 only.
    ((9, 2, 4, None, None, "mlp.swiglu_input"), ("int8_b128", "default")),
    ((12, 3, 4, None, None, "mlp.swiglu_input"), ("int4_b64", "rules[2]")),
    ((6, 1, 4, None, None, "norm.input"), ("nf4_b64", "rules[5]")),
    # PP=4, VPP=2.
    ((13, 1, 4, 1, 2, "attn.proj_input"), ("int6_b64", "rules[3]")),
    ((13, 1, 4, 1, 2, "attn.v"), ("bf16", "rules[0]")),
    ((3, 1, 4, 0, 2, "attn.proj_input"), ("int8_b128", "default")),
    ((15, 3, 4, 1, 2, "mlp.swiglu_input"), ("int4_b64", "rules[2]")),  # rules[2] precedes rules[3]
    ((13, 1, 4, 1, 2, "mlp.swiglu_input"), ("int6_b64", "rules[3]")),
    ((None, 0, 4, 0, 2, "head.input"), ("nf4_b64", "rules[6]")),
    ((None, 3, 4, 1, 2, "head.input"), ("int8_b128", "default")),
]


@pytest.mark.parametrize("site_args,expected", RESOLVE_CASES, ids=[str(c[0]) for c in RESOLVE_CASES])
def test_resolve_table(site_args, expected):
    site = Site(*site_args)
    assert resolve_name(POLICY, site) == expected
    assert resolve(POLICY, site) == POLICY.format(expected[0])


def test_resolve_defaults_only_policy_gives_default_everywhere():
    spec = policy_from_dict({"version": 1, "default": {"activations": "int4_b64"}})
    schedule = ScheduleInfo(pp_size=2, vp_size=2, num_microbatches=4)
    assert {resolve_name(spec, s, schedule) for s in model_sites(8, schedule)} == {("int4_b64", "default")}


def test_resolve_auto_rule_uses_stage_ladder():
    spec = load_policy(CONFIG_DIR / "agoq.yaml")
    schedule = ScheduleInfo(pp_size=4, vp_size=None, num_microbatches=8)
    got = [resolve_name(spec, Site(8 * r, r, 4, None, None, "norm.input"), schedule) for r in range(4)]
    assert got == [
        ("nf4_b64", "default auto"),
        ("int6_b64", "default auto"),
        ("int8_b128", "default auto"),
        ("bf16", "default auto"),
    ]
    assert resolve_name(spec, Site(0, 0, 4, None, None, "attn.k"), schedule) == ("bf16", "rules[0]")


@pytest.mark.parametrize(
    "site,schedule,fragment",
    [
        (Site(0, 0, 2, None, None, "norm.input"), ScheduleInfo(4, None, 8), "site has pp_size=2"),
        (Site(0, 0, 4, None, None, "norm.input"), ScheduleInfo(4, 2, 8), "vp_size=None but the schedule"),
    ],
)
def test_resolve_refuses_site_schedule_mismatch(site, schedule, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve(POLICY, site, schedule)


def test_resolve_auto_without_schedule_names_the_fix():
    spec = load_policy(CONFIG_DIR / "agoq.yaml")
    with pytest.raises(
        ValueError, match=r"agoq.yaml: default sets activations: auto.*pass schedule=ScheduleInfo"
    ):
        resolve(spec, Site(0, 0, 1, None, None, "norm.input"))


def test_check_rules_used_names_dead_rules_and_layout():
    pattern = (
        r"table-policy: rules\[3\], rules\[5\], rules\[6\] decide no site of this model "
        r"\(layers 0..3, pp_size=2, vp_size=None\)"
    )
    with pytest.raises(ValueError, match=pattern):
        check_rules_used(POLICY, model_sites(4, ScheduleInfo(pp_size=2, vp_size=None, num_microbatches=4)))
    # PP=1: the only stage is first and last, so rules[6] lives; no chunk 1, so rules[3] is dead.
    with pytest.raises(ValueError, match=r"rules\[3\] decide"):
        check_rules_used(POLICY, model_sites(8, ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1)))
    spec = policy_from_dict(
        {
            "version": 1,
            "default": {"activations": "bf16"},
            "rules": [{"when": {"pp_stage": 1, "vp_stage": 1}, "set": {"activations": "int8_b128"}}],
        }
    )
    check_rules_used(
        spec, model_sites(16, ScheduleInfo(pp_size=4, vp_size=2, num_microbatches=8))
    )  # no raise


@pytest.mark.parametrize(
    "args,fragment",
    [
        ((0, 0, 1, None, None, "attn.qq"), "is not a role"),
        ((None, 0, 1, None, None, "norm.input"), "must be a global 0-based layer index"),
        ((3, 0, 1, None, None, "loss.logits"), "must be None"),
        ((-1, 0, 1, None, None, "norm.input"), "must be >= 0"),
        ((0, 2, 2, None, None, "norm.input"), r"pp_rank must be in \[0, pp_size=2\)"),
        ((0, 0, 2, 0, None, "norm.input"), "both None"),
        ((0, 0, 2, 2, 2, "norm.input"), r"vp_stage must be in \[0, vp_size=2\)"),
    ],
)
def test_site_validation(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        Site(*args)


def test_model_sites_interleaved_placement_matches_megatron():
    # megatron.md §1.1 (measured): PP=2, 4 layers, VPP=2 -> 1-based layers {1,3} on rank 0, {2,4} on rank 1.
    schedule = ScheduleInfo(pp_size=2, vp_size=2, num_microbatches=4)
    sites = model_sites(4, schedule, roles=("norm.input",))
    by_rank = {
        r: sorted(s.layer_idx for s in sites if s.pp_rank == r and s.layer_idx is not None) for r in (0, 1)
    }
    assert by_rank == {0: [0, 2], 1: [1, 3]}
    assert [(s.role, s.pp_rank, s.vp_stage) for s in sites if s.layer_idx is None] == [
        ("embedding.output", 0, 0),
        ("head.input", 1, 1),
        ("loss.logits", 1, 1),
    ]


def test_model_sites_uneven_split_not_modelled():
    with pytest.raises(NotImplementedError, match="divisible by pp_size \\* vp_size"):
        model_sites(10, ScheduleInfo(pp_size=4, vp_size=None, num_microbatches=4))


def test_unmatched_rules_reports_dead_rules_for_a_model():
    schedule = ScheduleInfo(pp_size=2, vp_size=None, num_microbatches=4)
    # rules[3] needs chunk 1 (no VPP here); 4 layers lack layers 4-7 (rules[5]);
    # rules[6] wants head.input on the first stage, but it lives on the last of two.
    assert unmatched_rules(POLICY, model_sites(4, schedule)) == [3, 5, 6]


def test_policy_table_agoq_pp4_is_the_nf45816_ladder():
    # algorithms.md §3.2: 32 layers, PP=4 -> layers 0-7 NF4, 8-15 NF5 (our 6-bit rung), 16-23 NF8, 24-31 FP16.
    spec = load_policy(CONFIG_DIR / "agoq.yaml")
    schedule = ScheduleInfo(pp_size=4, vp_size=None, num_microbatches=8)
    sites = model_sites(32, schedule)
    rows = policy_table(spec, sites, schedule)
    assert len(rows) == len(sites)
    swiglu = {row.layer_idx: row.format for row in rows if row.role == "mlp.swiglu_input"}
    expected = ["nf4_b64"] * 8 + ["int6_b64"] * 8 + ["int8_b128"] * 8 + ["bf16"] * 8
    assert [swiglu[i] for i in range(32)] == expected
    assert {row.inflight for row in rows if row.pp_rank == 1} == {3}
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["layers", "pp", "vp", "inflight", "embedding.output"]
    assert any(line.startswith("0-7 ") and "nf4_b64" in line for line in lines), text
    assert any(line.startswith("24-31") and "int6_b64" not in line for line in lines), text
    assert len(lines) == 1 + 1 + 4 + 1  # header, embedding, one line per stage, head+loss


def test_to_json_round_trips_rows():
    spec = load_policy(CONFIG_DIR / "int4.yaml")
    schedule = ScheduleInfo(pp_size=2, vp_size=2, num_microbatches=4)
    rows = policy_table(spec, model_sites(8, schedule), schedule)
    doc = json.loads(to_json(rows, spec, schedule))
    assert doc["policy_source"].endswith("int4.yaml")
    assert doc["schedule"] == {
        "pp_size": 2,
        "vp_size": 2,
        "num_microbatches": 4,
        "microbatch_group_size": None,
    }
    assert [r["format"] for r in doc["rows"]] == [row.format for row in rows]
    assert {r["format"] for r in doc["rows"] if r["role"] == "mlp.swiglu_input"} == {"int8_b128"}
