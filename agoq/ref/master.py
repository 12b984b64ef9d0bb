"""Reference master-weight split/merge (FlashOptim ULP-normalised error correction), plain PyTorch.

A fp32 master weight theta is stored as the model's 16-bit parameter theta' = RN(theta) plus a small
signed integer rho that says where theta lies inside theta's rounding interval (FlashOptim, arXiv 2602.23349,
FlashOptim arXiv 2602.23349 eqs. 1-2, Alg. 1):

    theta' = RNE(theta) to bf16 / fp16
    l      = max(E(theta'), E_min) - M - 1        so 2**l = ULP(theta') / 2
    rho    = round_half_away(clamp((theta - theta') * 2**-l, -1, 1) * N)   (the exact product rounded once)
    merge:   theta_hat = theta' + (rho / N) * 2**l

E is the unbiased exponent of theta' (E_min, the narrow type's smallest normal exponent, for zero and
subnormals), M its stored mantissa bits (7 bf16, 10 fp16), N = 127 for an int8 rho ("split24") or
32767 for int16 ("split32"). Scaling by 2**l is done as two power-of-two multiplies (2**a * 2**b,
a + b = l, each factor a normal fp32) so no factor overflows or underflows; every multiply by a power
of two is exact, so the only roundings are: the fp32 subtraction theta - theta' (exact: Sterbenz),
rho's rounding to an integer (of the exact product e * N, not of its fp32 rounding), rho / N, and the
final fp32 add.

Bound (docs/numerics.md): |theta - theta_hat| <= ULP(theta') / (4 N) + ulp32(theta) / 2.
Non-finite theta or theta' (overflow to Inf): theta' keeps the NaN/Inf, rho = 0.
The Triton kernels (agoq.kernels.optim) reproduce these values bit for bit.
"""

from __future__ import annotations

import torch

__all__ = [
    "MASTER_NS",
    "NARROW_DTYPES",
    "ref_master_split",
    "ref_master_merge",
    "round_to_narrow",
    "half_ulp_exponent",
    "pow2_f32",
]

# rho's signed maximum per storage dtype: FlashOptim's algorithm box and code use 2**(b-1) - 1
# (the prose's 2**b - 1 is a typo; FlashOptim, arXiv 2602.23349).
MASTER_NS = {torch.int8: 127, torch.int16: 32767}
# narrow param dtype -> (stored mantissa bits M, smallest normal unbiased exponent E_min)
NARROW_DTYPES = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}
FP32_EXP_BIAS = 127


def pow2_f32(exp_i32: torch.Tensor) -> torch.Tensor:
    """2**exp as fp32, built from its bits (exact); exp must lie in the normal range [-126, 127]."""
    return ((exp_i32 + FP32_EXP_BIAS) << 23).to(torch.int32).view(torch.float32)


def round_to_narrow(theta_f32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even cast of fp32 to bf16/fp16 (PyTorch's cast is RNE on CPU and GPU)."""
    return theta_f32.to(dtype)


def half_ulp_exponent(narrow: torch.Tensor) -> torch.Tensor:
    """l with 2**l = ULP(theta') / 2 (int32), from the fp32 exponent field of theta'."""
    mant_bits, e_min = NARROW_DTYPES[narrow.dtype]
    field = (narrow.to(torch.float32).view(torch.int32) >> 23) & 0xFF
    exp = torch.clamp_min(field - FP32_EXP_BIAS, e_min)  # zero / subnormal -> E_min
    return exp - (mant_bits + 1)


def _split_exponents(ell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) with a + b = l and both in fp32's normal range for every l the narrow types produce."""
    a = torch.div(ell, 2, rounding_mode="floor")
    return a, ell - a


def _check(theta_or_param: torch.Tensor, rho: torch.Tensor | None = None) -> None:
    if theta_or_param.dtype not in NARROW_DTYPES and theta_or_param.dtype != torch.float32:
        raise ValueError(f"master split needs a bf16/fp16 param (fp32 master), got {theta_or_param.dtype}")
    if rho is not None:
        if rho.dtype not in MASTER_NS:
            raise ValueError(f"master remainder must be int8 (split24) or int16 (split32), got {rho.dtype}")
        if rho.shape != theta_or_param.shape:
            raise ValueError(f"remainder shape {tuple(rho.shape)} != param shape {tuple(theta_or_param.shape)}")


def ref_master_split(
    theta_f32: torch.Tensor, narrow_dtype: torch.dtype, rho_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (theta' in narrow_dtype, rho in rho_dtype), same shape."""
    if theta_f32.dtype != torch.float32:
        raise ValueError(f"ref_master_split expects an fp32 master, got {theta_f32.dtype}")
    if narrow_dtype not in NARROW_DTYPES or rho_dtype not in MASTER_NS:
        raise ValueError(f"split to ({narrow_dtype}, {rho_dtype}) is not supported; use bf16/fp16 with int8/int16")
    narrow = round_to_narrow(theta_f32, narrow_dtype)
    rho = remainder_of(theta_f32, narrow, MASTER_NS[rho_dtype]).to(rho_dtype)
    return narrow, rho


def remainder_of(theta_f32: torch.Tensor, narrow: torch.Tensor, n: int) -> torch.Tensor:
    """rho (as fp32 integers) of theta given its rounded theta'; 0 where theta or theta' is not finite."""
    a, b = _split_exponents(half_ulp_exponent(narrow))
    err = theta_f32 - narrow.to(torch.float32)
    err_n = (err * pow2_f32(-b)) * pow2_f32(-a)  # exact power-of-two scalings
    # rho rounds the *exact* product e * N: fp64 holds it (24 + 15 bits <= 53). An fp32 product rounds
    # first, and can land on a .5 tie that the exact value is below (then rounded away from zero, |e N -
    # rho| reached 0.5 + 2**-10 for split32). The kernel gets the same rho from fp32 math with
    # an exact residual (agoq.kernels.optim).
    y = err_n.clamp(-1.0, 1.0).to(torch.float64) * float(n)
    mag = y.abs()
    floor = torch.floor(mag)
    rho = floor + (mag - floor >= 0.5).to(torch.float64)  # ties away from zero (FlashOptim code)
    rho = torch.where(y < 0, -rho, rho).to(torch.float32)
    finite = torch.isfinite(theta_f32) & torch.isfinite(narrow)  # theta may round up to +-inf
    return torch.where(finite, rho, 0.0)


def ref_master_merge(param: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """(theta', rho) -> fp32 master theta_hat = theta' + (rho / N) * 2**l."""
    _check(param, rho)
    if param.dtype not in NARROW_DTYPES:
        raise ValueError(f"ref_master_merge needs a bf16/fp16 param, got {param.dtype}")
    n = MASTER_NS[rho.dtype]
    a, b = _split_exponents(half_ulp_exponent(param))
    frac = rho.to(torch.float32) / torch.full_like(param, n, dtype=torch.float32)  # IEEE division
    corr = (frac * pow2_f32(a)) * pow2_f32(b)
    return param.to(torch.float32) + corr
