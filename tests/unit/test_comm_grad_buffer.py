"""QuantizedGradBuffer: byte accounting, dequant-add-requant accumulation error, error feedback,
segment independence, non-finite blocks."""

from __future__ import annotations

import pytest
import torch

from agoq.comm.grad_buffer import QuantizedGradBuffer
from agoq.formats import parse_format

FMT = "int8_b256"
QMAX = 127.0
MICRO_BATCHES = 8
# fp32 slack on the per-step bound: quantize (2 roundings) + dequantize (1) + the add (1)
FP32_SLACK = 8 * torch.finfo(torch.float32).eps


def _grads(seed: int, numel: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(count)]


def test_bytes_per_param_int8_b256():
    buf = QuantizedGradBuffer([256 * 40, 256 * 24], FMT)
    assert buf.nbytes == 256 * 64 + 64 * 4
    assert buf.bytes_per_param() == pytest.approx(1 + 4 / 256, abs=0)  # 1.015625, exact
    ef = QuantizedGradBuffer([256 * 64], FMT, error_feedback=True)
    assert ef.bytes_per_param() == pytest.approx(1 + 4 / 256 + 2, abs=0)  # + bf16 residual
    tail = QuantizedGradBuffer([300], FMT)  # padded to 2 blocks
    assert tail.nbytes == parse_format(FMT).storage_bytes(300) == 512 + 8


def _accumulation_bound(grads: list[torch.Tensor], block: int) -> torch.Tensor:
    """e_k <= e_{k-1} + (max|S_k|_block + e_{k-1}) / (2 qmax): each requantization rounds the
    running sum (whose block absmax is at most the exact one plus the error so far) to half a step."""
    partial = torch.zeros_like(grads[0], dtype=torch.float64)
    err = torch.zeros(grads[0].numel() // block, dtype=torch.float64)
    for g in grads:
        partial += g.double()
        absmax = partial.view(-1, block).abs().amax(1)
        err = err + (absmax + err) / (2 * QMAX) * (1 + FP32_SLACK)
    return err.repeat_interleave(block)


def test_accumulate_within_derived_bound_and_error_feedback_helps():
    grads = _grads(0, 256 * 32, MICRO_BATCHES)
    exact = sum(g.double() for g in grads)
    plain = QuantizedGradBuffer([exact.numel()], FMT)
    ef = QuantizedGradBuffer([exact.numel()], FMT, error_feedback=True)
    for g in grads:
        plain.accumulate(0, g)
        ef.accumulate(0, g)
    err_plain = (plain.dequantize(0).double() - exact).abs()
    err_ef = (ef.dequantize(0).double() - exact).abs()
    assert torch.all(err_plain <= _accumulation_bound(grads, 256))
    rel_plain = float(err_plain.norm() / exact.norm())
    rel_ef = float(err_ef.norm() / exact.norm())
    # with feedback the only loss is the bf16 rounding of a residual <= half a step: 2**-9 of it
    assert rel_ef < rel_plain / 50, (rel_plain, rel_ef)


def test_segments_do_not_interfere():
    buf = QuantizedGradBuffer([100, 700], FMT)
    buf.accumulate(0, torch.ones(100))
    before = buf.quantized(0).codes.clone(), buf.quantized(0).scales.clone()
    buf.accumulate(1, torch.full((700,), 1e6))
    assert torch.equal(buf.quantized(0).codes, before[0]) and torch.equal(buf.quantized(0).scales, before[1])
    assert torch.equal(buf.dequantize(0), torch.ones(100))  # 1.0 is exact: absmax 1 -> code 127


def test_nonfinite_block_is_nan_until_zeroed():
    buf = QuantizedGradBuffer([512], FMT, error_feedback=True)
    g = torch.randn(512)
    g[3] = float("inf")
    buf.accumulate(0, g)
    assert buf.has_nonfinite()
    value = buf.dequantize(0)
    assert torch.isnan(value[:256]).all() and torch.isfinite(value[256:]).all()
    buf.accumulate(0, torch.ones(512))
    assert torch.isnan(buf.dequantize(0)[:256]).all()  # never silently healed
    buf.zero_()
    assert not buf.has_nonfinite() and torch.equal(buf.dequantize(0), torch.zeros(512))


def test_scale_and_copy():
    buf = QuantizedGradBuffer([256], FMT)
    x = torch.randn(256)
    buf.copy_(0, x)
    first = buf.dequantize(0)
    buf.scale_(0.5)
    assert torch.equal(buf.dequantize(0), first * 0.5)  # a power of two rescales exactly


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unquantized"):
        QuantizedGradBuffer([4], "bf16")
    with pytest.raises(ValueError, match="unsigned"):
        QuantizedGradBuffer([4], "cuint8_b32")
    with pytest.raises(ValueError, match="holds 4 elements"):
        QuantizedGradBuffer([4], FMT).accumulate(0, torch.ones(5))


@pytest.mark.parametrize("feedback", [False, True])
def test_reference_accumulate_is_the_buffers_composition(feedback):
    """agoq.ref.comm.ref_accumulate_ (the spec of the fused CUDA kernel) == QuantizedGradBuffer.accumulate's
    dequantize-add-requantize on CPU, codes, scales and residual, over a ragged segment."""
    from agoq.ref.comm import ref_accumulate_

    buf = QuantizedGradBuffer([700], FMT, error_feedback=feedback)
    codes, scales = buf.codes_u8.clone(), buf.scales.clone()
    residual = buf.residual.clone() if feedback else None
    for g in _grads(5, 700, 3):
        buf.accumulate(0, g)
        ref_accumulate_(codes, scales, g, parse_format(FMT), residual)
    assert torch.equal(buf.codes_u8, codes) and torch.equal(buf.scales, scales)
    if feedback:
        assert torch.equal(buf.residual, residual)


def test_given_storage_is_used_and_checked():
    """The peer transport hands the buffer its storage (agoq.comm.symm_store); a wrong one is refused."""
    fmt = "int8_b256"
    codes, scales = torch.zeros(3 * 256, dtype=torch.uint8), torch.zeros(3)
    buf = QuantizedGradBuffer([300, 100], fmt, storage=lambda nb: (codes[: nb * 256], scales[:nb]))
    buf.accumulate(0, torch.ones(300))
    assert buf.codes_u8.data_ptr() == codes.data_ptr() and bool(scales[0] > 0)
    with pytest.raises(ValueError, match="codes must be 768 contiguous"):
        QuantizedGradBuffer([300, 100], fmt, storage=lambda nb: (codes[:256], scales[:nb]))
    with pytest.raises(ValueError, match="must start zeroed"):
        QuantizedGradBuffer([300, 100], fmt, storage=lambda nb: (codes[: nb * 256], scales[:nb]))
