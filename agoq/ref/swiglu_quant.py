"""Reference twins of :mod:`agoq.kernels.swiglu_quant` (SwiGLU fused with the quantize / dequantize
of its saved input), plain PyTorch: each is the composition the fused kernel replaces.

  ref_swiglu_quantize(fc1_out, fmt) -> (z, q)   Megatron's unfused silu(gate) * up in fc1_out's dtype
                                                (ATen: silu rounded to the dtype, then the product),
                                                and ref_quantize(fc1_out, fmt)
  ref_dequant_swiglu_fwd(q, s)      -> z_hat    ref_swiglu_scaled(ref_dequantize(q), s)
  ref_dequant_swiglu_bwd(q, gz, s)  -> grad_h   ref_swiglu_bwd_scaled(ref_dequantize(q), gz, s)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agoq.formats import QuantFormat
from agoq.ref.quant import QuantizedTensor, ref_dequantize, ref_quantize
from agoq.ref.swiglu import ref_swiglu_bwd_scaled, ref_swiglu_scaled

__all__ = ["ref_swiglu_quantize", "ref_dequant_swiglu_fwd", "ref_dequant_swiglu_bwd"]


def ref_swiglu_quantize(fc1_out: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, QuantizedTensor]:
    """(z, q) with z = silu(gate) * up as Megatron's unfused GLU computes it, q = fc1_out quantized."""
    gate, up = torch.chunk(fc1_out, 2, dim=-1)
    return F.silu(gate) * up, ref_quantize(fc1_out, fmt)


def ref_dequant_swiglu_fwd(q: QuantizedTensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """fc2's input rebuilt from the quantized fc1 output (fp32 math, one rounding; s: Smooth-SwiGLU)."""
    return ref_swiglu_scaled(ref_dequantize(q), s)


def ref_dequant_swiglu_bwd(q: QuantizedTensor, grad_z: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d fc1_out at the dequantized fc1 output (fp32 math, one rounding)."""
    return ref_swiglu_bwd_scaled(ref_dequantize(q), grad_z, s)
