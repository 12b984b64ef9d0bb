"""SQNR helpers and the per-format round-trip SQNR floors (dB), each with the reason for its number.

Floors are *lower bounds* that a correct quantizer must clear on the test distributions below; they
are derived from an error model where one exists (and checked against measurements), never copied
from a measurement without a stated margin. See docs/numerics.md.

Test distributions (``make_test_data``):
  gaussian      N(0, 1) i.i.d.
  heavy_tailed  N(0, 1) with a fraction HEAVY_TAIL_FRACTION of elements multiplied by
                HEAVY_TAIL_FACTOR ("1e3x outliers", as real gradients).
cuint formats store non-negative second moments, so they are tested on |data|.
"""

from __future__ import annotations

import math

import torch

from agoq.formats import QuantFormat

HEAVY_TAIL_FACTOR = 1e3  # "heavy-tailed with 1e3x outliers", as real gradients
HEAVY_TAIL_FRACTION = 1e-3  # one outlier per 1000 elements: most 256-blocks hold none, some one
FLOOR_MARGIN_DB = 1.0  # slack for sampling noise of a 2**16..2**18-element estimate (std << 0.5 dB)
POW2_SCALE_PENALTY_DB = 20 * math.log10(2)  # pow2 scale <= 2x the ideal one: step 2x, noise 4x
SR_PENALTY_DB = 10 * math.log10(2)  # SR error var f(1-f)*step^2 averages step^2/6, vs step^2/12
MEAN_ABS_GAUSSIAN = math.sqrt(2 / math.pi)  # E|z| for z ~ N(0, 1)


def _uniform_model_db(qmax: float, absmax_sigmas: float = 4.0) -> float:
    """SQNR of a uniform quantizer with step absmax/qmax on N(0,1): 12 qmax^2 / absmax^2.

    absmax_sigmas=4: a block of <= 256 Gaussian samples has E[absmax] ~ 2.9 sigma and exceeds 4 sigma
    with probability < 1.7 %, so using 4 sigma for every block under-estimates the SQNR.
    """
    return 10 * math.log10(12 * qmax**2 / absmax_sigmas**2)


# (kind, bits) -> (floor dB on Gaussian data, nearest rounding, fp32/fp16 scales, block 32..256, reason)
GAUSSIAN_FLOORS_DB: dict[tuple[str, int], tuple[float, str]] = {
    ("int", 8): (40.0, f"uniform model qmax=127, absmax<=4 sigma: {_uniform_model_db(127):.1f} dB"),
    ("int", 6): (28.0, f"uniform model qmax=31: {_uniform_model_db(31):.1f} dB"),
    ("int", 5): (22.0, f"uniform model qmax=15: {_uniform_model_db(15):.1f} dB"),
    ("int", 4): (15.0, f"uniform model qmax=7: {_uniform_model_db(7):.1f} dB"),
    ("int", 3): (8.0, f"uniform model qmax=3: {_uniform_model_db(3):.1f} dB"),
    ("int", 2): (
        0.5,
        "3 levels {-a, 0, a}: the uniform model does not apply; measured 1.9 dB at block 256 and "
        "3.6 dB at block 32 (2**18 samples, CPU, 2026-05); floor = worst measured - 1.4 dB",
    ),
    ("nf", 4): (
        19.0,
        "NF4 is information-theoretically tuned to N(0,1) (QLoRA); its outer step (0.28 absmax) is "
        "coarser than int4's, so no closed form: measured 20.1 dB at block 256, 21.2 at 32; -1.1 dB",
    ),
    ("fp8", 8): (0.0, "see FP8_FLOORS_DB (depends on the variant)"),
    ("cint", 8): (
        34.0,
        "softsign: dx/dz = 2/(2-|z|)^2 <= 2, so the x-step is at most 2/127 absmax: uniform model "
        f"with qmax=63.5 gives {_uniform_model_db(63.5):.1f} dB (measured ~44.6 dB: Gaussian mass "
        "sits where the step is 1/254)",
    ),
    ("cuint", 8): (
        44.0,
        "on |N(0,1)|: uniform step absmax_r/255 in r = sqrt(x); absmax_r^2 / E[r^2] = absmax/E|x| "
        "<= 4/0.8 = 5 gives 10 log10(12*255^2/5) = 52.0 dB in r, and v = r^2 doubles the relative "
        "error (-6.0 dB): 46.0 dB; floor -2 dB for the 4-sigma assumption on a half-normal",
    ),
}

# variant -> floor: a normal fp8 value in [2^e, 2^(e+1)) has step 2^(e-m) for m mantissa bits, so
# relative noise power <= 2^(-2m)/12: SQNR >= 10 log10(12 * 4^m); minus ~0.9 dB for the subnormal band.
FP8_FLOORS_DB = {
    "e4m3": (28.0, f"3 mantissa bits: 10 log10(12*4^3) = {10 * math.log10(12 * 4**3):.1f} dB"),
    "e5m2": (22.0, f"2 mantissa bits: 10 log10(12*4^2) = {10 * math.log10(12 * 4**2):.1f} dB"),
}


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(sum ref^2 / sum (ref - approx)^2) in float64 (torchao's compute_error); inf if equal."""
    ref64, approx64 = ref.detach().double().reshape(-1), approx.detach().double().reshape(-1)
    noise = (ref64 - approx64).pow(2).sum().item()
    signal = ref64.pow(2).sum().item()
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def gaussian_floor_db(fmt: QuantFormat) -> float:
    """Round-trip SQNR floor on N(0, 1) data (|N(0,1)| for cuint), with scale/rounding penalties."""
    if not fmt.quantized:
        return math.inf
    base = FP8_FLOORS_DB[fmt.variant][0] if fmt.kind == "fp8" else GAUSSIAN_FLOORS_DB[(fmt.kind, fmt.bits)][0]
    if fmt.scale == "pow2":
        base -= POW2_SCALE_PENALTY_DB
    if fmt.rounding == "stochastic":
        base -= SR_PENALTY_DB
    return base


def heavy_tailed_floor_db(fmt: QuantFormat) -> float:
    """Round-trip SQNR floor on the heavy_tailed distribution.

    Signal per element >= rho*A^2 (rho = outlier fraction, A = outlier factor). At most rho*B of
    the elements share a block with an outlier; with nearest rounding onto a grid containing 0 each
    has error <= |x| (so <= 1 in expectation), giving a term B/A^2 (c=3 for cuint: squaring after
    rounding in sqrt space can triple it). With stochastic rounding the error of such an element is
    f(1-f) step^2 <= |x| step, step ~ E|A z| / qmax_eff: term E|z|^2 B / (A qmax_eff). All other
    blocks keep the Gaussian floor's relative error. SQNR >= -10 log10(term + 10^(-G/10)) - margin.
    """
    if not fmt.quantized:
        return math.inf
    gauss = gaussian_floor_db(fmt)
    block, amp = fmt.block, HEAVY_TAIL_FACTOR
    if fmt.rounding == "nearest":
        term = (3.0 if fmt.kind == "cuint" else 1.0) * block / amp**2
    elif fmt.kind in ("int", "cint"):
        qmax_eff = fmt.qmax if fmt.kind == "int" else 254.0  # softsign slope 2 at 0 halves the step
        term = MEAN_ABS_GAUSSIAN**2 * block / (amp * qmax_eff)
    else:
        raise NotImplementedError(f"no heavy-tailed floor derived for {fmt.name}; test it on gaussian data")
    return -10 * math.log10(term + 10 ** (-gauss / 10)) - FLOOR_MARGIN_DB


def make_test_data(
    dist: str, numel: int, *, seed: int = 0, dtype=torch.float32, device="cpu"
) -> torch.Tensor:
    """Deterministic test data of one of the distributions above (generated in fp32 on CPU)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    if dist == "heavy_tailed":
        num_outliers = max(1, round(numel * HEAVY_TAIL_FRACTION))
        idx = torch.randperm(numel, generator=gen)[:num_outliers]
        x[idx] *= HEAVY_TAIL_FACTOR
    elif dist != "gaussian":
        raise ValueError(f"unknown distribution {dist!r}; use 'gaussian' or 'heavy_tailed'")
    return x.to(dtype=dtype, device=device)


def assert_sqnr_at_least(ref: torch.Tensor, approx: torch.Tensor, floor_db: float, what: str = "") -> float:
    """Raise AssertionError (test helper) if SQNR(ref, approx) < floor_db; returns the SQNR."""
    value = sqnr_db(ref, approx)
    if not value >= floor_db:
        raise AssertionError(f"{what}: SQNR {value:.2f} dB below floor {floor_db:.2f} dB")
    return value


def cuint_boundary_inputs(block: int = 32, ulps: int = 3, lead_one: bool = True) -> torch.Tensor:
    """fp32 second moments v whose sqrt lies within ``ulps / 2`` fp32 ulps of a cuint8 code boundary
    (k + 1/2) / 255 (k = 0..254): at scale 1 a 1-ulp error of sqrt moves their code, so they check that a
    sqrt is correctly rounded (PyTorch's CPU fp32 sqrt is not). v = the 2 * ulps + 1 fp32
    neighbours of ((k + 1/2) / 255)**2. With ``lead_one`` every block of ``block`` elements starts with
    1.0, so its scale is exactly 1 (fp32, fp16 and pow2 alike) and the codes see sqrt(v) unscaled;
    without it each block's scale is the (correctly rounded) sqrt of one of these v."""
    centre = ((torch.arange(255, dtype=torch.float64) + 0.5) / 255) ** 2
    bits = centre.to(torch.float32).view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    v = bits.reshape(-1).view(torch.float32)
    if not lead_one:
        return v
    per_block = block - 1
    v = torch.cat([v, torch.full((-v.numel() % per_block,), 0.25)]).view(-1, per_block)
    return torch.cat([torch.ones(v.shape[0], 1), v], dim=1).reshape(-1)


def split_tie_inputs(narrow_dtype: torch.dtype, n: int, lo_exp: int, hi_exp: int, count: int = 4096,
                     ulps: int = 2, seed: int = 0) -> torch.Tensor:  # fmt: skip
    """fp32 masters theta in +-[2**lo_exp, 2**hi_exp) whose scaled remainder e * N (agoq.ref.master: e =
    (theta - theta') / 2**l) lies within ``ulps`` fp32 ulps of a .5 tie, where an fp32 rounding of the
    product decides rho. From ``count`` random theta: the tie k + 1/2 below each one's e * N,
    mapped back to theta' + (k + 1/2) / N * 2**l in fp64, and its 2 * ulps + 1 fp32 neighbours."""
    from agoq.ref.master import half_ulp_exponent  # agoq.testing may import the reference

    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    theta = (2.0 ** (lo_exp + u * (hi_exp - lo_exp))).to(torch.float32)
    narrow = theta.to(narrow_dtype)
    half_ulp = 2.0 ** half_ulp_exponent(narrow).to(torch.float64)
    nf = narrow.to(torch.float64)
    k = torch.floor((theta.to(torch.float64) - nf) / half_ulp * n)
    tie = (nf + (k + 0.5) / n * half_ulp).to(torch.float32)
    bits = tie.view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    out = bits.reshape(-1).view(torch.float32)
    out = out[(out.abs() >= 2.0**lo_exp) & (out.abs() < 2.0**hi_exp)]
    return torch.cat([out, -out])
