"""Reference twins of :mod:`agoq.kernels.smooth_swiglu_fp8` (same signatures, plain PyTorch): Smooth-SwiGLU
fused with fc2's FP8 input cast under delayed scaling (FP8 paper §4.4, arXiv 2409.12517).

  ref_smooth_swiglu_amax(h, per_token) -> amax fp32: [T] = max_f |up| (per token, the authors' code), [F] =
      max_t |glu| (per channel, the rule of agoq.ops.smooth_swiglu.glu_smooth_scale)
  ref_smooth_swiglu_cast_delayed(h, amax, variant, meta, workspace, margin=0, pow2=False, *, per_token,
                                 rowmajor=True, transposed=False, t_colmajor=False, new_meta=None)
      -> (out, out_t, new_meta, s, scale_a)

with h = fc1 output [T.., 2F] = [gate | up] (T: all leading dims), glu = Megatron's unfused SwiGLU
(agoq.ops.saved_swiglu.swiglu_reference: silu(gate) and the product each rounded to h's dtype), s =
pow2_ceil(amax) (agoq.ref.swiglu.pow2_ceil: 0 -> 1; a power of two, so z = glu / s is exact), z in h's
dtype, and the FP8 cast of z with the delayed scale ``meta[1]`` plus the history push of max |z|
(agoq.ref.fp8.ref_fp8_cast_delayed_2d). ``scale_a`` = s * meta[0] [T, 1] per token (fc2's row-wise
``scale_a``: the GEMM then returns (z @ W.T) * s, the un-smoothed output), None per channel. ``amax=None``
(``per_token=False``): plain SwiGLU feeding a plain FP8 fc2: z = glu, no division; s and scale_a None.

These equal the composition the unfused path runs (agoq.megatron.mlp.AgoqMLP._smooth_forward, then
agoq.ops.fp8_linear's cast), which is what the Triton kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agoq.ref.fp8 import ref_fp8_cast_delayed_2d
from agoq.ref.swiglu import pow2_ceil

__all__ = ["ref_smooth_swiglu_amax", "ref_smooth_swiglu_cast_delayed", "ref_megatron_glu"]


def _halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(f"fc1 output {tuple(h.shape)}: the last dim must be even ([gate | up])")
    h2 = h.reshape(-1, h.shape[-1])
    return h2.chunk(2, dim=-1)


def ref_megatron_glu(h: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused SwiGLU values, silu(gate) * up in h's dtype, as a 2-D [T, F] tensor."""
    gate, up = _halves(h)
    return F.silu(gate) * up


def ref_smooth_swiglu_amax(h: torch.Tensor, per_token: bool) -> torch.Tensor:
    """max_f |up| per token [T] or max_t |glu| per channel [F] (fp32; NaN propagates; empty -> 0)."""
    gate, up = _halves(h)
    src, dim = (up, 1) if per_token else (ref_megatron_glu(h), 0)
    if src.numel() == 0:
        return torch.zeros(src.shape[1 - dim], dtype=torch.float32, device=h.device)
    return torch.linalg.vector_norm(src, float("inf"), dim=dim).to(torch.float32)


def ref_smooth_swiglu_cast_delayed(h: torch.Tensor, amax: torch.Tensor | None, variant: str, meta: torch.Tensor,
                                   workspace: torch.Tensor, margin: int = 0, pow2: bool = False, *, per_token: bool,
                                   rowmajor: bool = True, transposed: bool = False, t_colmajor: bool = False,
                                   new_meta: torch.Tensor | None = None):
    """z = glu / pow2_ceil(amax) cast to FP8 with meta's delayed scale, history pushed (module docstring);
    ``amax=None``: z = glu (no smoothing; s and scale_a None). ``workspace`` is the kernel's and not used here;
    ``t_colmajor`` returns out_t as a [T, F] column-major view."""
    if amax is None and per_token:
        raise ValueError("ref_smooth_swiglu_cast_delayed: per_token smoothing needs its amax; amax=None is plain "
                         "SwiGLU (s = 1) and takes per_token=False")
    glu = ref_megatron_glu(h)
    s = scale_a = None
    if amax is None:
        z = glu
    else:
        s = pow2_ceil(amax.to(torch.float32))
        # fp32 division, one rounding to h's dtype: what glu / s.to(glu.dtype) gives, also for a subnormal s
        # below the model dtype's range (the kernel divides in fp32)
        z = (glu.to(torch.float32) / (s[:, None] if per_token else s[None, :])).to(glu.dtype)
        scale_a = (s * meta[0]).reshape(-1, 1) if per_token else None
    out, out_t, new = ref_fp8_cast_delayed_2d(z, variant, meta, workspace, margin, pow2, rowmajor=rowmajor,
                                              transposed=transposed)
    if t_colmajor and out_t is not None:
        out_t = out_t.t()
    if new_meta is not None:
        new = new_meta.copy_(new)
    return out, out_t, new, s, scale_a
