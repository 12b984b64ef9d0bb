"""``python -m agoq.plan --transformer-impl transformer_engine``: the TE path's plan (agoq.plan.te's model), one GPU.

With agoq on (the door ``--module agoq.megatron_lm``): the richest candidate policy (--policies, else the shipped
ones) whose predicted peak fits, as the local plan chooses; a shipped candidate the scopes cannot store on TE's
modules (quantized attention internals, a fused norm's input and output in two formats) is skipped with its reason
printed, a --policies file that cannot is an error. With ``--agoq-disable``: Megatron + TE alone, one prediction.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from agoq.config import flag_for
from agoq.plan import te
from agoq.plan.memory import GIB, Layout, ModelShape
from agoq.plan.peak import format_peak_report, format_peaks
from agoq.policy import load_policy

AGOQ_ONLY = ("agoq_optimizer", "agoq_moments", "agoq_master", "agoq_grads", "agoq_gradient_release", "agoq_fp8",
             "agoq_smooth_swiglu", "policies")


def describe(settings: te.TESettings) -> str:
    side = "agoq on Megatron + TE (saved-activation scopes on TE's modules)" if settings.agoq else \
        f"Megatron + TE alone ({flag_for('enabled')})"
    fp8 = f"FP8 delayed (hybrid), amax history {settings.amax_history_len}" if settings.fp8 else "bf16 GEMMs"
    opt = (f"precision-aware optimizer (master remainder, moments {settings.exp_avg} / {settings.exp_avg_sq})"
           if settings.precision_aware else "")
    extras = [x for x in (opt, "gradient-accumulation fusion" if settings.grad_accumulation_fusion else "",
                          "attention mask in the dataloader" if settings.attention_mask else "") if x]
    return f"transformer_engine: {side}; {fp8}" + (f"; {', '.join(extras)}" if extras else "")


def run_te(request, values: dict, shape: ModelShape, layout: Layout, recipe_for: Callable, paths: list[Path],
           budget_of: Callable) -> int:
    """The TE plan; ``recipe_for(policy)``: the run's Recipe under a candidate (None: the flags' own); ``paths``:
    the candidate policy files, richest first; ``budget_of()``: the budget in bytes (printed)."""
    settings = te.settings_of(values, layout)
    if not settings.agoq:
        given = [k for k in AGOQ_ONLY if values.get(k) not in (None, False) or (k == "policies" and request.policies)]
        if given:
            names = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ValueError(f"{names} with {flag_for('enabled')}: Megatron + TE alone stores no policy and runs "
                             f"Megatron's optimizer; drop them, or drop {flag_for('enabled')}")
    budget = budget_of()
    print(describe(settings))
    print("what the TE path changes against agoq's local spec (agoq.plan.te):")
    for term in te.TE_TERMS:
        print(f"  - {term}")
    if not settings.agoq:
        peak = te.predict_te_peak(shape, layout, None, recipe_for(None), settings)
        print(format_peaks([peak]))
        print(format_peak_report([("megatron+te", [peak])], budget))
        return 0 if peak.peak <= budget else 3
    report, chosen = [], None
    for path in paths:
        policy = load_policy(path)
        try:
            peak = te.predict_te_peak(shape, layout, policy, recipe_for(policy), settings)
        except ValueError as err:
            if request.policies:
                raise
            print(f"{path.stem}: skipped on TE ({err})")
            continue
        report.append((path.stem, [peak]))
        if peak.peak <= budget:
            chosen = path
            break
    if report:
        print(format_peaks(report[-1][1]))
    print(format_peak_report(report, budget))
    if chosen is None:
        print(f"no candidate policy fits {budget / GIB:.2f} GiB on TE: lower --micro-batch-size, add "
              "--recompute-granularity full or --fp8-format hybrid --fp8-recipe delayed")
        return 3
    print(f"chosen: {chosen.stem}")
    if request.out:
        shutil.copyfile(chosen, request.out)
        print(f"wrote {request.out}")
    return 0
