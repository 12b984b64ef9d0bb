"""Resolve a policy at a site, and build the per-layer, per-role table (pure, no torch, no I/O).

``resolve(spec, site, schedule)`` is first-match-wins over ``spec.rules`` then ``spec.default``;
``auto`` becomes the stage-aware ladder format of the site's pipeline rank (stages.py).
The table is logged on rank 0 (``format_table``) and saved with checkpoints (``to_json``).
"""

from __future__ import annotations

import dataclasses
import json

from agoq.formats import QuantFormat
from agoq.policy.schema import AUTO, LAYERLESS_ROLES, ROLES, PolicySpec, Site
from agoq.policy.stages import ScheduleInfo, inflight_per_rank, pick_rung, target_bits

LAYER_ROLES: tuple[str, ...] = tuple(r for r in ROLES if r not in LAYERLESS_ROLES)


def resolve(spec: PolicySpec, site: Site, schedule: ScheduleInfo | None = None) -> QuantFormat:
    """The activation format for ``site``. ``schedule`` is needed only when the policy uses auto."""
    return spec.format(resolve_name(spec, site, schedule)[0])


def resolve_name(spec: PolicySpec, site: Site, schedule: ScheduleInfo | None = None) -> tuple[str, str]:
    """``(format name, source)``; source is ``rules[i]`` or ``default``, plus `` auto`` for the ladder."""
    _check_site(site, schedule)
    name, source = dict(spec.default)["activations"], "default"
    for rule in spec.rules:
        if rule.when.matches(site):
            name, source = rule.activations, f"rules[{rule.index}]"
            break
    if name != AUTO:
        return name, source
    if schedule is None:
        raise ValueError(
            f"{spec.source}: {source} sets activations: auto, which needs the pipeline schedule; "
            "pass schedule=ScheduleInfo(pp_size, vp_size, num_microbatches)"
        )
    return auto_names(spec, schedule)[site.pp_rank], f"{source} auto"


def auto_names(spec: PolicySpec, schedule: ScheduleInfo) -> tuple[str, ...]:
    """The auto format name of every pipeline rank, rank 0 first (see docs/policy.md "The auto rule")."""
    if spec.auto is None:
        raise ValueError(f"{spec.source}: the policy has no `auto:` section")
    base = spec.format(spec.auto.base)
    rungs = [(spec.auto.base, float(base.bits))] + [(n, float(spec.format(n).bits)) for n in spec.auto.ladder]
    inflight = inflight_per_rank(schedule)
    busiest = max(inflight)
    return tuple(pick_rung(rungs, target_bits(base.bits, m, busiest), spec.auto.rounding) for m in inflight)


def _check_site(site: Site, schedule: ScheduleInfo | None) -> None:
    if schedule is not None and (site.pp_size, site.vp_size) != (schedule.pp_size, schedule.vp_size):
        raise ValueError(
            f"site has pp_size={site.pp_size}, vp_size={site.vp_size} but the schedule has "
            f"pp_size={schedule.pp_size}, vp_size={schedule.vp_size}; build both from the same parallel state"
        )


# ------------------------------------------------------------------------------------ sites ----
def model_sites(num_layers: int, schedule: ScheduleInfo, roles: tuple[str, ...] = LAYER_ROLES) -> list[Site]:
    """Every site of a uniformly split model: layer roles per layer, plus the layerless roles.

    Layer placement follows megatron-core 0.19.2 ``get_transformer_layer_offset`` (uniform case):
    chunk v of rank r starts at ``v * L / V + r * L / (P * V)``. Uneven splits are not modelled.
    """
    pp, vp = schedule.pp_size, schedule.vp_size
    chunks = 1 if vp is None else vp
    if num_layers < 1 or num_layers % (pp * chunks):
        raise NotImplementedError(
            f"model_sites supports num_layers divisible by pp_size * vp_size ({pp} * {chunks}); got "
            f"{num_layers}: build the sites from the model (agoq.megatron.sites) for uneven splits"
        )
    per_chunk = num_layers // (pp * chunks)
    sites = [Site(None, 0, pp, None if vp is None else 0, vp, "embedding.output")]
    for rank in range(pp):
        for chunk in range(chunks):
            start = chunk * (num_layers // chunks) + rank * per_chunk
            for layer in range(start, start + per_chunk):
                sites += [Site(layer, rank, pp, None if vp is None else chunk, vp, r) for r in roles]
    last_chunk = None if vp is None else vp - 1
    sites += [Site(None, pp - 1, pp, last_chunk, vp, r) for r in ("head.input", "loss.logits")]
    return sites


def unmatched_rules(spec: PolicySpec, sites: list[Site]) -> list[int]:
    """Indices of rules that win at none of ``sites`` (pass all model sites to find dead rules)."""
    won = set()
    for site in sites:
        for rule in spec.rules:
            if rule.when.matches(site):
                won.add(rule.index)
                break
    return [r.index for r in spec.rules if r.index not in won]


def check_rules_used(spec: PolicySpec, sites: list[Site]) -> None:
    """Raise if a rule decides no site of this model and layout (a typo'd layer, a stage or chunk
    beyond the pipeline, a rule shadowed by earlier ones together). Pass *all* model sites
    (``model_sites``), not one rank's, or rules meant for other ranks look dead."""
    _check_rule_layers_exist(spec, sites)
    dead = unmatched_rules(spec, sites)
    if dead:
        layers = sorted({s.layer_idx for s in sites if s.layer_idx is not None})
        pp_size, vp_size = sites[0].pp_size, sites[0].vp_size
        raise ValueError(
            f"{spec.source}: {', '.join(f'rules[{i}]' for i in dead)} decide no site of this model "
            f"(layers {layers[0] if layers else '-'}..{layers[-1] if layers else '-'}, pp_size={pp_size}, "
            f"vp_size={vp_size}): their layers/pp_stage/vp_stage do not exist here or earlier rules "
            "cover them; fix or delete them, or use a policy written for this layout"
        )


def _check_rule_layers_exist(spec: PolicySpec, sites: list[Site]) -> None:
    """Raise if a rule's ``layers`` name layers this model does not have, also when others in it exist: ``"0-9"`` on
    a 4-layer model would silently act on layers 0..3 only (almost always a policy for another depth, or a 1-based
    index)."""
    model = {s.layer_idx for s in sites if s.layer_idx is not None}
    if not model:
        return
    for rule in spec.rules:
        missing = sorted(rule.when.layers - model) if rule.when.layers is not None else []
        if missing and len(missing) < len(rule.when.layers):  # a rule with no existing layer is a dead rule
            raise ValueError(
                f"{spec.source}: rules[{rule.index}].when.layers names layers this model does not have "
                f"({_ranges(missing)}); the model's layers are {min(model)}..{max(model)} (global, 0-based): "
                "narrow the range, or use a policy written for this depth")


def _ranges(values: list[int]) -> str:
    """Sorted ints as closed ranges: [4, 5, 6, 9] -> '4-6, 9'."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ------------------------------------------------------------------------------------ table ----
@dataclasses.dataclass(frozen=True)
class TableRow:
    """One resolved site: where, which format, why (source) and the rank's in-flight count."""

    layer_idx: int | None
    pp_rank: int
    vp_stage: int | None
    role: str
    format: str
    bits_per_element: float
    source: str
    inflight: int | None


def policy_table(spec: PolicySpec, sites: list[Site], schedule: ScheduleInfo | None = None) -> list[TableRow]:
    """Resolve every site; ``schedule`` (when given) also fills in each rank's in-flight count."""
    inflight = inflight_per_rank(schedule) if schedule is not None else None
    rows = []
    for site in sites:
        name, source = resolve_name(spec, site, schedule)
        rows.append(
            TableRow(
                layer_idx=site.layer_idx,
                pp_rank=site.pp_rank,
                vp_stage=site.vp_stage,
                role=site.role,
                format=spec.format(name).name,
                bits_per_element=8 * spec.format(name).bytes_per_element(),
                source=source,
                inflight=None if inflight is None else inflight[site.pp_rank],
            )
        )
    return rows


def to_json(rows: list[TableRow], spec: PolicySpec, schedule: ScheduleInfo | None = None) -> str:
    """A stable JSON document (sorted keys) of the table, for saving next to a checkpoint."""
    doc = {
        "policy_source": spec.source,
        "schedule": None if schedule is None else dataclasses.asdict(schedule),
        "rows": [dataclasses.asdict(row) for row in rows],
    }
    return json.dumps(doc, indent=1, sort_keys=True)


def format_table(rows: list[TableRow]) -> str:
    """Fixed-width text: one line per run of consecutive layers with identical formats.

    Columns: layers, pp rank, vp stage, in-flight count, then one column per role present.
    """
    roles = [r for r in ROLES if any(row.role == r for row in rows)]
    groups: list[list] = []  # [first_layer, last_layer, pp, vp, inflight, {role: format}]
    for row in rows:
        key = (row.pp_rank, row.vp_stage, row.inflight)
        prev = groups[-1] if groups else None
        if prev and prev[2:5] == list(key) and _same_layer_or_next(prev, row):
            if row.layer_idx is not None:
                prev[1] = row.layer_idx
            prev[5][row.role] = row.format
        else:
            groups.append([row.layer_idx, row.layer_idx, *key, {row.role: row.format}])
    groups = _merge_identical_runs(groups)
    header = ["layers", "pp", "vp", "inflight", *roles]
    lines = [
        [_layers_text(g[0], g[1]), str(g[2]), _dash(g[3]), _dash(g[4]), *(g[5].get(r, "-") for r in roles)]
        for g in groups
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *lines, strict=True)]
    out = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, *lines]
    ]
    return "\n".join(out)


def _same_layer_or_next(group: list, row: TableRow) -> bool:
    """Rows of one layer are grouped together; a layerless row only joins a layerless group."""
    if row.layer_idx is None or group[1] is None:
        return row.layer_idx is None and group[1] is None
    return row.layer_idx == group[1]


def _merge_identical_runs(groups: list[list]) -> list[list]:
    merged: list[list] = []
    for g in groups:
        prev = merged[-1] if merged else None
        if prev and g[0] is not None and prev[1] is not None and g[0] == prev[1] + 1 and prev[2:] == g[2:]:
            prev[1] = g[1]
        else:
            merged.append(list(g))
    return merged


def _layers_text(first: int | None, last: int | None) -> str:
    if first is None:
        return "-"
    return str(first) if first == last else f"{first}-{last}"


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)
