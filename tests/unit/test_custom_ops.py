"""agoq's torch.library custom ops (agoq.ops.custom_ops) on the CPU: ``torch.library.opcheck`` (schema, fake
implementation vs real outputs, autograd registration, AOT dispatch with dynamic shapes) on odd sizes, zeros and
outliers, and the op's outputs bit-identical to the reference it dispatches to (what the eager code calls)."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from agoq.formats import parse_format
from agoq.ops import custom_ops as C
from agoq.ref.fp8 import ref_fp8_cast_current_2d, ref_fp8_cast_delayed_2d
from agoq.ref.quant import ref_dequantize, ref_quantize
from agoq.ref.swiglu import ref_swiglu_bwd_scaled, ref_swiglu_scaled
from agoq.ref.swiglu_quant import ref_dequant_swiglu_bwd, ref_swiglu_quantize

OPCHECK_OK = {"test_schema": "SUCCESS", "test_autograd_registration": "SUCCESS", "test_faketensor": "SUCCESS",
              "test_aot_dispatch_dynamic": "SUCCESS"}


def _input(kind: str, shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    if kind == "zeros":
        x.zero_()
    elif kind == "outliers" and x.numel():
        x.view(-1)[:: 37] *= 1000.0  # one outlier every 37 elements: blocks with very different scales
    return x


QUANT_CASES = [  # (format, shape, dtype, input kind, seed)
    ("int8_b128", (3, 70), torch.float32, "randn", None),
    ("int4_b64", (5, 13), torch.bfloat16, "outliers", None),
    ("nf4_b64", (1,), torch.float16, "randn", None),
    ("int6_b64_sp2", (2, 3, 33), torch.bfloat16, "outliers", None),
    ("fp8e4m3_b128", (129,), torch.float32, "zeros", None),
    ("int8_b128_sr", (7, 19), torch.float32, "randn", 1234),
]


@pytest.mark.parametrize("fmt,shape,dtype,kind,seed", QUANT_CASES)
def test_quantize_dequantize_ops(fmt, shape, dtype, kind, seed):
    x = _input(kind, shape, dtype)
    assert opcheck(torch.ops.agoq.quantize.default, (x, fmt, seed)) == OPCHECK_OK
    codes, scales = torch.ops.agoq.quantize(x, fmt, seed)
    q = ref_quantize(x, fmt, seed=seed)
    assert torch.equal(codes, q.codes) and torch.equal(scales.view(torch.uint8), q.scales.view(torch.uint8))
    args = (codes, scales, fmt, list(shape), dtype)
    assert opcheck(torch.ops.agoq.dequantize.default, args) == OPCHECK_OK
    assert torch.equal(torch.ops.agoq.dequantize(*args), ref_dequantize(q))


def test_quantize_op_of_a_plain_format_does_not_alias_its_input():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert opcheck(torch.ops.agoq.quantize.default, (x, "bf16", None)) == OPCHECK_OK
    codes, _ = torch.ops.agoq.quantize(x, "bf16")
    assert codes.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(codes, x.reshape(-1).view(torch.uint8))


SWIGLU_CASES = [("int8_b128", (3, 256), torch.bfloat16, "randn"), ("nf4_b64", (2, 1, 128), torch.float32, "outliers"),
                ("fp8e4m3_b128", (1, 256), torch.float16, "zeros")]


@pytest.mark.parametrize("fmt,shape,dtype,kind", SWIGLU_CASES)
def test_swiglu_quantize_op_and_its_gradient(fmt, shape, dtype, kind):
    h = _input(kind, shape, dtype).requires_grad_(True)
    assert opcheck(torch.ops.agoq.swiglu_quantize.default, (h, fmt)) == OPCHECK_OK
    z, codes, scales = torch.ops.agoq.swiglu_quantize(h, fmt)
    z_ref, q = ref_swiglu_quantize(h.detach(), parse_format(fmt))
    assert torch.equal(z, z_ref) and torch.equal(codes, q.codes)
    assert not codes.requires_grad and not scales.requires_grad
    grad_z = _input("randn", z.shape, dtype, seed=1)
    (grad_h,) = torch.autograd.grad(z, h, grad_z)
    assert torch.equal(grad_h, ref_dequant_swiglu_bwd(q, grad_z))  # the gradient at the dequantized h
    shape_l = list(shape)
    for op, extra in ((torch.ops.agoq.dequant_swiglu.default, ()), (torch.ops.agoq.dequant_swiglu_bwd.default,
                                                                     (grad_z,))):
        assert opcheck(op, (codes, scales, fmt, shape_l, dtype, *extra, None)) == OPCHECK_OK


@pytest.mark.parametrize("scale", [None, "per_token", "per_channel"])
def test_swiglu_op_forward_backward(scale):
    h = _input("outliers", (3, 5, 64), torch.bfloat16).requires_grad_(True)
    s = {None: None, "per_token": torch.full((3, 5, 1), 4.0), "per_channel": torch.full((32,), 0.5)}[scale]
    assert opcheck(torch.ops.agoq.swiglu.default, (h, s)) == OPCHECK_OK
    z = torch.ops.agoq.swiglu(h, s)
    assert torch.equal(z, ref_swiglu_scaled(h.detach(), s))
    grad_z = _input("randn", z.shape, torch.bfloat16, seed=2)
    assert opcheck(torch.ops.agoq.swiglu_bwd.default, (h.detach(), grad_z, s)) == OPCHECK_OK
    (grad_h,) = torch.autograd.grad(z, h, grad_z)
    assert torch.equal(grad_h, ref_swiglu_bwd_scaled(h.detach(), grad_z, s))


@pytest.mark.parametrize("rowmajor,transposed", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("kind", ["randn", "zeros", "outliers"])
def test_fp8_cast_ops(rowmajor, transposed, kind):
    x = _input(kind, (5, 48), torch.bfloat16)
    assert opcheck(C.fp8_cast_current_op, (x, "e4m3", 0, False, rowmajor, transposed)) == OPCHECK_OK
    out, out_t, meta = C.fp8_cast_current(x, "e4m3", 0, False, rowmajor, transposed)
    ref = ref_fp8_cast_current_2d(x, "e4m3", 0, False, rowmajor=rowmajor, transposed=transposed)
    for got, want in zip((out, out_t, meta), ref, strict=True):
        assert (got is None) == (want is None)
        assert got is None or torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got,
                                          want.view(torch.uint8) if want.dtype != torch.float32 else want)
    history = torch.tensor([3.0, 1.0, 0.0])
    meta_d = torch.cat([torch.tensor([1 / 64, 64.0, 0.0, 0.0]), history])
    workspace = torch.zeros(2, dtype=torch.int32)
    assert opcheck(C.fp8_cast_delayed_op, (x, "e5m2", meta_d, workspace, 1, True, rowmajor, transposed)) == OPCHECK_OK
    out, out_t, new_meta = C.fp8_cast_delayed(x, "e5m2", meta_d, workspace, 1, True, rowmajor, transposed)
    r_out, r_out_t, r_meta = ref_fp8_cast_delayed_2d(x, "e5m2", meta_d, workspace, 1, True, rowmajor=rowmajor,
                                                      transposed=transposed)
    assert torch.equal(new_meta, r_meta)
    assert (out is None) == (r_out is None) and (out is None or torch.equal(out.view(torch.uint8),
                                                                            r_out.view(torch.uint8)))
    assert (out_t is None) == (r_out_t is None) and (out_t is None or torch.equal(out_t.view(torch.uint8),
                                                                                  r_out_t.view(torch.uint8)))


def test_a_wrong_fake_fails_opcheck():
    """opcheck is not vacuous here: an op whose fake disagrees with its real output is caught."""

    @torch.library.custom_op("agoq_test::bad_quantize", mutates_args=())
    def bad(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.agoq.quantize(x, "int8_b128")[0]

    @bad.register_fake
    def _(x):
        return x.new_empty((x.numel(),), dtype=torch.uint8)  # forgets the tail block's padding

    with pytest.raises(Exception, match="(?i)shape|size|mismatch"):
        opcheck(bad, (torch.randn(70),), test_utils=("test_faketensor",), raise_exception=True)
