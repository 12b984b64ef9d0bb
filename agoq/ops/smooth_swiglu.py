"""Smooth-SwiGLU as an autograd Function, with the TP handling of the per-token scale.

Math and conventions: :mod:`agoq.ref.swiglu` (fc1_out = [gate | up], z = swiglu(fc1_out) / s).
What this module adds:

* :class:`SmoothSwiGLUFunction` ``(fc1_out, s) -> z``: saves ``fc1_out`` and **the scale used in
  forward**; backward uses that same s (never recomputed from a possibly re-materialised or
  dequantized fc1_out: the forward's scale is the one its gradient needs). s is a constant for autograd (the
  authors' 7B script detaches it, ``DETACH_SCALED_SWIGLU=true``; the composition does not depend on s, so its exact
  gradient is zero anyway).
* :func:`smooth_scale` with a ``tp_group``: the per-token max is taken over the *local* FFN shard, so
  with TP > 1 it is all-reduced (MAX) across the TP ranks before use; then every rank's z uses the
  same s and multiplying fc2's output by s *after* the row-parallel all-reduce is exact. (The
  alternative, also exact: keep the local s and multiply each rank's partial fc2 output by it
  *before* the reduction.) The per-channel scale needs no reduction: each FFN channel lives on one
  TP rank and fc1's output holds all tokens of the micro-batch (sequence parallelism all-gathers
  fc1's input), and folding s into the local fc2 weight columns is exact on every rank.

Using it in an MLP (per token)::

    s = smooth_scale(fc1_out, "per_token", tp_group=tp_group)   # [..., 1]
    z = SmoothSwiGLUFunction.apply(fc1_out, s)
    y = unsmooth_fc2_output(fc2(z), s)       # after the TP all-reduce (s is TP-global)

per channel::

    s = smooth_scale(fc1_out, "per_channel")                     # [F_local]
    z = SmoothSwiGLUFunction.apply(fc1_out, s)
    y = linear(z, fold_channel_scale(fc2_weight, s))             # W[:, i] * s_i

With sequence parallelism fc2's output is reduce-scattered along the sequence: slice the per-token
s to the rank's sequence shard before :func:`unsmooth_fc2_output`.

Savings: none (a numerics feature). Caveats: s costs 4 bytes per token (per_token) or per FFN
channel (per_channel) of extra saved state; per_channel materialises W * s (one fc2-weight-sized
temporary per call).

With an FP8 fc2 under per-tensor delayed scaling, agoq's MLP does not compose these pieces: it runs
:mod:`agoq.ops.smooth_swiglu_fp8`, the same math fused with fc2's FP8 cast and GEMMs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from agoq.ref.swiglu import (
    finish_smooth_scale,
    ref_swiglu,
    ref_swiglu_bwd,
    smooth_scale_per_channel,
    smooth_scale_per_token,
)

__all__ = [
    "SMOOTH_SWIGLU_MODES",
    "SmoothSwiGLUFunction",
    "smooth_scale",
    "smooth_swiglu",
    "smooth_swiglu_bwd",
    "unsmooth_fc2_output",
    "sequence_shard",
    "fold_channel_scale",
    "glu_smooth_scale",
]

SMOOTH_SWIGLU_MODES = ("per_token", "per_channel")


def _check_mode(mode: str) -> None:
    if mode not in SMOOTH_SWIGLU_MODES:
        raise ValueError(f"Smooth-SwiGLU mode {mode!r}: use one of {SMOOTH_SWIGLU_MODES}")


def smooth_scale(fc1_out: torch.Tensor, mode: str, *, tp_group: dist.ProcessGroup | None = None,
                 pow2: bool = True) -> torch.Tensor:
    """The smoothing scale (fp32, no grad): per_token [..., 1] (TP-global if ``tp_group`` is given),
    per_channel [F_local]. pow2 rounds s up to a power of two so dividing by it is exact."""
    _check_mode(mode)
    if mode == "per_channel":
        return smooth_scale_per_channel(fc1_out, pow2)
    s = smooth_scale_per_token(fc1_out, pow2=False)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(s, op=dist.ReduceOp.MAX, group=tp_group)
    return finish_smooth_scale(s, pow2)


def glu_smooth_scale(fc1_out: torch.Tensor, glu: torch.Tensor, mode: str, *,
                     tp_group: dist.ProcessGroup | None = None, pow2: bool = True) -> torch.Tensor:
    """The scale of an MLP that has already computed its SwiGLU output ``glu`` (Megatron's values, in
    the model dtype): per_token from |up| of ``fc1_out`` as :func:`smooth_scale` (TP-global with
    ``tp_group``); per_channel from max over tokens of |glu| itself (no fp32 SwiGLU recomputation; a
    valid scale either way, the rule is a choice: arXiv 2409.12517). fp32, no grad."""
    _check_mode(mode)
    if mode == "per_token":
        return smooth_scale(fc1_out, mode, tp_group=tp_group, pow2=pow2)
    amax = glu.detach().reshape(-1, glu.shape[-1]).abs().amax(dim=0).to(torch.float32)
    return finish_smooth_scale(amax, pow2)


def _check_scale(fc1_out: torch.Tensor, s: torch.Tensor) -> None:
    width = fc1_out.shape[-1] // 2
    per_token = s.shape == (*fc1_out.shape[:-1], 1)
    per_channel = s.shape == (width,)
    if not (per_token or per_channel):
        raise ValueError(
            f"Smooth-SwiGLU scale of shape {tuple(s.shape)} fits neither per-token {(*fc1_out.shape[:-1], 1)} nor "
            f"per-channel ({width},) for fc1 output {tuple(fc1_out.shape)}; build it with smooth_scale()"
        )
    if s.dtype != torch.float32:
        raise ValueError(f"Smooth-SwiGLU scale must be float32, got {s.dtype}; build it with smooth_scale()")


class SmoothSwiGLUFunction(torch.autograd.Function):
    """z = swiglu(fc1_out) / s with s saved from forward and reused in backward (s gets no gradient)."""

    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        _check_scale(fc1_out, s)
        ctx.save_for_backward(fc1_out, s)
        return (ref_swiglu(fc1_out.to(torch.promote_types(fc1_out.dtype, torch.float32))) / s).to(fc1_out.dtype)

    @staticmethod
    def backward(ctx, grad_z: torch.Tensor):
        fc1_out, s = ctx.saved_tensors
        return smooth_swiglu_bwd(fc1_out, grad_z, s), None


def smooth_swiglu_bwd(fc1_out: torch.Tensor, grad_z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """d loss / d fc1_out of z = swiglu(fc1_out) / s, for callers that store fc1_out themselves (e.g.
    quantized activation storage): pass the forward's s, not one recomputed from the stored tensor."""
    return ref_swiglu_bwd(fc1_out, grad_z.to(torch.promote_types(grad_z.dtype, torch.float32)) / s)


def smooth_swiglu(fc1_out: torch.Tensor, mode: str, *, tp_group: dist.ProcessGroup | None = None,
                  pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, s): the smoothed fc2 input and its scale (see the module docstring for how to undo s)."""
    s = smooth_scale(fc1_out, mode, tp_group=tp_group, pow2=pow2)
    return SmoothSwiGLUFunction.apply(fc1_out, s), s


def unsmooth_fc2_output(fc2_out: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """per_token: fc2_out * s (differentiable in fc2_out; s constant), result in fc2_out's dtype."""
    if s.shape[-1] != 1 or s.dim() != fc2_out.dim():
        raise ValueError(f"per-token scale {tuple(s.shape)} does not broadcast over fc2 output {tuple(fc2_out.shape)} "
                         "(with sequence parallelism slice s to the local sequence shard first)")
    return (fc2_out.to(torch.float32) * s).to(fc2_out.dtype)


def sequence_shard(s: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's part of a per-token scale ``s`` [s, b, 1] along the sequence (the first dimension), as Megatron's
    reduce-scatter of a sequence-parallel row-parallel linear's output splits it: rank r of ``tp_group`` gets the
    r-th of ``world`` equal chunks."""
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    if world == 1:
        return s
    if s.shape[0] % world:
        raise ValueError(f"per-token scale of {s.shape[0]} positions does not split over {world} sequence-parallel "
                         "ranks; the sequence length must be a multiple of the tensor-parallel size")
    return s.chunk(world, dim=0)[dist.get_rank(tp_group)]


def fold_channel_scale(fc2_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """per_channel: W * s over W's input (contraction) columns, differentiable in W; W's dtype."""
    if s.dim() != 1 or fc2_weight.shape[-1] != s.shape[0]:
        raise ValueError(f"per-channel scale {tuple(s.shape)} does not match fc2 weight {tuple(fc2_weight.shape)} "
                         "(expected [F_local] for a weight [H, F_local])")
    return (fc2_weight.to(torch.float32) * s).to(fc2_weight.dtype)
