"""YAML -> PolicySpec with strict validation (no torch).

Every error is a ``PolicyError`` (a ValueError) whose message names the file, the key path
(``rules[3].when.role``), the bad value, the allowed values and, where one exists, the fix.
The schema is documented in docs/policy.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import yaml

from agoq.formats import QuantFormat, format_names, parse_format
from agoq.policy.schema import (
    AUTO,
    AUTO_ROUNDINGS,
    DEFAULT_KEYS,
    LAYERLESS_ROLES,
    POLICY_FP8_RECIPES,
    RETIRED_DEFAULT_KEYS,
    ROLES,
    SMOOTH_SWIGLU_MODES,
    AutoSpec,
    FP8Spec,
    Match,
    PolicySpec,
    Rule,
)

SUPPORTED_VERSIONS = (1,)
TOP_KEYS = ("version", "formats", "default", "rules", "auto", "fp8")
FP8_KEYS = tuple(f.name for f in dataclasses.fields(FP8Spec))
RULE_KEYS = ("when", "set")
WHEN_KEYS = ("layers", "pp_stage", "vp_stage", "role")
SET_KEYS = ("activations",)
AUTO_KEYS = ("base", "ladder", "rounding")
PP_STAGE_WORDS = ("first", "last")
#: Largest layer index a policy may name; guards "0-99999999" from building a huge set.
#: 2**16 is far beyond any LLaMA depth (405B has 126 layers).
MAX_LAYER_IDX = 1 << 16
_RANGE_RE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
_MISSING = object()


class PolicyError(ValueError):
    """A policy file problem; ``str()`` is the full user-facing message."""

    def __init__(
        self,
        source: str,
        key: str,
        problem: str,
        got: Any = _MISSING,
        allowed: Any = None,
        fix: str | None = None,
    ):
        self.source, self.key, self.problem, self.got, self.allowed, self.fix = (
            source,
            key,
            problem,
            got,
            allowed,
            fix,
        )
        message = f"{source}: {key}: {problem}" if key else f"{source}: {problem}"
        if got is not _MISSING:
            message += f"; got {got!r}"
        if allowed is not None:
            message += f"; allowed: {allowed}"
        if fix:
            message += f". Fix: {fix}"
        super().__init__(message)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (plain safe_load keeps the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_policy(path: str | os.PathLike) -> PolicySpec:
    """Read, parse and validate a policy YAML file."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise PolicyError(
            source,
            "",
            f"cannot read policy file ({err.strerror or err})",
            fix="pass an existing readable YAML file, e.g. configs/policy/agoq.yaml",
        ) from err
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown line"
        problem = getattr(err, "problem", None) or str(err)
        raise PolicyError(
            source, "", f"YAML syntax error at {where}: {problem}", fix="correct the YAML at that line"
        ) from err
    return policy_from_dict(data, source)


def policy_from_dict(data: Any, source: str = "<dict>") -> PolicySpec:
    """Validate an already-parsed policy mapping; ``source`` names it in error messages."""
    if data is None:
        raise PolicyError(source, "", "policy file is empty", fix="add at least `version: 1` and `default:`")
    _check_mapping(source, "", data, TOP_KEYS)
    if "version" not in data:
        raise PolicyError(
            source, "version", "missing", allowed=list(SUPPORTED_VERSIONS), fix="add `version: 1`"
        )
    if _plain_int(data["version"]) not in SUPPORTED_VERSIONS:
        raise PolicyError(
            source, "version", "unsupported version", got=data["version"], allowed=list(SUPPORTED_VERSIONS)
        )
    table = _FormatTable(source, data.get("formats") or {})  # `formats:` left empty = none
    default = _parse_default(source, data.get("default", _MISSING), table)
    rules = _parse_rules(source, data.get("rules", []), table)
    auto = _parse_auto(source, data["auto"], table) if "auto" in data else None
    fp8 = _parse_fp8(source, data["fp8"]) if "fp8" in data else None
    _check_auto_usage(source, auto, default, rules)
    _check_reachable(source, rules)
    table.check_all_declared_used()
    return PolicySpec(
        source=source,
        version=data["version"],
        formats=table.used_items(),
        default=tuple(default.items()),
        rules=rules,
        auto=auto,
        fp8=fp8,
    )


# --------------------------------------------------------------------------------- helpers ----
def _plain_int(value: Any) -> int | None:
    """``value`` if it is an int and not a bool (YAML `yes` is a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_mapping(source: str, key: str, value: Any, allowed_keys: tuple[str, ...]) -> None:
    if not isinstance(value, dict):
        raise PolicyError(
            source,
            key or "<top level>",
            "must be a mapping",
            got=value,
            allowed=f"a mapping with keys {list(allowed_keys)}",
        )
    for k in value:
        if k not in allowed_keys:
            where = f"{key}.{k}" if key else str(k)
            raise PolicyError(source, where, "unknown key", got=k, allowed=list(allowed_keys))


def _builtin_names() -> str:
    """agoq.formats.format_names() as text (a grammar string or a list of names)."""
    names = format_names()
    return names if isinstance(names, str) else ", ".join(names)


class _FormatTable:
    """Declared formats plus built-in names, tracking which ones the policy uses."""

    def __init__(self, source: str, declared: Any):
        self.source = source
        self.declared: dict[str, QuantFormat] = {}
        self.used: dict[str, QuantFormat] = {}
        if not isinstance(declared, dict):
            raise PolicyError(source, "formats", "must be a mapping of name -> format fields", got=declared)
        for name, fields in declared.items():
            self.declared[name] = self._declare(name, fields)

    def _declare(self, name: Any, fields: Any) -> QuantFormat:
        key = f"formats.{name}"
        if not isinstance(name, str) or not name or name == AUTO:
            raise PolicyError(
                self.source, key, "format names are non-empty strings other than 'auto'", got=name
            )
        field_names = tuple(f.name for f in dataclasses.fields(QuantFormat))
        _check_mapping(self.source, key, fields, field_names)
        try:
            fmt = QuantFormat(**fields)
        except (TypeError, ValueError) as err:
            raise PolicyError(
                self.source,
                key,
                f"invalid format ({err})",
                got=fields,
                allowed=f"QuantFormat fields {list(field_names)}",
            ) from err
        try:
            builtin = parse_format(name)
        except ValueError:
            return fmt
        if builtin != fmt:
            raise PolicyError(
                self.source,
                key,
                f"name is a built-in format meaning {builtin!r}, but the declared fields differ",
                got=fields,
                fix=f"rename it, or use the built-in name {fmt.name!r} for these fields",
            )
        return fmt

    def lookup(self, key: str, name: Any) -> QuantFormat:
        if isinstance(name, str) and name in self.declared:
            fmt = self.declared[name]
        else:
            try:
                fmt = parse_format(name) if isinstance(name, str) else None
            except ValueError:
                fmt = None
            if fmt is None:
                allowed = f"a declared format {sorted(self.declared)} or a built-in name: {_builtin_names()}"
                raise PolicyError(
                    self.source,
                    key,
                    "unknown format",
                    got=name,
                    allowed=allowed,
                    fix="declare it under `formats:` or use a built-in name",
                )
        self.used[name] = fmt
        return fmt

    def check_all_declared_used(self) -> None:
        for name in self.declared:
            if name not in self.used:
                raise PolicyError(
                    self.source,
                    f"formats.{name}",
                    "declared but never used",
                    got=name,
                    fix="delete it or refer to it from default/rules/auto",
                )

    def used_items(self) -> tuple[tuple[str, QuantFormat], ...]:
        return tuple(self.used.items())


def _parse_default(source: str, value: Any, table: _FormatTable) -> dict[str, str]:
    if value is _MISSING or value is None or value == {}:
        raise PolicyError(
            source,
            "default",
            "required and must set activations",
            got=None if value is _MISSING else value,
            allowed=list(DEFAULT_KEYS),
            fix="add e.g. `default: {activations: bf16}`",
        )
    if isinstance(value, dict):
        for key in value:
            if key in RETIRED_DEFAULT_KEYS:
                raise PolicyError(source, f"default.{key}", "not read by agoq", got=value[key],
                                  allowed=list(DEFAULT_KEYS), fix=RETIRED_DEFAULT_KEYS[key])
    _check_mapping(source, "default", value, DEFAULT_KEYS)
    if "activations" not in value:
        raise PolicyError(
            source,
            "default.activations",
            "missing (required)",
            allowed=list(DEFAULT_KEYS),
            fix="add `activations: <format>` to default",
        )
    out: dict[str, str] = {}
    for key, name in value.items():
        if not (key == "activations" and name == AUTO):
            table.lookup(f"default.{key}", name)
        out[key] = name
    return out


def _parse_auto(source: str, value: Any, table: _FormatTable) -> AutoSpec:
    _check_mapping(source, "auto", value, AUTO_KEYS)
    for key in ("base", "ladder"):
        if key not in value:
            raise PolicyError(
                source,
                f"auto.{key}",
                "missing (required)",
                allowed=list(AUTO_KEYS),
                fix="e.g. `auto: {base: nf4_b64, ladder: [int6_b64, int8_b128, bf16]}`",
            )
    base_fmt = table.lookup("auto.base", value["base"])
    ladder = value["ladder"]
    if not isinstance(ladder, list) or not ladder:
        raise PolicyError(source, "auto.ladder", "must be a non-empty list of format names", got=ladder)
    prev_name, prev_bits = value["base"], base_fmt.bits
    for i, name in enumerate(ladder):
        fmt = table.lookup(f"auto.ladder[{i}]", name)
        if fmt.bits <= prev_bits:
            raise PolicyError(
                source,
                f"auto.ladder[{i}]",
                f"rungs must rise strictly in bits above the base; "
                f"{name!r} has {fmt.bits} bits, {prev_name!r} before it has {prev_bits}",
                got=name,
                fix="order the ladder by bits and drop rungs not above the base",
            )
        prev_name, prev_bits = name, fmt.bits
    rounding = value.get("rounding", "nearest")
    if rounding not in AUTO_ROUNDINGS:
        raise PolicyError(
            source, "auto.rounding", "unknown rounding", got=rounding, allowed=list(AUTO_ROUNDINGS)
        )
    return AutoSpec(base=value["base"], ladder=tuple(ladder), rounding=rounding)


def _parse_fp8(source: str, value: Any) -> FP8Spec:
    _check_mapping(source, "fp8", value, FP8_KEYS)
    if value.get("recipe") == "te":
        raise PolicyError(source, "fp8.recipe", "Transformer Engine's FP8 is not a recipe of agoq's linears (under "
                          "Megatron-LM it is Megatron's own: --transformer-impl transformer_engine --fp8-format, "
                          "docs/megatron_lm.md)", got="te", allowed=list(POLICY_FP8_RECIPES),
                          fix="use current, delayed or rowwise (agoq's FP8 linears), or off")
    allowed = {"recipe": list(POLICY_FP8_RECIPES), "smooth_swiglu": list(SMOOTH_SWIGLU_MODES)}
    for key, choices in allowed.items():
        if key in value and value[key] not in choices:
            quoted = isinstance(value[key], bool)  # YAML 1.1 reads an unquoted off / no as false
            raise PolicyError(source, f"fp8.{key}", "unknown value", got=value[key], allowed=choices,
                              fix=f"YAML reads an unquoted off as false: write {key}: 'off'" if quoted else None)
    for key in ("bf16_first_layers", "bf16_last_layers", "amax_history_len"):
        if key in value:
            number = _plain_int(value[key])
            if number is None or number < (1 if key == "amax_history_len" else 0):
                raise PolicyError(source, f"fp8.{key}", "must be an integer >= "
                                  + ("1" if key == "amax_history_len" else "0"), got=value[key])
    return FP8Spec(**value)


def _check_auto_usage(source: str, auto: AutoSpec | None, default: dict, rules: tuple[Rule, ...]) -> None:
    users = (["default.activations"] if default["activations"] == AUTO else []) + [
        f"rules[{r.index}].set.activations" for r in rules if r.activations == AUTO
    ]
    if users and auto is None:
        raise PolicyError(
            source,
            users[0],
            "`auto` needs a top-level `auto:` section",
            got=AUTO,
            fix="add `auto: {base: nf4_b64, ladder: [int6_b64, int8_b128, bf16]}`",
        )
    if auto is not None and not users:
        raise PolicyError(
            source,
            "auto",
            "section is never used (no default/rule sets activations: auto)",
            fix="set `activations: auto` somewhere or delete the auto section",
        )


def _parse_rules(source: str, value: Any, table: _FormatTable) -> tuple[Rule, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise PolicyError(source, "rules", "must be a list of {when, set} mappings", got=value)
    return tuple(_parse_rule(source, i, item, table) for i, item in enumerate(value))


def _parse_rule(source: str, index: int, item: Any, table: _FormatTable) -> Rule:
    key = f"rules[{index}]"
    _check_mapping(source, key, item, RULE_KEYS)
    for part in RULE_KEYS:
        if part not in item:
            raise PolicyError(source, f"{key}.{part}", "missing (required)", allowed=list(RULE_KEYS))
    when = item["when"] if item["when"] is not None else {}
    _check_mapping(source, f"{key}.when", when, WHEN_KEYS)
    _check_mapping(source, f"{key}.set", item["set"], SET_KEYS)
    if "activations" not in item["set"]:
        raise PolicyError(source, f"{key}.set.activations", "missing (required)", allowed=list(SET_KEYS))
    match = Match(
        layers=_parse_layers(source, f"{key}.when.layers", when["layers"]) if "layers" in when else None,
        pp_stage=_parse_pp_stage(source, f"{key}.when.pp_stage", when["pp_stage"])
        if "pp_stage" in when
        else None,
        vp_stage=_parse_index(source, f"{key}.when.vp_stage", when["vp_stage"])
        if "vp_stage" in when
        else None,
        roles=_parse_roles(source, f"{key}.when.role", when["role"]) if "role" in when else None,
    )
    if match.layers is not None and match.roles is not None and match.roles & LAYERLESS_ROLES:
        bad = sorted(match.roles & LAYERLESS_ROLES)
        raise PolicyError(
            source,
            f"{key}.when.role",
            "these roles have no layer index, so `layers` never matches them",
            got=bad,
            allowed=sorted(set(ROLES) - LAYERLESS_ROLES),
            fix="move them to a rule without `layers`",
        )
    name = item["set"]["activations"]
    if name != AUTO:
        table.lookup(f"{key}.set.activations", name)
    return Rule(index=index, when=match, activations=name)


def _parse_index(source: str, key: str, value: Any) -> int:
    number = _plain_int(value)
    if number is None or number < 0:
        raise PolicyError(source, key, "must be an integer >= 0", got=value)
    return number


def _parse_pp_stage(source: str, key: str, value: Any) -> int | str:
    if value in PP_STAGE_WORDS:
        return value
    number = _plain_int(value)
    if number is None or number < 0:
        raise PolicyError(
            source, key, "bad pipeline stage", got=value, allowed="an integer >= 0, 'first' or 'last'"
        )
    return number


_LAYERS_ALLOWED = "an int, a closed range string 'a-b' (a <= b), or a list of those"


def _parse_layers(source: str, key: str, value: Any) -> frozenset[int]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise PolicyError(source, key, "empty list matches no layer", got=value, allowed=_LAYERS_ALLOWED)
    layers: set[int] = set()
    for item in items:
        number = _plain_int(item)
        if number is not None:
            lo = hi = number
        elif isinstance(item, str) and _RANGE_RE.match(item):
            lo, hi = (int(g) for g in _RANGE_RE.match(item).groups())
        else:
            raise PolicyError(source, key, "bad layer selector", got=item, allowed=_LAYERS_ALLOWED)
        if lo < 0 or lo > hi or hi > MAX_LAYER_IDX:
            raise PolicyError(
                source,
                key,
                f"bad layer range (global 0-based, at most {MAX_LAYER_IDX})",
                got=item,
                allowed=_LAYERS_ALLOWED,
            )
        layers.update(range(lo, hi + 1))
    return frozenset(layers)


def _parse_roles(source: str, key: str, value: Any) -> frozenset[str]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise PolicyError(source, key, "empty list matches no role", got=value, allowed=list(ROLES))
    for item in items:
        if not isinstance(item, str) or item not in ROLES:
            raise PolicyError(source, key, "unknown role", got=item, allowed=list(ROLES))
    return frozenset(items)


def _check_reachable(source: str, rules: tuple[Rule, ...]) -> None:
    for later in rules:
        for earlier in rules[: later.index]:
            if earlier.when.covers(later.when):
                raise PolicyError(
                    source,
                    f"rules[{later.index}].when",
                    f"rule can never match: "
                    f"rules[{earlier.index}] comes first and matches every site it matches",
                    got=_describe(later.when),
                    fix=f"delete rules[{later.index}] or move it above rules[{earlier.index}]",
                )


def _describe(match: Match) -> dict:
    out: dict[str, Any] = {}
    if match.layers is not None:
        out["layers"] = sorted(match.layers)
    for key, value in (("pp_stage", match.pp_stage), ("vp_stage", match.vp_stage)):
        if value is not None:
            out[key] = value
    if match.roles is not None:
        out["role"] = sorted(match.roles)
    return out
