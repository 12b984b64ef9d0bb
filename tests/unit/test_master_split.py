"""agoq.ref.master: FlashOptim master split invariants, exhaustive over the 16 low bits of fp32.

For bf16, the 16 low fp32 bits are exactly what theta' = RNE(theta) drops, so sweeping them for a
fixed (sign, exponent, high mantissa) covers every remainder pattern of that bf16 interval.
"""

import pytest
import torch

from agoq.ref.master import MASTER_NS, half_ulp_exponent, pow2_f32, ref_master_merge, ref_master_split
from agoq.testing.numerics import split_tie_inputs

LOW16 = torch.arange(1 << 16, dtype=torch.int64)
# fp32 exponent fields: smallest normal, fields whose corrections are still normal (>= 40, see
# below), around 1.0, large, and the largest finite; high 7 mantissa bits: 0, 1, middle, all ones
# (all ones: theta may round *up* to the next power of two, the widest-ULP case).
EXP_FIELDS_NORMAL = [40, 100, 126, 127, 128, 200, 254]
HIGH7 = [0, 1, 64, 127]


def _sweep(exp_field: int, high7: int, sign: int) -> torch.Tensor:
    bits = (sign << 31) | (exp_field << 23) | (high7 << 16) | LOW16
    return (
        bits.to(torch.int32).view(torch.float32)
        if sign == 0
        else (bits - (1 << 32)).to(torch.int32).view(torch.float32)
    )


def _ulp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 spacing at |x| (normal range)."""
    field = (x.view(torch.int32) >> 23) & 0xFF
    return pow2_f32(torch.clamp_min(field - 127, -126) - 23)


@pytest.mark.parametrize("rho_dtype", [torch.int8, torch.int16])
@pytest.mark.parametrize("exp_field", EXP_FIELDS_NORMAL)
def test_split_reconstruction_within_ulp_over_4n(rho_dtype, exp_field):
    # (254, all-ones high bits) rounds to bf16 inf: covered by the non-finite test instead
    high = [h for h in HIGH7 if not (exp_field == 254 and h == 127)]
    theta = torch.cat([_sweep(exp_field, h, s) for h in high for s in (0, 1)])
    narrow, rho = ref_master_split(theta, torch.bfloat16, rho_dtype)
    assert torch.equal(narrow, theta.to(torch.bfloat16))  # theta' is the RNE cast (the bound needs RN)
    assert rho.dtype == rho_dtype and int(rho.abs().max()) <= MASTER_NS[rho_dtype]
    back = ref_master_merge(narrow, rho)
    ulp_narrow = pow2_f32(half_ulp_exponent(narrow) + 1)
    # rho's step is ULP/(2N): nearest rounding errs <= ULP/(4N); the final fp32 add rounds once more
    # (<= ulp32/2); the rho/N division's own rounding (2**-24 relative) is far below both.
    bound = ulp_narrow / (4 * MASTER_NS[rho_dtype]) + _ulp32(theta) / 2
    assert bool(((back.double() - theta.double()).abs() <= bound.double()).all())


@pytest.mark.parametrize("exp_field", EXP_FIELDS_NORMAL)
def test_split32_exact_except_double_rounding_ties(exp_field):
    """split32 with N = 32767 (FlashOptim's N) is exact for >= 99.7 % of values and never off by more
    than one fp32 ulp. It cannot be exact everywhere: rho/N steps are 32768/32767 fp32 ulps, so e.g.
    an error of 16384 ulps decodes to 16384.50002 ulps (and a theta that rounds up to a power of two
    has twice the ULP(theta') of its own binade). Measured exact fraction: 99.73 % over a whole
    binade (CPU, 2026-05); the paper reports 99.92 % over all fp32 values."""
    theta = torch.cat([_sweep(exp_field, h, s) for h in range(0, 128, 9) for s in (0, 1)])
    back = ref_master_merge(*ref_master_split(theta, torch.bfloat16, torch.int16))
    diff_ulps = (back.view(torch.int32).long() - theta.view(torch.int32).long()).abs()
    assert int(diff_ulps.max()) <= 1
    assert float((diff_ulps == 0).double().mean()) >= 0.997


def test_split_zero_and_subnormals_round_trip_within_bound():
    # bf16 zero/subnormal theta': l uses the smallest normal exponent (-126), so 2**l = 2**-134
    tiny = torch.cat([torch.arange(0, 1 << 16, 97, dtype=torch.int32), torch.tensor([1, 0x7FFFFF], dtype=torch.int32)])
    theta = torch.cat([tiny.view(torch.float32), -tiny.view(torch.float32)])
    for rho_dtype in (torch.int8, torch.int16):
        narrow, rho = ref_master_split(theta, torch.bfloat16, rho_dtype)
        back = ref_master_merge(narrow, rho)
        # fp32 subnormal spacing 2**-149; 2**-134/(2N) ULP step plus subnormal rounding of the product
        bound = 2.0**-134 * 2 / (4 * MASTER_NS[rho_dtype]) + 2.0**-149
        assert float((back.double() - theta.double()).abs().max()) <= bound
    assert torch.equal(
        ref_master_split(torch.zeros(3), torch.bfloat16, torch.int8)[1], torch.zeros(3, dtype=torch.int8)
    )


def test_split_non_finite_keeps_value_and_zero_remainder():
    theta = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38])  # 3.4e38 rounds to bf16 inf
    narrow, rho = ref_master_split(theta, torch.bfloat16, torch.int8)
    assert torch.equal(rho, torch.zeros(4, dtype=torch.int8))
    back = ref_master_merge(narrow, rho)
    assert back[0] == float("inf") and back[1] == -float("inf") and torch.isnan(back[2]) and torch.isinf(back[3])


def test_split_fp16_narrow_within_bound():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(1 << 16, generator=gen) * torch.logspace(-6, 4, 1 << 16)
    for rho_dtype in (torch.int8, torch.int16):
        narrow, rho = ref_master_split(theta, torch.float16, rho_dtype)
        assert torch.equal(narrow, theta.to(torch.float16))
        back = ref_master_merge(narrow, rho)
        bound = pow2_f32(half_ulp_exponent(narrow) + 1) / (4 * MASTER_NS[rho_dtype]) + _ulp32(theta) / 2
        assert bool(((back.double() - theta.double()).abs() <= bound.double()).all())


def test_split24_is_much_better_than_bf16_alone():
    """The point of the remainder: ~2**-16 relative error instead of bf16's 2**-9."""
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(1 << 16, generator=gen)
    back = ref_master_merge(*ref_master_split(theta, torch.bfloat16, torch.int8))
    rel_split = ((back - theta).abs() / theta.abs()).max()
    rel_bf16 = ((theta.to(torch.bfloat16).float() - theta).abs() / theta.abs()).max()
    assert rel_split <= 2.0**-15 and rel_bf16 >= 2.0**-10  # 2**-9 (half of bf16's 2**-8 ULP) vs 2**-16 ... 2**-15


def test_split_rejects_bad_dtypes():
    with pytest.raises(ValueError, match="fp32 master"):
        ref_master_split(torch.zeros(2, dtype=torch.float64), torch.bfloat16, torch.int8)
    with pytest.raises(ValueError, match="int8/int16"):
        ref_master_split(torch.zeros(2), torch.bfloat16, torch.int32)
    with pytest.raises(ValueError, match="int8"):
        ref_master_merge(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32))


# (narrow, rho dtype, theta binades): fp16's subnormal corner of issue 21 ([2**-27, 2**-24): split32 was
# up to 0.19 % over the bound), fp16 subnormal and normal theta', bf16 subnormal and normal theta'
TIE_CASES = [
    (torch.float16, torch.int16, -27, -24),
    (torch.float16, torch.int8, -27, -24),
    (torch.float16, torch.int16, -24, -14),
    (torch.float16, torch.int16, -3, 3),
    (torch.bfloat16, torch.int16, -136, -124),
    (torch.bfloat16, torch.int16, -3, 3),
    (torch.bfloat16, torch.int8, -3, 3),
]


@pytest.mark.parametrize("narrow_dtype,rho_dtype,lo,hi", TIE_CASES)
def test_split_rho_rounds_the_exact_product_and_keeps_the_bound(narrow_dtype, rho_dtype, lo, hi):
    """Issue 21: rho = round_half_away(e * N) of the exact product. The fp32 product could round onto a
    .5 tie the exact value lies below, and rho then went one step too far (|e N - rho| up to 0.5 + 2**-10),
    which broke the bound by up to 0.19 % for fp16 masters in [2**-27, 2**-24). Inputs: masters whose e * N
    lies within 2 fp32 ulps of a tie (agoq.testing.numerics.split_tie_inputs)."""
    theta = split_tie_inputs(narrow_dtype, MASTER_NS[rho_dtype], lo, hi)
    narrow, rho = ref_master_split(theta, narrow_dtype, rho_dtype)
    half_ulp = 2.0 ** half_ulp_exponent(narrow).to(torch.float64)
    y = (theta.double() - narrow.double()) / half_ulp * MASTER_NS[rho_dtype]  # exact in fp64
    mag = y.abs()
    expected = torch.floor(mag) + (mag - torch.floor(mag) >= 0.5).double()
    assert torch.equal(rho.double(), torch.where(y < 0, -expected, expected))
    back = ref_master_merge(narrow, rho)
    field = (theta.view(torch.int32) >> 23) & 0xFF  # fp32 spacing, subnormal theta included (2**-149)
    ulp32 = 2.0 ** (torch.clamp_min(field - 127, -126) - 23).to(torch.float64)
    bound = 2 * half_ulp / (4 * MASTER_NS[rho_dtype]) + ulp32 / 2
    assert bool(((back.double() - theta.double()).abs() <= bound).all())
