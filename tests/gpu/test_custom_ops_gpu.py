"""agoq's torch.library custom ops on CUDA (the Triton side of agoq.ops.dispatch): opcheck and bitwise equality
with the eager kernel calls; the CPU twin (reference side) is tests/unit/test_custom_ops.py."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from agoq.formats import parse_format
from agoq.kernels.fp8_fused import cast_current_unchecked
from agoq.kernels.quant import dequantize, quantize
from agoq.kernels.swiglu_quant import dequant_swiglu_bwd, swiglu_quantize
from agoq.ops import custom_ops as C

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OK = {"test_schema": "SUCCESS", "test_autograd_registration": "SUCCESS", "test_faketensor": "SUCCESS",
      "test_aot_dispatch_dynamic": "SUCCESS"}


@pytest.mark.parametrize("fmt,shape", [("int8_b128", (3, 70)), ("nf4_b64", (5, 129)), ("int6_b64_sp2", (1,))])
def test_quant_ops_cuda(fmt, shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x.view(-1)[::37] *= 1000.0
    assert opcheck(torch.ops.agoq.quantize.default, (x, fmt, None)) == OK
    codes, scales = torch.ops.agoq.quantize(x, fmt)
    q = quantize(x, parse_format(fmt))
    assert torch.equal(codes, q.codes) and torch.equal(scales.view(torch.uint8), q.scales.view(torch.uint8))
    args = (codes, scales, fmt, list(shape), x.dtype)
    assert opcheck(torch.ops.agoq.dequantize.default, args) == OK
    assert torch.equal(torch.ops.agoq.dequantize(*args), dequantize(q))


def test_swiglu_quantize_op_cuda():
    h = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert opcheck(torch.ops.agoq.swiglu_quantize.default, (h, "int8_b128")) == OK
    z, codes, _ = torch.ops.agoq.swiglu_quantize(h, "int8_b128")
    z_k, q = swiglu_quantize(h.detach(), parse_format("int8_b128"))
    assert torch.equal(z, z_k) and torch.equal(codes, q.codes)
    gz = torch.randn_like(z)
    (grad,) = torch.autograd.grad(z, h, gz)
    assert torch.equal(grad, dequant_swiglu_bwd(q, gz))


def test_fp8_cast_current_op_cuda():
    x = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    assert opcheck(C.fp8_cast_current_op, (x, "e4m3", 0, False, True, True)) == OK
    out, out_t, meta = C.fp8_cast_current(x, "e4m3", 0, False, True, True)
    k_out, k_out_t, k_meta = cast_current_unchecked(x, "e4m3", 0, False, True, True)
    assert torch.equal(out.view(torch.uint8), k_out.view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), k_out_t.view(torch.uint8)) and torch.equal(meta, k_meta)
