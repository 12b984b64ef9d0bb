"""The planner's model of agoq's code as it was before the changes the planner models, for the GPU measurements taken
before them (benchmarks/validate_planner.py predicts every measured run on the code of its date). agoq.plan models
the current code only; this module adds what earlier code kept, term by term, on top of its prediction.

``PastCode`` names the changes a run predates:
- ``v_view`` (before 2026-11-25): agoq's SDPA saved v as a view of the fused QKV output, which kept the whole
  [T, (n + 2g) d] buffer alive instead of a compact [T, g d] copy (``v_view_extra``: the difference per layer and
  micro-batch, inside agoq.plan.memory.plan_stages).
- ``full_isfinite_check`` (before 2026-11-25 07:22 UTC): the non-finite gradient check ran over the whole float
  buffer at once, not in slices: 7 B/param for fp32 grads, 6.45 GiB for the 1B model, read off the H100 with
  benchmarks/mem_trace.py.
- ``pack_hook_held_inputs`` (before 2026-11-25 07:34 UTC): the pack hook kept a reference to each linear input agoq
  replaced (a quantized copy or a recompute handle), and torch keeps a pack hook alive with its SavedVariable until
  backward, so those bf16 tensors stayed allocated per layer and in-flight micro-batch: 2 x (2h + 2h + 2F) B per
  token, 12 B x h at ffn = 4h and 9.5 B x h at ffn = 2.75h, what an earlier version of the planner had fitted as an
  unexplained constant (11.5 and ~9.6). Found with benchmarks/mem_trace.py (docs/benchmarks/planner.md).
  attn.proj_input is a view of SDPA's output, which SDPA keeps anyway: no extra bytes.
- ``float_grad_buffer_at_construction`` (before commit 1bd195f): the 8-bit store mode allocated Megatron's float
  gradient buffer at DDP construction and freed it right after, which made construction the run's peak where
  activations are small: DP=2 x PP=2, 3B shape, agoq full, 10.594 GiB = 2.649 (parameters) + 2.649 (parameter
  buffer) + 5.297 (fp32 gradient buffer) on both stages, read off 4 H100s with benchmarks/mem_trace.py
  (docs/benchmarks/grads.md).
- ``state_init``: agoq's optimizer creates a parameter's states inside its first step_param, with that parameter's
  gradient alive. Since 98c84d5 it writes them at their final size ("zeros", no temporaries). Before, it quantized
  fp32 zeros and split p.float() through agoq.ref (ref_quantize, ref_master_split), whose temporaries peaked at
  ``STATE_INIT_BYTES_PER_ELEMENT`` bytes per element of the parameter above the states it keeps (bf16 parameter,
  cint8_b32 / cuint8_b32 moments, split24; CPU allocator events, agoq.testing.memory.cpu_allocation_peak, torch
  2.11; tests/unit/test_plan_state_init.py measures "split_fp64" on the reference as it still is): "split_fp64"
  since fb51259 (the remainder rounds in float64), "split" before (the reference of
  ``git show fb51259^:agoq/ref/master.py``). With gradient release the first step's hook of the largest parameter
  creates its states while the optimizer's states do not exist yet (each is created in its parameter's hook).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from agoq.plan.memory import Layout, layer_storage_of, plan_stages
from agoq.plan.peak import (
    ISFINITE_BOOL_TEMPORARIES,
    Recipe,
    StagePeak,
    grad_buffer_numel,
    param_tensors,
    predict_peaks,
    stage_dims,
)
from agoq.plan.shape import ModelShape
from agoq.plan.storage import (
    BF16_BYTES,
    FP32_BYTES,
    MEGATRON,
    NOT_APPLIED,
    QUANTIZED,
    RECOMPUTED,
    LayerDims,
    LayerStorage,
    megatron_bytes,
)
from agoq.policy import PolicySpec

STATE_INIT_BYTES_PER_ELEMENT = {"zeros": 0, "split_fp64": 70, "split": 46}
PACK_HOOK_HELD_ROLES = ("attn.qkv_input", "mlp.fc1_input", "mlp.fc2_input")


@dataclass(frozen=True)
class PastCode:
    """The planner-modelled changes a measured run predates (module docstring); the defaults are today's code."""

    v_view: bool = False
    full_isfinite_check: bool = False
    pack_hook_held_inputs: bool = False
    float_grad_buffer_at_construction: bool = False
    state_init: str = "zeros"

    def __post_init__(self) -> None:
        if self.state_init not in STATE_INIT_BYTES_PER_ELEMENT:
            raise ValueError(f"PastCode.state_init {self.state_init!r}: one of {sorted(STATE_INIT_BYTES_PER_ELEMENT)}")


def v_view_extra(selective_recompute: bool):
    """Bytes per layer and micro-batch the v view kept beyond today's compact v (for plan_stages)."""

    def extra(storage: LayerStorage, dims: LayerDims) -> int:
        role = storage.roles.get("attn.v")
        if selective_recompute or role is None or role.how not in (MEGATRON, NOT_APPLIED):
            return 0
        n, g = dims.heads // dims.tp, dims.groups // dims.tp
        view = BF16_BYTES * dims.tokens * (n + 2 * g) * dims.head_dim
        return view - megatron_bytes(storage, dims)["attn.v"]

    return extra


def pack_hook_held_bytes(storage: LayerStorage, dims: LayerDims) -> int:
    """Bytes per layer and micro-batch the old pack hook kept alive."""
    return sum(BF16_BYTES * dims.numel(role) for role in PACK_HOOK_HELD_ROLES
               if storage.roles[role].how in (QUANTIZED, RECOMPUTED))


def state_init_bytes(largest_numel: int, past: PastCode) -> int:
    """Temporaries of agoq's optimizer creating the largest parameter's states (first step)."""
    return STATE_INIT_BYTES_PER_ELEMENT[past.state_init] * largest_numel


def predict_past_peaks(shape: ModelShape, layout: Layout, policy: PolicySpec, recipe: Recipe,
                       past: PastCode) -> list[StagePeak]:
    """agoq.plan.peak.predict_peaks for the code ``past`` describes: today's prediction with each older term added
    where today's code differs."""
    extra = v_view_extra(recipe.selective_recompute) if past.v_view else None
    peaks = predict_peaks(shape, layout, policy, recipe, extra_layer_bytes=extra)
    stages = plan_stages(shape, layout, policy)  # in-flight micro-batches and layers of each stage
    dims = stage_dims(shape, layout)
    out = []
    for p, st in zip(peaks, stages, strict=True):
        tensors = param_tensors(shape, layout, p.pp_rank)
        buffer = grad_buffer_numel(tensors, layout)
        largest = max(tensors)
        changes = {}
        if past.pack_hook_held_inputs:
            copies = 1 if recipe.recompute else st.inflight * len(st.layers)
            storage = layer_storage_of(shape, layout, policy, p.pp_rank)
            changes["held"] = p.held + pack_hook_held_bytes(storage, dims) * copies
        step_extra, step_source = p.step_extra, p.step_source
        if past.full_isfinite_check and recipe.grads is None and not recipe.gradient_release:
            step_extra = max(step_extra, buffer * (layout.grad_bytes + ISFINITE_BOOL_TEMPORARIES))
        init = state_init_bytes(largest, past)
        if init and recipe.optimizer != "torch":  # the step creates the states: after the 8-bit store's read
            read = FP32_BYTES * largest if recipe.grads is not None else 0
            if not recipe.gradient_release:  # (release has no step phase)
                step_extra = max(step_extra, read + init)
            if init > read:
                step_source = "first step's state init"
        if init and recipe.gradient_release:  # the first hook creates the largest parameter's states
            first = BF16_BYTES * largest + init - p.optimizer - p.head_held
            changes["transient"], changes["transient_source"] = max(
                (p.transient, p.transient_source), (first, "first release step: state init"))
        changes["step_extra"], changes["step_source"] = step_extra, step_source
        if past.float_grad_buffer_at_construction and recipe.grads is not None and not recipe.gradient_release:
            changes["construction"] = p.construction + layout.grad_bytes * buffer
        out.append(dataclasses.replace(p, **changes))
    return out
