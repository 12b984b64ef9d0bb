"""Fused SwiGLU for the recompute in backward (agoq's saved-activation path), Triton.

Twins of :mod:`agoq.ref.swiglu` (same signatures, same fp32 math, one rounding):

  swiglu_fwd(fc1_out [T.., 2F], s=None | [T.., 1] | [F]) -> z [T.., F]     (ref_swiglu_scaled)
  swiglu_bwd(fc1_out [T.., 2F], grad_z [T.., F], s=None | [T.., 1] | [F]) -> grad_fc1_out [T.., 2F]
                                                                          (ref_swiglu_bwd_scaled)

swiglu_fwd rebuilds fc2's input from the dequantized fc1 output for fc2's weight gradient; the forward
pass itself keeps Megatron's own ops (so agoq never changes forward values). ATen runs silu and the
product as two strided (non-vectorised) passes over the [gate | up] halves; one kernel reads each half
once.

with fc1_out = [gate | up] (Megatron's fused fc1 layout) and z = silu(gate) * up / s. One read of
fc1_out and grad_z, one write of the gradient: 5 x 2 bytes per F element in bf16, against ~8 reads and
writes of full tensors when autograd re-runs chunk / silu / mul and their backwards (and the cat
that joins the two halves). Non-finite inputs propagate (no clamping): NaN in stays NaN out.

Tolerance against the reference (tests/kernels/test_swiglu_kernels.py): both compute in fp32 and round
once; they differ only in ``exp`` (Triton's vs ATen's), a few fp32 ulp before the final rounding,
so outputs agree within one ulp of the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.kernels.fastlaunch import FastKernel

__all__ = ["swiglu_fwd", "swiglu_bwd"]

BLOCK_F = 1024  # columns per program: 4 warps x 32 lanes x 8 bf16 (one 16-byte vector each)
NUM_WARPS = 4
SCALE_NONE, SCALE_PER_ROW, SCALE_PER_COL = 0, 1, 2


@triton.jit
def _load_gate_up(h_ptr, F, BLOCK: tl.constexpr):
    """This program's row, column block, mask and fp32 [gate | up] halves of fc1_out [T, 2F]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    h_row = h_ptr + row * 2 * F
    gate = tl.load(h_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_row + F + cols, mask=ok, other=0.0).to(tl.float32)
    return row, cols, ok, gate, up


@triton.jit
def _swiglu_bwd_kernel(
    h_ptr,  # fc1_out [T, 2F], row-major: gate = h[:, :F], up = h[:, F:]
    gz_ptr,  # grad_z [T, F], row-major
    s_ptr,  # fp32 scale: [T] (per row) or [F] (per column); unused without a scale
    out_ptr,  # grad_fc1_out [T, 2F], row-major, fc1_out's dtype
    F,  # int: FFN width (per TP rank)
    SCALE_MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, cols, ok, gate, up = _load_gate_up(h_ptr, F, BLOCK)
    g = tl.load(gz_ptr + row * F + cols, mask=ok, other=0.0).to(tl.float32)
    if SCALE_MODE == 1:
        g = g / tl.load(s_ptr + row)
    elif SCALE_MODE == 2:
        g = g / tl.load(s_ptr + cols, mask=ok, other=1.0)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = g * gate * sig
    o_row = out_ptr + row * 2 * F
    tl.store(o_row + cols, d_gate.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o_row + F + cols, d_up.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_fwd_kernel(
    h_ptr,  # fc1_out [T, 2F], row-major: gate = h[:, :F], up = h[:, F:]
    s_ptr,  # fp32 scale: [T] (per row) or [F] (per column); unused without a scale
    out_ptr,  # z [T, F], row-major, fc1_out's dtype
    F,  # int: FFN width (per TP rank)
    SCALE_MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, cols, ok, gate, up = _load_gate_up(h_ptr, F, BLOCK)
    z = gate / (1.0 + tl.exp(-gate)) * up
    if SCALE_MODE == 1:
        z = z / tl.load(s_ptr + row)
    elif SCALE_MODE == 2:
        z = z / tl.load(s_ptr + cols, mask=ok, other=1.0)
    tl.store(out_ptr + row * F + cols, z.to(out_ptr.dtype.element_ty), mask=ok)


# direct launchers (agoq.kernels.fastlaunch): every parameter positionally, in signature order
_BWD = FastKernel(_swiglu_bwd_kernel, num_warps=NUM_WARPS)
_FWD = FastKernel(_swiglu_fwd_kernel, num_warps=NUM_WARPS)


def _scale_mode(fc1_out: torch.Tensor, grad_z: torch.Tensor, s: torch.Tensor | None) -> int:
    if s is None:
        return SCALE_NONE
    if s.dtype != torch.float32:
        raise ValueError(f"swiglu_bwd: the Smooth-SwiGLU scale must be float32, got {s.dtype}")
    if s.shape == (*grad_z.shape[:-1], 1):
        return SCALE_PER_ROW
    if s.shape == (grad_z.shape[-1],):
        return SCALE_PER_COL
    raise ValueError(
        f"swiglu_bwd: scale of shape {tuple(s.shape)} is neither per-token {(*grad_z.shape[:-1], 1)} nor "
        f"per-channel ({grad_z.shape[-1]},) for fc1 output {tuple(fc1_out.shape)}"
    )


def swiglu_bwd(fc1_out: torch.Tensor, grad_z: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of agoq.ref.swiglu.ref_swiglu_bwd_scaled (see the module docstring)."""
    width = fc1_out.shape[-1]
    if width % 2 or grad_z.shape != (*fc1_out.shape[:-1], width // 2):
        raise ValueError(
            f"swiglu_bwd: fc1 output {tuple(fc1_out.shape)} (even last dim [gate | up]) and grad_z "
            f"{tuple(grad_z.shape)} (same leading dims, half the width) do not match"
        )
    mode = _scale_mode(fc1_out, grad_z, s)
    ffn = width // 2
    rows = fc1_out.numel() // width if width else 0
    out = torch.empty(fc1_out.shape, dtype=fc1_out.dtype, device=fc1_out.device)
    if rows == 0 or ffn == 0:
        return out
    h = fc1_out.contiguous()
    gz = grad_z.contiguous()
    s_flat = h if s is None else s.contiguous().reshape(-1)
    _BWD((rows, triton.cdiv(ffn, BLOCK_F)), h, gz, s_flat, out, ffn, mode, BLOCK_F)
    return out


def swiglu_fwd(fc1_out: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of agoq.ref.swiglu.ref_swiglu_scaled (see the module docstring)."""
    width = fc1_out.shape[-1]
    if width % 2:
        raise ValueError(f"swiglu_fwd: fc1 output {tuple(fc1_out.shape)} has an odd last dim; it must be [gate | up]")
    ffn = width // 2
    out = torch.empty((*fc1_out.shape[:-1], ffn), dtype=fc1_out.dtype, device=fc1_out.device)
    mode = _scale_mode(fc1_out, out, s)
    rows = fc1_out.numel() // width if width else 0
    if rows == 0 or ffn == 0:
        return out
    h = fc1_out.contiguous()
    s_flat = h if s is None else s.contiguous().reshape(-1)
    _FWD((rows, triton.cdiv(ffn, BLOCK_F)), h, s_flat, out, ffn, mode, BLOCK_F)
    return out
