"""Fused optimizer steps in Triton: one kernel per tensor does dequantize -> fp32 update -> requantize.

Twin of :mod:`agoq.ref.optim` (same signatures, bit-identical results). One program owns ROWS
quantization groups of BLOCK elements of the flat tensor: it reads the 16-bit param (+ remainder or
fp32 master), the grad and the packed states once, does the update in fp32 registers and writes
everything back once, so the step moves 2 (param) + 1 (rho) + 2 (grad) + 2 x 1.0625 (m, v) bytes
per element in each direction for FlashAdamW instead of the 16 + 4 of an fp32 AdamW.

Numerics mirror the reference operation by operation: ``div_rn`` / ``sqrt_rn`` (correctly rounded),
no FMA contraction (``enable_fp_fusion=False``), power-of-two scalings built from exponent bits,
bf16 rounding done with integer arithmetic (the interpreter's fp32 -> bf16 cast truncates).
Limits (raise, never silently degrade): both quantized states of one tensor share a block size;
stochastic-rounding state formats are not fused; fp8 states quantize on GPU only in tests (the
interpreter's fp8 cast does not round ties to even, see agoq.kernels.quant).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from agoq.kernels import _launch
from agoq.kernels._pack import pack_plane as _pack_plane
from agoq.kernels._quant_math import USE_PTX, _round_half_away_i32
from agoq.kernels.quant import _encode_scale, _pow2_value, decode_block_values, saturate
from agoq.ref.master import MASTER_NS
from agoq.ref.optim import adamw_scalars, check_pair, lion_scalars, sgd_scalars
from agoq.ref.quant import QuantizedTensor

__all__ = [
    "adamw_step",
    "lion_step",
    "sgd_step",
    "fused_block",
    "step_tile",
    "adamw_scalar_args",
    "lion_scalar_args",
    "sgd_scalar_args",
]

# Launch shape: 512 elements per program on 2 warps (8 elements per thread). Chosen by
# `benchmarks/bench_optim.py --launch-sweep` on an H100 (2026-11-24, benchmarks/results/optim_sweep.json): best of
# 512..8192 elements x 2/4/8 warps for both FlashAdamW (10.6 vs 12.7 ms per 1e9 params at the old 2048 x 4)
# and FP8-moment AdamW (6.9 vs 7.9 ms); the step is latency-bound on the correctly rounded div/sqrt, so
# fewer live values per thread (more resident warps) win. Results do not depend on it (checked per shape).
ELEMS_PER_PROGRAM = 512
NUM_WARPS = 2
PLAIN_BLOCK = 128  # tile row width when no state is quantized
OPT_IDS = {"adamw": 0, "lion": 1, "sgd": 2}
MASTER_IDS = {"none": 0, "split": 1, "fp32": 2}
INT8_MASTER_N = MASTER_NS[torch.int8]  # 127: split24 remainder scale
NARROW_CONSTS = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}


# --------------------------------------------------------------------------------------------------
# scalar helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def _pow2(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even (NaN -> 0x7FC0 as PyTorch): the GPU's convert (RNE), or
    integer ops under the interpreter, whose fp32 -> bf16 cast truncates."""
    if USE_PTX:
        out = tl.where(x != x, 0x7FC0, x.to(tl.bfloat16).to(tl.uint16, bitcast=True))
    else:
        bits = x.to(tl.uint32, bitcast=True)
        out = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _narrow(x, OUT_KIND: tl.constexpr):
    """RNE cast of fp32 to the storage dtype: 0 fp32, 1 bf16, 2 fp16."""
    if OUT_KIND == 1:
        y = _bf16_rne(x)
    elif OUT_KIND == 2:
        y = x.to(tl.float16)
    else:
        y = x
    return y


@triton.jit
def _half_ulp_exp(narrow_f32, MANT: tl.constexpr, E_MIN: tl.constexpr):
    field = (narrow_f32.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.maximum(field - 127, E_MIN) - (MANT + 1)


@triton.jit
def _rho_exact(e, N: tl.constexpr):
    """round_half_away(e * N) of the exact product (agoq.ref.master.remainder_of), |e| <= 1, N = 2**K - 1.

    fl(e * N) can round onto a .5 tie the exact product lies below. N = 2**K - 1, so
    e * N = a - e with a = e * 2**K exact; y = fl(a - e) is the same rounded value, and Fast2Sum
    (|a| >= |e|) gives its exact error t = (a - y) - e, so e * N = y + t exactly. y's rounding to an integer
    is wrong only on a tie (|y| - |r| == -0.5, exact) whose true value is nearer zero (t of the other
    sign): then one step toward zero. A few fp32 ops, no FMA (the interpreter has no fused one)."""
    a = e * (N + 1)
    y = a - e
    t = (a - y) - e
    r = _round_half_away_i32(y)
    toward_zero = (tl.abs(y) - tl.abs(r).to(tl.float32) == -0.5) & (((t < 0) & (y > 0)) | ((t > 0) & (y < 0)))
    return r - tl.where(toward_zero, tl.where(y > 0, 1, -1), 0)


# --------------------------------------------------------------------------------------------------
# state load / store (one quantization group per tile row)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_state(
    codes_ptr, scales_ptr, lut_ptr, first_row, rows, local, elem_mask, row_ok,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    SCALE: tl.constexpr, PLANE0: tl.constexpr, PLANE1: tl.constexpr, FP8_DTYPE: tl.constexpr,
):  # fmt: skip
    """fp32 values of the tile; KIND -1 = plain fp32/bf16/fp16 storage (codes_ptr typed)."""
    if KIND == -1:
        y = tl.load(codes_ptr + first_row * BLOCK + local, mask=elem_mask, other=0.0).to(tl.float32)
    else:
        row_bytes: tl.constexpr = BLOCK * BITS // 8
        codes_ptr += first_row * row_bytes
        if SCALE == 2:
            s = _pow2_value(tl.load(scales_ptr + first_row + rows, mask=row_ok, other=127).to(tl.int32))
        else:
            s = tl.load(scales_ptr + first_row + rows, mask=row_ok, other=0.0).to(tl.float32)
        v = decode_block_values(codes_ptr, lut_ptr, rows, row_ok, KIND, BITS, BLOCK, ROWS, PLANE0, PLANE1, FP8_DTYPE)
        y = v * s[:, None]
        if KIND == 4:
            y = y * y
        y = tl.where(elem_mask, saturate(y, tl.float32), 0.0)  # as ref_dequantize (fp32 max, NaN kept)
    return y


@triton.jit
def _store_state(
    x, x_root, codes_ptr, scales_ptr, mids_ptr, first_row, rows, local, elem_mask, row_ok,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    SCALE: tl.constexpr, PLANE0: tl.constexpr, PLANE1: tl.constexpr, FP8_DTYPE: tl.constexpr,
    QMAX: tl.constexpr, PLAIN_KIND: tl.constexpr,
):  # fmt: skip
    """Quantize the fp32 tile exactly as agoq.ref.quant.ref_quantize and store codes + scales.
    ``x_root`` = sqrt_rn(x), read only by the sqrt-companded format (KIND 4; AdamW has it already)."""
    if KIND == -1:
        tl.store(codes_ptr + first_row * BLOCK + local, _narrow(x, PLAIN_KIND), mask=elem_mask)
    else:
        if KIND == 4:
            x = x_root
        x = tl.where(elem_mask, x, 0.0)  # the reference zero-pads the tail group
        # one integer max per group gives both the absmax and the non-finite flag: |x|'s bit patterns
        # order as its values, and every NaN pattern sorts above +inf (0x7F800000)
        amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        bad = amax_bits >= 0x7F800000
        stored, s = _encode_scale(tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), QMAX), SCALE)
        bad = bad | (s != s) | (s == float("inf"))
        inv = tl.where((s > 0) & (~bad), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
        p = tl.where(bad[:, None], 0.0, x * inv[:, None])
        if KIND == 1:
            code = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
            # binary search over the 15 midpoints: steps 8, 4, 2, 1 (a `name: tl.constexpr = ...`
            # inside static_range is a reassigned constexpr for Triton >= 3.6's front end)
            for level in tl.static_range(4):
                code += tl.where(p > tl.load(mids_ptr + code + ((8 >> level) - 1)), 8 >> level, 0)
        elif KIND == 2:
            code = tl.minimum(tl.maximum(p, -QMAX), QMAX).to(FP8_DTYPE).to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            # the reference clamps y to the code range after rounding; clamping first gives the same
            # integer, and the companded y are in range by construction (|2pc / (|pc| + 1)| <= 1 holds
            # after correct rounding, and [0, 1] * 255 <= 255), so only the linear int format clamps
            if KIND == 0:
                y = tl.minimum(tl.maximum(p, -QMAX), QMAX)
            elif KIND == 3:
                pc = tl.minimum(tl.maximum(p, -1.0), 1.0)
                y = tl.math.div_rn(pc * 2.0, tl.abs(pc) + 1.0) * 127.0
            else:
                y = tl.minimum(tl.maximum(p, 0.0), 1.0) * 255.0
            code = _round_half_away_i32(y) + (2 ** (BITS - 1) if KIND == 0 else (128 if KIND == 3 else 0))
        row_bytes: tl.constexpr = BLOCK * BITS // 8
        p0_bytes: tl.constexpr = BLOCK * PLANE0 // 8
        codes_ptr += first_row * row_bytes
        c0 = tl.arange(0, p0_bytes)
        packed0 = _pack_plane(code & ((1 << PLANE0) - 1), ROWS, BLOCK, PLANE0)
        tl.store(codes_ptr + rows[:, None] * row_bytes + c0[None, :], packed0, mask=row_ok[:, None])
        if PLANE1 > 0:
            p1_bytes: tl.constexpr = BLOCK * PLANE1 // 8
            c1 = tl.arange(0, p1_bytes)
            packed1 = _pack_plane((code >> PLANE0) & ((1 << PLANE1) - 1), ROWS, BLOCK, PLANE1)
            tl.store(codes_ptr + rows[:, None] * row_bytes + p0_bytes + c1[None, :], packed1, mask=row_ok[:, None])
        if SCALE == 2:
            stored = tl.where(bad, 255, stored).to(tl.uint8)
        else:
            stored = tl.where(bad, float("nan"), stored.to(tl.float32)).to(scales_ptr.dtype.element_ty)
        tl.store(scales_ptr + first_row + rows, stored, mask=row_ok)


# --------------------------------------------------------------------------------------------------
# the fused step
# --------------------------------------------------------------------------------------------------
@triton.jit
def _optim_step_kernel(
    param_ptr,  # bf16 / fp16 / fp32 model param, numel (updated in place)
    grad_ptr,  # any float dtype, numel
    master_ptr,  # int8 / int16 remainder (MASTER 1), fp32 master (MASTER 2), unused (MASTER 0)
    frac_ptr,  # fp32 [255]: rho / 127 for rho = -127..127 (int8 remainder; unused otherwise)
    s1_codes_ptr, s1_scales_ptr, s1_lut_ptr, s1_mids_ptr,  # state 1 (m / momentum): codes, scales, tables
    s2_codes_ptr, s2_scales_ptr, s2_lut_ptr, s2_mids_ptr,  # state 2 (v), AdamW only
    numel,  # int
    num_rows,  # int: ceil(numel / BLOCK)
    c0, c1, c2, c3, c4, c5, c6, c7,  # fp32 scalars, meaning per OPT (see _scalars())
    OPT: tl.constexpr,  # 0 adamw, 1 lion, 2 sgd
    MASTER: tl.constexpr,  # 0 none, 1 split (rho), 2 fp32 master
    MASTER_N: tl.constexpr,  # 127 / 32767
    PARAM_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16
    MANT: tl.constexpr, E_MIN: tl.constexpr,  # narrow param type: mantissa bits, min normal exponent
    HAS_S1: tl.constexpr, HAS_WD: tl.constexpr, NESTEROV: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    K1: tl.constexpr, B1: tl.constexpr, SC1: tl.constexpr, P01: tl.constexpr, P11: tl.constexpr,
    F81: tl.constexpr, Q1: tl.constexpr, PK1: tl.constexpr,
    K2: tl.constexpr, B2: tl.constexpr, SC2: tl.constexpr, P02: tl.constexpr, P12: tl.constexpr,
    F82: tl.constexpr, Q2: tl.constexpr, PK2: tl.constexpr,
):  # fmt: skip
    """One tensor; program i owns quantization groups [i*ROWS, (i+1)*ROWS)."""
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    elem_lim = tl.minimum(numel - first_row * BLOCK, ROWS * BLOCK).to(tl.int32)
    row_lim = tl.minimum(num_rows - first_row, ROWS).to(tl.int32)
    step_tile(
        param_ptr, grad_ptr, master_ptr, frac_ptr, s1_codes_ptr, s1_scales_ptr, s1_lut_ptr, s1_mids_ptr,
        s2_codes_ptr, s2_scales_ptr, s2_lut_ptr, s2_mids_ptr, first_row, elem_lim, row_lim,
        c0, c1, c2, c3, c4, c5, c6, c7, OPT, MASTER, MASTER_N, PARAM_KIND, MANT, E_MIN, HAS_S1, HAS_WD, NESTEROV,
        BLOCK, ROWS, K1, B1, SC1, P01, P11, F81, Q1, PK1, K2, B2, SC2, P02, P12, F82, Q2, PK2,
    )  # fmt: skip


@triton.jit
def step_tile(
    param_ptr, grad_ptr, master_ptr,  # pointers to the tensor's first element (param dtype, grad dtype, master)
    frac_ptr,  # fp32 table of rho / 127 (see _rho_fracs)
    s1_codes_ptr, s1_scales_ptr, s1_lut_ptr, s1_mids_ptr,
    s2_codes_ptr, s2_scales_ptr, s2_lut_ptr, s2_mids_ptr,
    first_row,  # int64: first quantization group (tile row) of this tile inside the tensor
    elem_lim,  # valid elements in the tile (ROWS * BLOCK for a full tile: a constexpr keeps loads vectorised)
    row_lim,  # valid rows (groups) in the tile
    c0, c1, c2, c3, c4, c5, c6, c7,
    OPT: tl.constexpr, MASTER: tl.constexpr, MASTER_N: tl.constexpr, PARAM_KIND: tl.constexpr,
    MANT: tl.constexpr, E_MIN: tl.constexpr, HAS_S1: tl.constexpr, HAS_WD: tl.constexpr, NESTEROV: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    K1: tl.constexpr, B1: tl.constexpr, SC1: tl.constexpr, P01: tl.constexpr, P11: tl.constexpr,
    F81: tl.constexpr, Q1: tl.constexpr, PK1: tl.constexpr,
    K2: tl.constexpr, B2: tl.constexpr, SC2: tl.constexpr, P02: tl.constexpr, P12: tl.constexpr,
    F82: tl.constexpr, Q2: tl.constexpr, PK2: tl.constexpr,
):  # fmt: skip
    """The fused update of one [ROWS, BLOCK] tile (shared by the per-tensor and multi-tensor kernels)."""
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    elem_base = first_row * BLOCK
    elem_mask = local < elem_lim
    row_ok = rows < row_lim
    offs = elem_base + local
    # -- load: grad, master value theta ------------------------------------------------------------
    g = tl.load(grad_ptr + offs, mask=elem_mask, other=0.0).to(tl.float32)
    pval = tl.load(param_ptr + offs, mask=elem_mask, other=0.0).to(tl.float32)
    if MASTER == 1:
        rho = tl.load(master_ptr + offs, mask=elem_mask, other=0).to(tl.int32)
        ell = _half_ulp_exp(pval, MANT, E_MIN)
        ea = ell >> 1  # floor(l / 2)
        if MASTER_N == 127:  # a 1 KiB cached table lookup instead of a correctly rounded division
            frac = tl.load(frac_ptr + (rho + 127))
        else:
            frac = tl.math.div_rn(rho.to(tl.float32), tl.full(rho.shape, MASTER_N, tl.float32))
        theta = pval + (frac * _pow2(ea)) * _pow2(ell - ea)
    elif MASTER == 2:
        theta = tl.load(master_ptr + offs, mask=elem_mask, other=0.0)
    else:
        theta = pval
    # -- update ------------------------------------------------------------------------------------
    if HAS_S1:
        m = _load_state(s1_codes_ptr, s1_scales_ptr, s1_lut_ptr, first_row, rows, local, elem_mask, row_ok,
                        K1, B1, BLOCK, ROWS, SC1, P01, P11, F81)  # fmt: skip
    if OPT == 0:  # AdamW: c0 b1, c1 1-b1, c2 b2, c3 1-b2, c4 eps scaled, c5 decay, c6 step size (see ref)
        v = _load_state(s2_codes_ptr, s2_scales_ptr, s2_lut_ptr, first_row, rows, local, elem_mask, row_ok,
                        K2, B2, BLOCK, ROWS, SC2, P02, P12, F82)  # fmt: skip
        m = m * c0 + g * c1
        v = v * c2 + (g * g) * c3
        theta = theta * c5
        v_root = tl.math.sqrt_rn(v)  # also the sqrt-companded store's input: one sqrt per element
        theta = theta - tl.math.div_rn(m, v_root + c4) * c6
        _store_state(v, v_root, s2_codes_ptr, s2_scales_ptr, s2_mids_ptr, first_row, rows, local, elem_mask,
                     row_ok, K2, B2, BLOCK, ROWS, SC2, P02, P12, F82, Q2, PK2)  # fmt: skip
    elif OPT == 1:  # Lion: c0 b1, c1 1-b1, c2 b2, c3 1-b2, c5 decay, c6 lr
        c = m * c0 + g * c1
        m = m * c2 + g * c3
        sgn = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, c))  # torch.sign: 0 -> 0, NaN -> NaN
        theta = theta * c5 - sgn * c6
    else:  # SGD: c0 momentum, c1 weight decay (coupled), c6 lr
        if HAS_WD:
            g = g + theta * c1
        if HAS_S1:
            m = m * c0 + g
            if NESTEROV:
                g = g + m * c0
            else:
                g = m
        theta = theta - g * c6
    if HAS_S1:
        _store_state(m, m, s1_codes_ptr, s1_scales_ptr, s1_mids_ptr, first_row, rows, local, elem_mask, row_ok,
                     K1, B1, BLOCK, ROWS, SC1, P01, P11, F81, Q1, PK1)  # fmt: skip
    # -- store: param (+ remainder / master) ---------------------------------------------------------
    narrow = _narrow(theta, PARAM_KIND)
    tl.store(param_ptr + offs, narrow, mask=elem_mask)
    if MASTER == 1:
        nf = narrow.to(tl.float32)
        ell = _half_ulp_exp(nf, MANT, E_MIN)
        ea = ell >> 1
        err_n = ((theta - nf) * _pow2(ea - ell)) * _pow2(-ea)
        r = _rho_exact(tl.minimum(tl.maximum(err_n, -1.0), 1.0), MASTER_N)
        finite = (tl.abs(theta) < float("inf")) & (tl.abs(nf) < float("inf"))
        tl.store(master_ptr + offs, tl.where(finite, r, 0).to(master_ptr.dtype.element_ty), mask=elem_mask)
    elif MASTER == 2:
        tl.store(master_ptr + offs, theta, mask=elem_mask)


# --------------------------------------------------------------------------------------------------
# launchers (signatures of agoq.ref.optim)
# --------------------------------------------------------------------------------------------------
_PLAIN_KINDS = {"fp32": 0, "bf16": 1, "fp16": 2}
_PARAM_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PLAIN_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fused_block(*states: QuantizedTensor | None) -> int:
    """The tile row width: the common block of the quantized states (PLAIN_BLOCK if none is)."""
    blocks = {q.fmt.block for q in states if q is not None and q.fmt.quantized}
    if len(blocks) > 1:
        raise NotImplementedError(
            f"the fused step needs one block size for all quantized states of a tensor, got {sorted(blocks)}; "
            "use e.g. cint8_b32 + cuint8_b32, or fused=False"
        )
    for q in states:
        if q is not None and q.fmt.rounding == "stochastic":
            raise NotImplementedError(f"state format {q.fmt.name!r}: stochastic rounding is not fused; use fused=False")
    return blocks.pop() if blocks else PLAIN_BLOCK


@functools.lru_cache(maxsize=16)
def _dummy(device: str) -> torch.Tensor:
    """One fp32 element per device for the pointer slots of an absent state (never read)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=16)
def _rho_fracs(device: str) -> torch.Tensor:
    """fp32 [255]: rho / 127 for rho = -127..127, each correctly rounded (an IEEE fp32 division, as
    agoq.ref.master's merge computes it), so the table lookup is bit-identical to the division."""
    rho = torch.arange(-INT8_MASTER_N, INT8_MASTER_N + 1, dtype=torch.float32)
    return (rho / torch.full_like(rho, INT8_MASTER_N)).to(device)


def frac_table(master: torch.Tensor | None, device) -> torch.Tensor:
    """The frac_ptr argument: the rho / 127 table for an int8 remainder, a dummy otherwise."""
    dev = str(device)
    return _rho_fracs(dev) if master is not None and master.dtype == torch.int8 else _dummy(dev)


@functools.lru_cache(maxsize=16)
def _nf4_mids(device: str) -> torch.Tensor:
    return _launch.nf4_midpoints_f32().to(device)


_ABSENT = dict(K=-1, B=1, SC=0, P0=8, P1=0, F8=tl.float8e4nv, Q=1.0, PK=0)


@functools.lru_cache(maxsize=256)
def _format_constexprs(fmt) -> dict:
    if not fmt.quantized:
        return {**_ABSENT, "PK": _PLAIN_KINDS[fmt.variant]}
    c = _launch.constexprs(fmt)
    return dict(K=c["KIND"], B=fmt.bits, SC=c["SCALE"], P0=c["PLANE0"], P1=c["PLANE1"], F8=c["FP8_DTYPE"],
                Q=c["QMAX"], PK=0)  # fmt: skip


def _state_args(q: QuantizedTensor | None, device) -> tuple[list, dict]:
    """(pointer args, constexprs) of one state; a dummy for an absent state. Tables and dummies are
    cached per device: the launcher's host time matters for the many small tensors of a model."""
    dev = str(device)
    if q is None:
        d = _dummy(dev)
        return [d, d, d, d], _ABSENT
    fmt = q.fmt
    if not fmt.quantized:
        d = _dummy(dev)
        return [q.codes.view(_PLAIN_TORCH[fmt.variant]), d, d, d], _format_constexprs(fmt)
    return [q.codes, q.scales, _launch.code_values(fmt, dev), _nf4_mids(dev)], _format_constexprs(fmt)


def _check_state(q: QuantizedTensor | None, numel: int) -> None:
    if q is not None and q.numel != numel:
        raise ValueError(f"state numel {q.numel} != param numel {numel}")


def _launch_step(opt, param, grad, master, s1, s2, scalars, *, has_wd=False, nesterov=False) -> None:
    check_pair(param, grad, master)
    numel = param.numel()
    for q in (s1, s2):
        _check_state(q, numel)
    if numel == 0:
        return
    block = fused_block(s1, s2)
    rows = max(1, ELEMS_PER_PROGRAM // block)
    num_rows = -(-numel // block)
    a1, k1 = _state_args(s1, param.device)
    a2, k2 = _state_args(s2, param.device)
    if master is None:
        master_kind, master_arg, n = "none", param, 1
    elif master.dtype == torch.float32:
        master_kind, master_arg, n = "fp32", master, 1
    else:
        master_kind, master_arg, n = "split", master, 127 if master.dtype == torch.int8 else 32767
    mant, e_min = NARROW_CONSTS[param.dtype]
    grad_flat = grad.reshape(-1)
    if not grad_flat.is_contiguous():
        grad_flat = grad_flat.contiguous()
    grid = (triton.cdiv(num_rows, rows),)
    _optim_step_kernel[grid](
        param, grad_flat, master_arg, frac_table(master, param.device), *a1, *a2, numel, num_rows, *scalars,
        OPT=OPT_IDS[opt], MASTER=MASTER_IDS[master_kind], MASTER_N=n, PARAM_KIND=_PARAM_KINDS[param.dtype],
        MANT=mant, E_MIN=e_min, HAS_S1=s1 is not None, HAS_WD=has_wd, NESTEROV=nesterov,
        BLOCK=block, ROWS=rows,
        K1=k1["K"], B1=k1["B"], SC1=k1["SC"], P01=k1["P0"], P11=k1["P1"], F81=k1["F8"], Q1=k1["Q"], PK1=k1["PK"],
        K2=k2["K"], B2=k2["B"], SC2=k2["SC"], P02=k2["P0"], P12=k2["P1"], F82=k2["F8"], Q2=k2["Q"], PK2=k2["PK"],
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip


def adamw_scalar_args(*, lr, beta1, beta2, eps, weight_decay, step) -> tuple:
    """The kernel's c0..c7 for AdamW (fp32-rounded once, agoq.ref.optim.adamw_scalars)."""
    s = adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    return (s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.eps_scaled, s.decay, s.step_size, 1.0)


def lion_scalar_args(*, lr, beta1, beta2, weight_decay) -> tuple:
    s = lion_scalars(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    return (s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2, 0.0, s.decay, s.lr, 1.0)


def sgd_scalar_args(*, lr, momentum, weight_decay) -> tuple:
    s = sgd_scalars(lr=lr, momentum=momentum, weight_decay=weight_decay)
    return (s.momentum, s.weight_decay, 0.0, 0.0, 0.0, 1.0, s.lr, 1.0)


def adamw_step(param, grad, master, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step) -> None:
    """Triton twin of agoq.ref.optim.ref_adamw_step."""
    scalars = adamw_scalar_args(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    _launch_step("adamw", param, grad, master, exp_avg, exp_avg_sq, scalars)


def lion_step(param, grad, master, exp_avg, *, lr, beta1, beta2, weight_decay) -> None:
    """Triton twin of agoq.ref.optim.ref_lion_step."""
    scalars = lion_scalar_args(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    _launch_step("lion", param, grad, master, exp_avg, None, scalars)


def sgd_step(param, grad, master, momentum_buffer, *, lr, momentum, weight_decay, nesterov) -> None:
    """Triton twin of agoq.ref.optim.ref_sgd_step."""
    if (momentum_buffer is None) != (momentum == 0.0):
        raise ValueError("pass a momentum_buffer exactly when momentum != 0")
    scalars = sgd_scalar_args(lr=lr, momentum=momentum, weight_decay=weight_decay)
    _launch_step("sgd", param, grad, master, momentum_buffer, None, scalars,
                 has_wd=weight_decay != 0.0, nesterov=nesterov)  # fmt: skip
