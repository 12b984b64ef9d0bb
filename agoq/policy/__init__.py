"""agoq.policy: which low-bit format each saved activation uses (pure data; imports no torch).

Load a YAML policy, then resolve it per site::

    spec = load_policy("configs/policy/agoq.yaml")
    schedule = ScheduleInfo(pp_size=4, vp_size=None, num_microbatches=8)
    fmt = resolve(spec, Site(layer_idx=0, pp_rank=0, pp_size=4, vp_stage=None, vp_size=None,
                             role="mlp.swiglu_input"), schedule)
    print(format_table(policy_table(spec, model_sites(32, schedule), schedule)))

Schema reference: docs/policy.md.
"""

from agoq.policy.load import PolicyError, load_policy, policy_from_dict
from agoq.policy.resolve import (
    LAYER_ROLES,
    TableRow,
    auto_names,
    check_rules_used,
    format_table,
    model_sites,
    policy_table,
    resolve,
    resolve_name,
    to_json,
    unmatched_rules,
)
from agoq.policy.schema import (
    AUTO,
    FP8_RECIPES,
    LAYERLESS_ROLES,
    ROLES,
    SMOOTH_SWIGLU_MODES,
    AutoSpec,
    FP8Spec,
    Match,
    PolicySpec,
    Rule,
    Site,
)
from agoq.policy.stages import ScheduleInfo, inflight_microbatches, inflight_per_rank

__all__ = [
    "AUTO",
    "LAYERLESS_ROLES",
    "LAYER_ROLES",
    "ROLES",
    "AutoSpec",
    "FP8Spec",
    "FP8_RECIPES",
    "SMOOTH_SWIGLU_MODES",
    "Match",
    "PolicyError",
    "PolicySpec",
    "Rule",
    "ScheduleInfo",
    "Site",
    "TableRow",
    "auto_names",
    "check_rules_used",
    "format_table",
    "inflight_microbatches",
    "inflight_per_rank",
    "load_policy",
    "model_sites",
    "policy_from_dict",
    "policy_table",
    "resolve",
    "resolve_name",
    "to_json",
    "unmatched_rules",
]
