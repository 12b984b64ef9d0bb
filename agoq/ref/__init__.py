"""agoq.ref: plain-PyTorch reference implementations (the executable spec, CPU and GPU)."""

from agoq.ref.quant import QuantizedTensor, ref_dequantize, ref_quantize

__all__ = ["QuantizedTensor", "ref_quantize", "ref_dequantize"]
