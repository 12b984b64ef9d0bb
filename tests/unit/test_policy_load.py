"""Policy loading: every validation error names file, key, bad value and allowed values; configs load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agoq.formats import format_names
from agoq.policy import AUTO, ROLES, PolicyError, load_policy, policy_from_dict
from agoq.policy.load import MAX_LAYER_IDX

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs" / "policy"
EXPECTED_CONFIGS = {"bf16.yaml", "int8.yaml", "agoq.yaml", "int4.yaml", "aggressive.yaml"}
AUTO_SECTION = {"base": "nf4_b64", "ladder": ["int6_b64", "int8_b128", "bf16"]}
ROLE_LIST = repr(list(ROLES))
_NAMES = format_names()
# The allowed-values text for format names: agoq.formats' own list or grammar, verbatim.
BUILTIN = "a built-in name: " + (_NAMES if isinstance(_NAMES, str) else ", ".join(_NAMES))


def _doc(**overrides) -> dict:
    """A valid policy with top-level keys replaced (a value of None deletes the key)."""
    doc = {"version": 1, "default": {"activations": "int8_b128"}, "rules": []}
    for key, value in overrides.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    return doc


def _rules(*rules) -> dict:
    return _doc(rules=list(rules))


def _write(tmp_path: Path, content) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def _load_error(tmp_path: Path, content) -> str:
    path = _write(tmp_path, content)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert str(path) in message, message  # every message names the file
    return message


# (id, policy document, fragments the message must contain: key, bad value, allowed values / fix)
ERROR_CASES = [
    ("top_level_not_mapping", ["a", "b"], ["<top level>", "['a', 'b']", "keys ['version'"]),
    ("unknown_top_key", _doc(colour="red"), ["colour: unknown key", "'colour'", "'formats', 'default'"]),
    ("missing_version", _doc(version=None), ["version: missing", "allowed: [1]"]),
    ("bad_version", _doc(version=2), ["version: unsupported", "got 2", "allowed: [1]"]),
    ("bool_version", _doc(version=True), ["version: unsupported", "got True", "allowed: [1]"]),
    ("missing_default", _doc(default=None), ["default: required", "'activations', 'grads'"]),
    ("empty_default", _doc(default={}), ["default: required", "got {}", "allowed: ['activations', 'grads']"]),
    (
        "default_optim_states_is_not_read",
        _doc(default={"activations": "bf16", "optim_states": "cint8_b32"}),
        ["default.optim_states: not read by agoq", "'cint8_b32'", "--agoq-moments", "remove the key"],
    ),
    (
        "fp8_recipe_te_always_fails",
        _doc(fp8={"recipe": "te"}),
        ["fp8.recipe: Transformer Engine", "got 'te'", "['off', 'current', 'delayed', 'rowwise']",
         "Fix: use current"],
    ),
    (
        "fp8_unquoted_off_is_yaml_false",  # `recipe: off` in a file: the docs' value, read by YAML as False
        yaml.safe_load("{version: 1, default: {activations: bf16}, fp8: {smooth_swiglu: off}}"),
        ["fp8.smooth_swiglu: unknown value", "got False", "Fix: YAML reads an unquoted off as false: write "
         "smooth_swiglu: 'off'"],
    ),
    (
        "default_not_mapping",
        _doc(default="bf16"),
        ["default: must be a mapping", "got 'bf16'", "'activations'"],
    ),
    (
        "default_without_activations",
        _doc(default={"grads": "int8_b128"}),
        ["default.activations: missing", "'activations'"],
    ),
    (
        "default_unknown_key",
        _doc(default={"activations": "bf16", "weights": "bf16"}),
        ["default.weights: unknown key", "'weights'", "['activations', 'grads']"],
    ),
    (
        "default_unknown_format",
        _doc(default={"activations": "int7_b64"}),
        ["default.activations: unknown format", "'int7_b64'", BUILTIN, "Fix: declare it"],
    ),
    (
        "default_grads_auto",
        _doc(default={"activations": "bf16", "grads": AUTO}),
        ["default.grads: unknown format", "'auto'", BUILTIN],
    ),
    ("formats_not_mapping", _doc(formats=["int4"]), ["formats: must be a mapping", "['int4']"]),
    (
        "format_named_auto",
        _doc(formats={AUTO: {"kind": "int", "bits": 4, "block": 64}}),
        ["formats.auto", "'auto'", "other than 'auto'"],
    ),
    (
        "format_unknown_field",
        _doc(formats={"my4": {"kind": "int", "bits": 4, "blocksize": 64}}),
        ["formats.my4.blocksize: unknown key", "'blocksize'", "'kind'", "'block'"],
    ),
    (
        "format_invalid_fields",
        _doc(formats={"my4": {"kind": "float9", "bits": 4, "block": 64}}),
        ["formats.my4: invalid format", "'float9'", "QuantFormat fields"],
    ),
    (
        "format_shadows_builtin",
        _doc(formats={"int4_b64": {"kind": "int", "bits": 4, "block": 32, "scale": "fp32"}}),
        [
            "formats.int4_b64: name is a built-in",
            "'block': 32",
            "Fix: rename it, or use the built-in name 'int4_b32'",
        ],
    ),
    (
        "format_declared_unused",
        _doc(formats={"my4": {"kind": "int", "bits": 4, "block": 32, "scale": "fp32"}}),
        ["formats.my4: declared but never used", "'my4'", "Fix: delete it"],
    ),
    ("rules_not_list", _doc(rules={"when": {}}), ["rules: must be a list", "{'when': {}}"]),
    ("rule_not_mapping", _rules("bf16"), ["rules[0]: must be a mapping", "'bf16'", "['when', 'set']"]),
    (
        "rule_unknown_key",
        _rules({"when": {}, "set": {"activations": "bf16"}, "then": 1}),
        ["rules[0].then: unknown key", "'then'", "['when', 'set']"],
    ),
    ("rule_missing_set", _rules({"when": {"role": "attn.q"}}), ["rules[0].set: missing", "['when', 'set']"]),
    (
        "when_unknown_key",
        _rules({"when": {"layer": 3}, "set": {"activations": "bf16"}}),
        ["rules[0].when.layer: unknown key", "'layer'", "['layers', 'pp_stage', 'vp_stage', 'role']"],
    ),
    (
        "set_unknown_key",
        _rules({"when": {"layers": 3}, "set": {"grads": "bf16"}}),
        ["rules[0].set.grads: unknown key", "'grads'", "['activations']"],
    ),
    (
        "set_missing_activations",
        _rules({"when": {"layers": 3}, "set": {}}),
        ["rules[0].set.activations: missing", "['activations']"],
    ),
    (
        "set_unknown_format",
        _rules({"when": {"layers": 1}, "set": {"activations": "fp4"}}),
        ["rules[0].set.activations: unknown format", "'fp4'", BUILTIN],
    ),
    (
        "unknown_role",
        _rules({"when": {"role": "mlp.fc3_input"}, "set": {"activations": "bf16"}}),
        ["rules[0].when.role: unknown role", "'mlp.fc3_input'", ROLE_LIST],
    ),
    (
        "unknown_role_in_list",
        _rules({"when": {"role": ["attn.q", "attn.qq"]}, "set": {"activations": "bf16"}}),
        ["rules[0].when.role: unknown role", "'attn.qq'", ROLE_LIST],
    ),
    (
        "empty_role_list",
        _rules({"when": {"role": []}, "set": {"activations": "bf16"}}),
        ["rules[0].when.role: empty list", "got []", ROLE_LIST],
    ),
    (
        "layers_bad_string",
        _rules({"when": {"layers": "first"}, "set": {"activations": "bf16"}}),
        ["rules[0].when.layers: bad layer selector", "'first'", "closed range string 'a-b'"],
    ),
    (
        "layers_reversed_range",
        _rules({"when": {"layers": "5-2"}, "set": {"activations": "bf16"}}),
        ["rules[0].when.layers: bad layer range", "'5-2'", "closed range string 'a-b'"],
    ),
    (
        "layers_negative",
        _rules({"when": {"layers": [1, -1]}, "set": {"activations": "bf16"}}),
        ["rules[0].when.layers: bad layer range", "got -1", "a list of those"],
    ),
    (
        "layers_bool",
        _rules({"when": {"layers": True}, "set": {"activations": "bf16"}}),
        ["rules[0].when.layers: bad layer selector", "got True", "an int"],
    ),
    (
        "layers_too_large",
        _rules({"when": {"layers": f"0-{MAX_LAYER_IDX + 1}"}, "set": {"activations": "bf16"}}),
        ["rules[0].when.layers: bad layer range", f"'0-{MAX_LAYER_IDX + 1}'", "a list of those"],
    ),
    (
        "layers_empty",
        _rules({"when": {"layers": []}, "set": {"activations": "bf16"}}),
        ["rules[0].when.layers: empty list", "got []", "a list of those"],
    ),
    (
        "pp_stage_word",
        _rules({"when": {"pp_stage": "middle"}, "set": {"activations": "bf16"}}),
        ["rules[0].when.pp_stage: bad pipeline stage", "'middle'", "'first' or 'last'"],
    ),
    (
        "pp_stage_negative",
        _rules({"when": {"pp_stage": -1}, "set": {"activations": "bf16"}}),
        ["rules[0].when.pp_stage: bad pipeline stage", "got -1", "'first' or 'last'"],
    ),
    (
        "vp_stage_string",
        _rules({"when": {"vp_stage": "last"}, "set": {"activations": "bf16"}}),
        ["rules[0].when.vp_stage: must be an integer >= 0", "'last'"],
    ),
    (
        "layerless_role_with_layers",
        _rules(
            {"when": {"layers": "0-3", "role": ["norm.input", "head.input"]}, "set": {"activations": "bf16"}}
        ),
        ["rules[0].when.role: these roles have no layer index", "['head.input']", "'norm.input'"],
    ),
    (
        "unreachable_identical",
        _rules(
            {"when": {"role": "attn.q"}, "set": {"activations": "bf16"}},
            {"when": {"role": ["attn.q"]}, "set": {"activations": "int4_b64"}},
        ),
        ["rules[1].when: rule can never match: rules[0]", "{'role': ['attn.q']}", "Fix: delete rules[1]"],
    ),
    (
        "unreachable_broader_earlier",
        _rules(
            {"when": {"layers": 5}, "set": {"activations": "bf16"}},
            {"when": {"layers": "0-7"}, "set": {"activations": "bf16"}},
            {"when": {"layers": "2-3", "pp_stage": 0, "role": "attn.k"}, "set": {"activations": "int4_b64"}},
        ),
        ["rules[2].when: rule can never match: rules[1]", "'layers': [2, 3]", "move it above rules[1]"],
    ),
    (
        "unreachable_first_is_zero",
        _rules(
            {"when": {"pp_stage": "first"}, "set": {"activations": "bf16"}},
            {"when": {"pp_stage": 0, "vp_stage": 1}, "set": {"activations": "bf16"}},
        ),
        ["rules[1].when: rule can never match: rules[0]", "'pp_stage': 0", "Fix: delete rules[1]"],
    ),
    (
        "unreachable_after_catch_all",
        _rules(
            {"when": {}, "set": {"activations": "bf16"}},
            {"when": {"pp_stage": "last"}, "set": {"activations": "bf16"}},
        ),
        ["rules[1].when: rule can never match: rules[0]", "'pp_stage': 'last'", "Fix"],
    ),
    (
        "auto_without_section",
        _rules({"when": {"pp_stage": 1}, "set": {"activations": AUTO}}),
        ["rules[0].set.activations: `auto` needs a top-level `auto:` section", "'auto'", "Fix: add `auto:"],
    ),
    (
        "auto_section_unused",
        _doc(auto=AUTO_SECTION),
        ["auto: section is never used", "Fix: set `activations: auto`"],
    ),
    (
        "auto_unknown_key",
        _doc(default={"activations": AUTO}, auto={**AUTO_SECTION, "levels": 3}),
        ["auto.levels: unknown key", "'levels'", "['base', 'ladder', 'rounding']"],
    ),
    (
        "auto_missing_ladder",
        _doc(default={"activations": AUTO}, auto={"base": "nf4_b64"}),
        ["auto.ladder: missing", "['base', 'ladder', 'rounding']"],
    ),
    (
        "auto_ladder_not_list",
        _doc(default={"activations": AUTO}, auto={"base": "nf4_b64", "ladder": "bf16"}),
        ["auto.ladder: must be a non-empty list", "'bf16'"],
    ),
    (
        "auto_unknown_base",
        _doc(default={"activations": AUTO}, auto={**AUTO_SECTION, "base": "nf3"}),
        ["auto.base: unknown format", "'nf3'", BUILTIN],
    ),
    (
        "auto_rung_not_above_base",
        _doc(default={"activations": AUTO}, auto={"base": "nf4_b64", "ladder": ["int4_b64", "bf16"]}),
        ["auto.ladder[0]: rungs must rise strictly", "'int4_b64' has 4 bits", "Fix: order the ladder"],
    ),
    (
        "auto_ladder_not_rising",
        _doc(default={"activations": AUTO}, auto={"base": "nf4_b64", "ladder": ["int8_b128", "int6_b64"]}),
        ["auto.ladder[1]: rungs must rise strictly", "'int6_b64' has 6 bits", "Fix: order the ladder"],
    ),
    (
        "auto_bad_rounding",
        _doc(default={"activations": AUTO}, auto={**AUTO_SECTION, "rounding": "ceil"}),
        ["auto.rounding: unknown rounding", "'ceil'", "['nearest', 'up', 'down']"],
    ),
]


@pytest.mark.parametrize("content,fragments", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_load_error_message_names_key_value_and_allowed(tmp_path, content, fragments):
    message = _load_error(tmp_path, content)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_load_missing_file_names_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError, match="cannot read policy file") as info:
        load_policy(path)
    assert str(path) in str(info.value) and "configs/policy/agoq.yaml" in str(info.value)


def test_load_yaml_syntax_error_names_line(tmp_path):
    message = _load_error(tmp_path, "version: 1\ndefault: {activations: bf16\nrules: []\n")
    assert "YAML syntax error at line 3" in message


def test_load_duplicate_key_is_an_error_with_both_lines(tmp_path):
    message = _load_error(
        tmp_path, "version: 1\ndefault: {activations: bf16}\ndefault: {activations: int8_b128}\n"
    )
    assert "duplicate key 'default' (first on line 2)" in message and "line 3" in message


def test_load_empty_file(tmp_path):
    assert "policy file is empty" in _load_error(tmp_path, "# only a comment\n")


def test_policy_error_is_value_error():
    with pytest.raises(ValueError, match="<dict>: version: missing"):
        policy_from_dict({"default": {"activations": "bf16"}})


def test_load_empty_rules_means_defaults_only(tmp_path):
    for rules in ([], None):
        spec = load_policy(_write(tmp_path, _doc(rules=rules) if rules is not None else _doc(rules=None)))
        assert spec.rules == () and spec.default_name("activations") == "int8_b128"
        assert spec.default_name("grads") is None


def test_load_empty_formats_section_means_none(tmp_path):
    assert load_policy(_write(tmp_path, "version: 1\nformats:\ndefault: {activations: bf16}\n")).rules == ()


def test_load_layers_syntax_int_range_and_list(tmp_path):
    spec = load_policy(
        _write(
            tmp_path,
            _rules(
                {"when": {"layers": 3}, "set": {"activations": "bf16"}},
                {"when": {"layers": "4-6"}, "set": {"activations": "bf16"}},
                {"when": {"layers": [0, "8-9", 12]}, "set": {"activations": "bf16"}},
                {
                    "when": {"layers": [20, 25]},
                    "set": {"activations": "bf16"},
                },  # a list: two layers, not a range
            ),
        )
    )
    assert [sorted(r.when.layers) for r in spec.rules] == [[3], [4, 5, 6], [0, 8, 9, 12], [20, 25]]


def test_load_declared_format_alias_and_builtin_names(tmp_path):
    fields = {"kind": "int", "bits": 4, "block": 32, "scale": "fp32"}
    spec = load_policy(
        _write(
            tmp_path,
            _doc(
                formats={"my4": fields},
                default={"activations": "my4"},
                rules=[{"when": {"role": "attn.q"}, "set": {"activations": "bf16"}}],
            ),
        )
    )
    assert spec.format("my4").bits == 4 and spec.format("my4").block == 32
    assert spec.format("bf16").bits == 16
    with pytest.raises(ValueError, match="'int6_b64' is not part of this policy"):
        spec.format("int6_b64")


def test_load_narrower_rule_after_disjoint_rules_is_reachable(tmp_path):
    # rules[1] overlaps rules[0] but is not covered by it (different role), so it is kept.
    spec = load_policy(
        _write(
            tmp_path,
            _rules(
                {"when": {"layers": "0-3", "role": "attn.q"}, "set": {"activations": "bf16"}},
                {"when": {"layers": 2}, "set": {"activations": "int4_b64"}},
                {"when": {"pp_stage": "last"}, "set": {"activations": "bf16"}},
                {
                    "when": {"pp_stage": 3},
                    "set": {"activations": "int4_b64"},
                },  # 'last' may not be 3: reachable
            ),
        )
    )
    assert len(spec.rules) == 4


def test_all_config_policies_load():
    found = {p.name for p in CONFIG_DIR.glob("*.yaml")}
    assert EXPECTED_CONFIGS <= found, f"missing configs: {EXPECTED_CONFIGS - found}"
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        spec = load_policy(path)
        assert spec.default_name("activations") is not None, path


def test_config_agoq_keeps_attention_internals_bf16_and_uses_auto():
    spec = load_policy(CONFIG_DIR / "agoq.yaml")
    assert spec.default_name("activations") == AUTO and spec.auto is not None
    assert spec.auto.base == "nf4_b64"
    attn_rules = [r for r in spec.rules if r.when.roles and "attn.q" in r.when.roles]
    assert attn_rules and attn_rules[0].activations == "bf16"


def test_docs_roles_table_matches_roles():
    text = (REPO_ROOT / "docs" / "policy.md").read_text()
    documented = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and cells[0].strip("`") in ROLES:
            documented[cells[0].strip("`")] = cells[1]
    assert documented == ROLES


def test_docs_example_policy_loads(tmp_path):
    text = (REPO_ROOT / "docs" / "policy.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    spec = load_policy(_write(tmp_path, example))
    assert spec.default_name("grads") == "int8_b256" and len(spec.rules) == 3
