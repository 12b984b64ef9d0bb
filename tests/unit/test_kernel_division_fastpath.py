"""The FCHK-free division of agoq.kernels.quant._div_unit (cint's softsign on GPU), checked in exact
rational arithmetic: for den = 1 + |pc| and num = 2 pc (pc an fp32 in [-1, 1]), the CUDA fast-path
sequence (reciprocal estimate y0, one Newton step, quotient, residual, corrected quotient; every FMA
rounded once) returns the correctly rounded num / den for any estimate y0 within one ulp of 1 / den
(the error bound of rcp.approx.f32). The GPU tests then compare the kernel with agoq.ref bit for bit."""

import random
from fractions import Fraction

import numpy as np
import pytest


def _rn32(x: Fraction) -> Fraction:
    """Round a rational to the nearest fp32 (ties to even), subnormals included."""
    if x == 0:
        return Fraction(0)
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)
    m = a / Fraction(2) ** (e - 23)
    q, r = divmod(m.numerator, m.denominator)
    rem = Fraction(r, m.denominator)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and q % 2 == 1):
        q += 1
    return sign * q * Fraction(2) ** (e - 23)


def _f32(v: float) -> Fraction:
    return Fraction(float(np.float32(v)))


def _step(v: Fraction, toward: float) -> Fraction:
    return Fraction(float(np.nextafter(np.float32(float(v)), np.float32(toward))))


def _fast_div(num: Fraction, den: Fraction, y0: Fraction) -> Fraction:
    y1 = _rn32(y0 * _rn32(-den * y0 + 1) + y0)
    q0 = _rn32(num * y1)
    return _rn32(y1 * _rn32(-den * q0 + num) + q0)


@pytest.mark.parametrize("seed", [0, 1])
def test_softsign_division_fast_path_is_correctly_rounded(seed):
    rng = random.Random(seed)
    pcs = [rng.uniform(-1, 1) for _ in range(1500)] + [rng.uniform(-1e-3, 1e-3) for _ in range(300)]
    pcs += [1.0, -1.0, 0.5, 2.0**-23, -(2.0**-24), 2.0**-30, 1 - 2.0**-24, 2.0**-149, 0.0]
    for pc in pcs:
        pc = _f32(pc)
        num, den = 2 * pc, _rn32(1 + abs(pc))
        exact = _rn32(num / den)
        r = _rn32(1 / den)
        for y0 in (r, _step(r, 0.0), _step(r, 4.0)):
            assert _fast_div(num, den, y0) == exact, (float(pc), float(y0))
