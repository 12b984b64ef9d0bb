"""FP8 recipe (what to scale how) and the delayed-scaling state (amax history) of one FP8 linear.

Current scaling: every cast uses the amax of the tensor being cast (one extra reduction).
Delayed scaling (Transformer Engine's ``DelayedScaling``; the FP8 paper's code, arXiv 2409.12517):
each cast uses a scale computed from the *history* of previous amaxes, ``scale = FP8_MAX / max(history)
/ 2**margin``, and the current amax is appended afterwards. Values that grew since saturate (the cast
clamps). The first call of a slot has no history and uses its current amax (bootstrap) instead of
Transformer Engine's initial scale 1.

Slots of one linear: ``x`` (input, E4M3), ``w`` (weight, E4M3), ``g`` (output gradient, E5M2).
The state is an ``nn.Module`` (buffer ``meta_<slot>`` = [1 / scale, scale, 0, 0, amax history (L)]) so that
it moves with ``module.cuda()`` and is saved in the model's state dict when attached as a submodule.
Updates *replace* the meta tensor (never in place): a backward pass that saved the forward's scale
keeps seeing that scale even if another micro-batch's forward updated the state in between. On CUDA
one cast is one launch (agoq.kernels.fp8_fused: cast with the old scale, push the amax, next scale).
With agoq's FP8 weight cache (agoq.ops.fp8_weight_cache) the ``w`` slot records once per weight
version (optimizer step), not once per micro-batch.

Caveats: with activation recomputation the recomputed forward records its amaxes a second time (the
history's max is unchanged by a repeated value); amaxes are not reduced across ranks (each rank scales
its own tensors, which is exact; Transformer Engine's cross-rank amax reduction only aligns scales).

CUDA graphs (``graph_phase``, set by the owner: agoq.megatron.graphs for Megatron's per-layer graphs; None,
the default, is everything above). A graph replays kernels at the addresses of its capture and runs no Python,
so the meta swap above would freeze every replay at the capture's scale. ``"capture"``: each cast reads a copy
of the slot's meta (what the backward keeps), writes the next meta into a fresh tensor and copies it back into
the slot's meta in place: the slot's tensor stays the same, and each replay advances the history as an eager
call would. A gate (:meth:`gated`, the weight cache under capture) makes that update conditional on a device
flag: the weight's amax is recorded once per weight generation, as the eager cache does, and the casts in
between reuse the meta of the last recording. ``"warmup"`` (Megatron's eager passes on zero-filled inputs just
before a capture): casts with the current scale and records nothing. Host counters (``num_updates``) count
captures, not replays.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from agoq.ref.fp8 import (
    BACKWARD_VARIANT,
    FORWARD_VARIANT,
    GRANULARITIES,
    META_HEADER,
    fp8_amax,
    fp8_scale_from_amax,
    ref_fp8_history_update,
)

__all__ = ["FP8Recipe", "FP8ScalingState", "SCALINGS", "SLOT_VARIANTS", "current_scale"]

SCALINGS = ("current", "delayed")
SLOT_VARIANTS = {"x": FORWARD_VARIANT, "w": FORWARD_VARIANT, "g": BACKWARD_VARIANT}
# Transformer Engine's DelayedScaling keeps 1024 amaxes by default; the FP8 paper's code 1024 / DP per
# rank (arXiv 2409.12517). 16 reacts faster to shrinking tensors in short runs; configurable.
DEFAULT_AMAX_HISTORY_LEN = 16
# Delayed scaling writes each cast's next meta into a fresh row of a pool of this many rows (one
# allocation and two unbinds per 64 casts of a slot instead of an allocation and a view per cast; a
# pool is 64 x 20 floats = 5 KiB at the default history length). Rows are padded to a multiple of
# META_ROW_ALIGN floats so that every row (and its scale_inv, element 0) is 16-byte aligned.
META_POOL_ROWS = 64
META_ROW_ALIGN = 4


@dataclass(frozen=True, kw_only=True)
class FP8Recipe:
    """How an FP8 linear scales its operands (pure data; validated on construction)."""

    granularity: str = "tensor"
    """tensor: one scale per tensor; row: one per row along each GEMM's contraction dim (current only)."""

    scaling: str = "current"
    """current: amax of the tensor being cast; delayed: max of the amax history (tensor granularity)."""

    amax_history_len: int = DEFAULT_AMAX_HISTORY_LEN
    """Delayed scaling: number of past amaxes whose max sets the scale."""

    margin: int = 0
    """Scale divided by 2**margin (headroom for growth under delayed scaling)."""

    pow2_scales: bool = False
    """Round scales down to a power of two (the FP8 paper's code) so scaling is exact."""

    fast_accum_forward: bool = True
    """Fast (reduced-precision) FP8 accumulation in the forward GEMM only; dgrad / wgrad always
    accumulate in fp32 (Transformer Engine's and torchao's defaults)."""

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"FP8Recipe.granularity={self.granularity!r}: use one of {GRANULARITIES}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"FP8Recipe.scaling={self.scaling!r}: use one of {SCALINGS}")
        if self.granularity == "row" and self.scaling == "delayed":
            raise ValueError("FP8Recipe: row granularity supports scaling='current' only (per-token amaxes have "
                             "no history); use granularity='tensor' for delayed scaling")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"FP8Recipe.amax_history_len={self.amax_history_len!r}: use an int >= 1")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"FP8Recipe.margin={self.margin!r}: use an int >= 0")


def current_scale(tensor: torch.Tensor, slot: str, recipe: FP8Recipe, dim: int | None = None) -> torch.Tensor:
    """Scale of ``tensor`` from its own amax (over everything, or per ``dim`` kept as size 1)."""
    return fp8_scale_from_amax(fp8_amax(tensor, dim), SLOT_VARIANTS[slot], recipe.margin, recipe.pow2_scales)


class FP8ScalingState(torch.nn.Module):
    """Delayed-scaling state of one FP8 linear: per slot one fp32 ``meta`` vector
    ``[scale_inv, scale, 0, 0, amax_history (L, newest first)]`` (agoq.kernels.fp8_fused) and an int32
    [2] workspace for the fused cast (zero between calls, not part of the state dict)."""

    def __init__(self, recipe: FP8Recipe, device: torch.device | str | None = None) -> None:
        super().__init__()
        if recipe.scaling != "delayed":
            raise ValueError("FP8ScalingState holds delayed-scaling history; recipe.scaling is "
                             f"{recipe.scaling!r} (current scaling needs no state: pass scaling_state=None)")
        self.recipe = recipe
        self.length = recipe.amax_history_len
        self.num_updates = dict.fromkeys(SLOT_VARIANTS, 0)  # host-side: no GPU sync to test "has history"
        # per-slot names and variants, built once (the cast runs on every forward / backward)
        self._meta_keys = {slot: f"meta_{slot}" for slot in SLOT_VARIANTS}
        self._ws_keys = {slot: f"workspace_{slot}" for slot in SLOT_VARIANTS}
        self._variants = dict(SLOT_VARIANTS)
        self._pools: dict = {}  # slot -> [meta rows, their element 0, next unused index] (_fresh_meta)
        self._invs: dict = {}  # slot -> (current meta, its element 0) when made with it (cast_meta)
        self.graph_phase: str | None = None  # None (eager), "warmup" or "capture" (module docstring)
        self._gates: dict = {}  # slot -> 0-dim bool device tensor: record this cast (capture, gated)
        self._gate_last: dict = {}  # slot -> the meta the last recorded cast of a gated slot used (capture)
        for slot in SLOT_VARIANTS:
            meta = torch.zeros(META_HEADER + self.length, dtype=torch.float32, device=device)
            meta[:2] = 1.0  # scale and its inverse before the first record
            self.register_buffer(f"meta_{slot}", meta)
            self.register_buffer(f"workspace_{slot}", torch.zeros(2, dtype=torch.int32, device=device),
                                 persistent=False)

    def meta(self, slot: str) -> torch.Tensor:
        """[scale_inv, scale, 0, 0, amax_history] of the slot (replaced, never written, by each update)."""
        return self._buffers[f"meta_{slot}"]

    def amax_history(self, slot: str) -> torch.Tensor:
        return self.meta(slot)[META_HEADER:]

    def scale(self, slot: str) -> torch.Tensor:
        return self.meta(slot)[1]

    def scale_inv(self, slot: str) -> torch.Tensor:
        """1 / scale(slot), computed with the scale (what torch._scaled_mm takes; 16-byte aligned)."""
        return self.meta(slot)[0]

    def check_device(self, tensor: torch.Tensor) -> None:
        meta = self._buffers["meta_x"]
        index = meta.get_device()  # ints first: no torch.device objects on the CUDA hot path
        other = tensor.get_device()
        if index != other or meta.is_cuda != tensor.is_cuda or (index < 0 and meta.device != tensor.device):
            raise ValueError(f"FP8ScalingState is on {meta.device} but the tensor is on {tensor.device}; "
                             "move the state with the module (.to(device) / .cuda())")

    def delayed_scale(self, slot: str) -> torch.Tensor | None:
        """The scale to cast this slot with now (from previous amaxes), or None before the first
        record (the caller bootstraps from the tensor's own amax)."""
        if slot not in SLOT_VARIANTS:
            raise ValueError(f"FP8 scaling slot {slot!r}: use one of {tuple(SLOT_VARIANTS)}")
        return self.scale(slot) if self.num_updates[slot] else None

    def scale_and_record(self, slot: str, tensor: torch.Tensor) -> torch.Tensor:
        """The scale to cast ``tensor`` with now (from previous amaxes), then record its amax."""
        self.check_device(tensor)
        scale = self.delayed_scale(slot)
        amax = fp8_amax(tensor)
        if scale is None:
            scale = fp8_scale_from_amax(amax, SLOT_VARIANTS[slot], self.recipe.margin, self.recipe.pow2_scales)
        self.record_amax(slot, amax)
        return scale

    def record_amax(self, slot: str, amax_f32: torch.Tensor) -> None:
        """Push an amax into the slot's history (newest first) and recompute its scale (no GPU sync;
        a new meta tensor, so scales saved by a pending backward stay valid)."""
        meta = self.meta(slot)
        history, scale, scale_inv = ref_fp8_history_update(meta[META_HEADER:], amax_f32.to(meta.device),
                                                           SLOT_VARIANTS[slot], self.recipe.margin,
                                                           self.recipe.pow2_scales)
        zero = torch.zeros(2, dtype=torch.float32, device=meta.device)
        self._set(slot, torch.cat([scale_inv.reshape(1), scale.reshape(1), zero, history]))

    def cast(self, slot: str, t2d: torch.Tensor, cast_ops, *, rowmajor: bool, transposed: bool):
        """Cast a 2-D tensor for ``slot`` with the delayed scale and record its amax, in one fused
        launch on CUDA (``cast_ops``: agoq.ops.fp8_linear.fp8_cast_ops). The first call of a slot
        bootstraps: current scaling, and the history starts with this amax.

        Returns (out, out_t, scale, scale_inv); the scales are views of a meta the state no longer
        writes (safe to keep for backward)."""
        out, out_t, meta, scale_inv = self.cast_meta(slot, t2d, cast_ops, rowmajor, transposed)
        return out, out_t, meta[1], scale_inv

    def cast_meta(self, slot: str, x: torch.Tensor, cast_ops, rowmajor: bool, transposed: bool,
                  t_colmajor: bool = False):
        """:meth:`cast` for the FP8 linear's hot path: x contiguous [..., C] (read as 2-D), no checks
        beyond the state's own (the caller checked x); returns (out, out_t, meta, scale_inv) with
        ``meta`` the [scale_inv, scale, ...] vector the cast used (never written again) and
        ``scale_inv`` its element 0 as a 0-dim tensor (what torch._scaled_mm takes). ``t_colmajor``:
        out_t as the [R, C] column-major tensor (agoq.kernels.fp8_fused._launch_cast).

        The next meta is a row of a pool allocated :data:`META_POOL_ROWS` at a time, with its element-0
        view made in the same pass (two ``unbind`` calls), so a delayed cast allocates nothing and
        makes no view for its scales. Rows are never reused (each is written once, by the cast that
        makes it), so saved scales stay valid; a pool is freed when its last row is. Under CUDA graphs
        (``graph_phase``) :meth:`_cast_meta_graphs` instead."""
        if self.graph_phase is not None:
            return self._cast_meta_graphs(slot, x, cast_ops, rowmajor, transposed, t_colmajor)
        recipe = self.recipe
        if self.num_updates[slot]:
            key = self._meta_keys[slot]
            meta = self._buffers[key]
            current = self._invs.get(slot)
            inv = current[1] if current is not None and current[0] is meta else meta[0]
            fresh, fresh_inv = self._fresh_meta(slot, meta)
            out, out_t, new = cast_ops.cast_delayed(x, self._variants[slot], meta, self._buffers[self._ws_keys[slot]],
                                                    recipe.margin, recipe.pow2_scales, rowmajor, transposed,
                                                    t_colmajor, fresh)
            self._buffers[key] = new
            self._invs[slot] = (new, fresh_inv if new is fresh else new[0])
            self.num_updates[slot] += 1
            return out, out_t, meta, inv
        out, out_t, current = cast_ops.cast_current(x, self._variants[slot], recipe.margin, recipe.pow2_scales,
                                                    rowmajor, transposed, t_colmajor)
        new = torch.zeros(META_HEADER + self.length, dtype=torch.float32, device=x.device)
        new[: META_HEADER + 1] = current  # history [amax, 0, ...]: its max is amax, the scale the current one
        self._set(slot, new)
        return out, out_t, current, current[0]

    def _cast_meta_graphs(self, slot: str, x: torch.Tensor, cast_ops, rowmajor: bool, transposed: bool,
                          t_colmajor: bool):
        """:meth:`cast_meta` in Megatron's graph creation (module docstring, "CUDA graphs"): same values as the
        eager call, the slot's meta tensor kept and updated in place under capture, nothing recorded in warm-up."""
        recipe, key = self.recipe, self._meta_keys[slot]
        meta, ws = self._buffers[key], self._buffers[self._ws_keys[slot]]
        args = (self._variants[slot], recipe.margin, recipe.pow2_scales)
        if not self.num_updates[slot]:
            if self.graph_phase == "capture":  # a replay would bootstrap again every time
                raise RuntimeError(
                    f"FP8 delayed scaling: slot {slot!r} has no amax history when its CUDA graph is captured; run an "
                    "eager pass first (Megatron's local CUDA graphs record the first iteration eagerly) or use "
                    "current scaling")
            out, out_t, current = cast_ops.cast_current(x, *args, rowmajor, transposed, t_colmajor)  # warm-up
            return out, out_t, current, current[0]
        if self.graph_phase == "warmup":  # cast with the current scale, record nothing, keep the meta tensor
            out, out_t, _ = cast_ops.cast_delayed(x, args[0], meta, ws, args[1], args[2], rowmajor, transposed,
                                                  t_colmajor, torch.empty_like(meta))
            return out, out_t, meta, meta[0]
        if self.graph_phase != "capture":
            raise ValueError(f"FP8ScalingState.graph_phase={self.graph_phase!r}: use None, 'warmup' or 'capture'")
        gate = self._gates.get(slot)
        if gate is None:
            used = meta.clone()  # the backward keeps this cast's scales; the slot's meta moves on in place
        else:
            last = self._gate_last.get(slot)
            if last is None:
                raise RuntimeError(f"FP8 delayed scaling: gated slot {slot!r} captured without prepare_gate (the "
                                   "weight cache calls it in the warm-up pass: cuda_graph_warmup_steps >= 1)")
            used = torch.where(gate, meta, last)
            last.copy_(used)
        out, out_t, new = cast_ops.cast_delayed(x, args[0], used, ws, args[1], args[2], rowmajor, transposed,
                                                t_colmajor, torch.empty_like(meta))
        meta.copy_(new if gate is None else torch.where(gate, new, meta))
        self.num_updates[slot] += 1
        return out, out_t, used, used[0]

    def prepare_gate(self, slot: str) -> None:
        """Before a capture (the warm-up): the tensor a gated slot keeps its last recorded meta in, made outside the
        graph so that every replay reads and writes the same one (idempotent)."""
        if slot not in self._gate_last:
            self._gate_last[slot] = self._buffers[self._meta_keys[slot]].clone()

    @contextlib.contextmanager
    def gated(self, slot: str, record: torch.Tensor):
        """Captured casts of ``slot`` inside this block record their amax only where the 0-dim bool device tensor
        ``record`` is true at replay; otherwise they cast with the meta of the slot's last recorded cast (the
        weight cache under capture: one recording per weight generation)."""
        self._gates[slot] = record
        try:
            yield
        finally:
            del self._gates[slot]

    def _fresh_meta(self, slot: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(an unused meta row on ``like``'s device, its element 0); a new pool when one runs out.
        A pool is [rows, element-0 views, next index] (plain tuples: the state stays deep-copyable)."""
        pool = self._pools.get(slot)
        if pool is None or pool[2] == len(pool[0]):
            width = META_HEADER + self.length
            padded = -(-width // META_ROW_ALIGN) * META_ROW_ALIGN  # every row starts 16-byte aligned (cuBLAS)
            block = torch.empty((META_POOL_ROWS, padded), dtype=torch.float32, device=like.device)
            pool = self._pools[slot] = [block[:, :width].unbind(0), block[:, 0].unbind(0), 0]
        i = pool[2]
        pool[2] = i + 1
        return pool[0][i], pool[1][i]

    def _apply(self, *args, **kwargs):  # .to() / .cuda() / .float(): pools of the old device are dropped
        self._pools, self._invs, self._gate_last = {}, {}, {}
        return super()._apply(*args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._pools, self._invs = {}, {}
        return super()._load_from_state_dict(*args, **kwargs)

    def _set(self, slot: str, meta: torch.Tensor) -> None:
        self._buffers[self._meta_keys[slot]] = meta
        self._invs.pop(slot, None)
        self.num_updates[slot] += 1

    def get_extra_state(self) -> dict:
        return {"num_updates": dict(self.num_updates)}

    def set_extra_state(self, state: dict) -> None:
        self.num_updates = dict(state["num_updates"])

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}, num_updates={self.num_updates}"
