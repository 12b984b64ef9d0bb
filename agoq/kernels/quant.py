"""Triton block quantize / dequantize with the signatures and codes of agoq.ref.quant.

One program handles ROWS consecutive blocks. Quantize reads the input once and does absmax, scale,
code and bit-plane packing in registers; dequantize reads codes + scales and writes the output
dtype directly. All arithmetic mirrors agoq.ref.quant step for step: divisions and sqrt are the
correctly rounded ``div_rn`` / ``sqrt_rn``, and kernels are compiled with ``enable_fp_fusion=False``
so no multiply-add is contracted into an FMA (which would change rounding and hence codes).

Interpreter note (TRITON_INTERPRET=1, Triton 3.8): the fp32 -> fp8 cast of the interpreter does not
round ties to even, so fp8 *quantize* is checked on GPU only; everything else runs there.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from agoq.formats import QuantFormat, parse_format, uses_bytes_kernel
from agoq.kernels import _launch
from agoq.kernels._quant_math import _encode_scale, _pow2_value, gather_nc, saturate  # noqa: F401 (optim imports the first two)
from agoq.kernels._quant_tile import _quantize_fwd_kernel
from agoq.kernels.fastlaunch import FastKernel, LaunchSite
from agoq.ref.quant import QuantizedTensor, check_input, ref_dequantize, ref_quantize

__all__ = ["quantize", "dequantize", "quantize_with_config"]


@triton.jit
def _unpack_plane(byte, ROWS: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """Inverse of _pack_plane: [ROWS, BLOCK*WIDTH//8] bytes (int32) -> [ROWS, BLOCK] codes."""
    if WIDTH == 8:
        out = byte
    elif WIDTH == 4:
        out = tl.reshape(tl.join(byte & 15, byte >> 4), [ROWS, BLOCK])
    elif WIDTH == 2:
        q0 = tl.join(byte & 3, (byte >> 4) & 3)  # codes 0 and 2 of the byte (j = 0)
        q1 = tl.join((byte >> 2) & 3, (byte >> 6) & 3)  # codes 1 and 3 (j = 1)
        out = tl.reshape(tl.join(q0, q1), [ROWS, BLOCK])
    else:
        a00 = tl.join(byte & 1, (byte >> 4) & 1)  # bits (i, j, k) = 4i + 2j + k, joined i first
        a01 = tl.join((byte >> 1) & 1, (byte >> 5) & 1)
        a10 = tl.join((byte >> 2) & 1, (byte >> 6) & 1)
        a11 = tl.join((byte >> 3) & 1, (byte >> 7) & 1)
        out = tl.reshape(tl.join(tl.join(a00, a10), tl.join(a01, a11)), [ROWS, BLOCK])
    return out


@triton.jit
def quantize_tile_bytes(x, KIND: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr, FP8_DTYPE: tl.constexpr):
    """(uint8 codes [ROWS, BLOCK], stored scales [ROWS]) of an fp32 tile of ROWS blocks, one-byte codes
    (KIND 0: int8 round half away from zero; KIND 2: fp8), agoq.ref.quant's math step for step. The
    stored scales are fp32 values (SCALE 0 / 1; the caller casts to the storage dtype) or pow2 bytes."""
    xa = tl.abs(x)
    bad = tl.max(((xa != xa) | (xa == float("inf"))).to(tl.int32), axis=1) > 0
    stored, s = _encode_scale(tl.math.div_rn(tl.max(xa, axis=1), QMAX), SCALE)
    bad = bad | (s != s) | (s == float("inf"))
    inv = tl.where((s > 0) & (~bad), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
    p = tl.where(bad[:, None], 0.0, x * inv[:, None])
    if KIND == 0:
        a = tl.abs(p)  # round half away from zero: floor(|p|) + (frac >= 0.5), sign restored
        f = tl.floor(a)
        r = f + tl.where(a - f >= 0.5, 1.0, 0.0)
        r = tl.minimum(tl.maximum(tl.where(p < 0, -r, r), -QMAX), QMAX)
        code = (r.to(tl.int32) + 128).to(tl.uint8)
    else:
        y = tl.minimum(tl.maximum(p, -QMAX), QMAX)
        code = y.to(FP8_DTYPE).to(tl.uint8, bitcast=True)
    if SCALE == 2:
        stored = tl.where(bad, 255, stored).to(tl.uint8)
    else:
        stored = tl.where(bad, float("nan"), stored.to(tl.float32))
    return code, stored


@triton.jit
def decode_tile_bytes(code_u8, KIND: tl.constexpr, FP8_DTYPE: tl.constexpr):
    """fp32 code values (before the block scale) of one-byte codes (KIND 0 int8, 2 fp8)."""
    if KIND == 0:
        v = (code_u8.to(tl.int32) - 128).to(tl.float32)
    else:
        v = code_u8.to(FP8_DTYPE, bitcast=True).to(tl.float32)
    return v


@triton.jit
def load_scale_f32(ptrs, mask, SCALE: tl.constexpr):
    """fp32 value of stored scales (pow2: biased exponent byte; a masked lane reads a harmless 1.0)."""
    if SCALE == 2:
        s = _pow2_value(tl.load(ptrs, mask=mask, other=127).to(tl.int32))
    else:
        s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def _quantize_bytes_kernel(
    x_ptr, codes_ptr, scales_ptr, numel, num_blocks,  # as _quantize_fwd_kernel
    KIND: tl.constexpr,  # 0 int (8-bit, round to nearest) or 2 fp8: one whole byte per code
    BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr, QMAX: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
):  # fmt: skip
    """One-byte codes (int8 nearest, fp8) on a [ROWS, BLOCK] tile: nothing to pack, and this 2-D
    layout measured faster for them than the [ROWS, G, SUB] kernel (docs/benchmarks/quant.md)."""
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    elem_base = first_row * BLOCK
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    elems_left = tl.minimum(numel - elem_base, ROWS * BLOCK).to(tl.int32)
    x = tl.load(x_ptr + elem_base + local, mask=local < elems_left, other=0.0).to(tl.float32)
    code, stored = quantize_tile_bytes(x, KIND, SCALE, QMAX, FP8_DTYPE)
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    codes_ptr += first_row * BLOCK
    tl.store(codes_ptr + local, code, mask=row_ok[:, None])
    scales_ptr += first_row
    tl.store(scales_ptr + rows, stored.to(scales_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def decode_block_values(
    codes_ptr, values_ptr, rows, row_ok,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    PLANE0: tl.constexpr, PLANE1: tl.constexpr, FP8_DTYPE: tl.constexpr,
):  # fmt: skip
    """[ROWS, BLOCK] fp32 code values (before the block scale) of the rows at ``codes_ptr``.

    Shared by dequantize and the fused optimizer step (agoq/kernels/optim.py). ``values_ptr`` is the
    per-code value table for nf / cint / cuint (agoq.ref.quant.ref_code_values; 16 or 256 entries)."""
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    p0_bytes: tl.constexpr = BLOCK * PLANE0 // 8
    c0 = tl.arange(0, p0_bytes)
    b0 = tl.load(codes_ptr + rows[:, None] * row_bytes + c0[None, :], mask=row_ok[:, None], other=0)
    code = _unpack_plane(b0.to(tl.int32), ROWS, BLOCK, PLANE0)
    if PLANE1 > 0:
        p1_bytes: tl.constexpr = BLOCK * PLANE1 // 8
        c1 = tl.arange(0, p1_bytes)
        b1 = tl.load(codes_ptr + rows[:, None] * row_bytes + p0_bytes + c1[None, :], mask=row_ok[:, None], other=0)
        code = code | (_unpack_plane(b1.to(tl.int32), ROWS, BLOCK, PLANE1) << PLANE0)
    if KIND == 0:
        v = (code - 2 ** (BITS - 1)).to(tl.float32)
    elif KIND == 2:
        v = code.to(tl.uint8).to(FP8_DTYPE, bitcast=True).to(tl.float32)
    else:
        v = gather_nc(values_ptr, code)  # inline PTX on GPU: keeps the tile's layout (see gather_nc)
    return v


@triton.jit
def _dequantize_fwd_kernel(
    codes_ptr,  # uint8 packed codes, num_blocks * BLOCK * BITS // 8
    scales_ptr,  # fp32 / fp16 / uint8 (pow2), num_blocks
    out_ptr,  # out: bf16/fp16/fp32, numel elements
    values_ptr,  # fp32 value of every code (nf, cint, cuint lookup table; agoq.ref.ref_code_values)
    numel,  # int: number of valid output elements
    num_blocks,  # int
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,  # unused (same constexpr table as quantize)
    QMAX: tl.constexpr,  # unused
    PLANE0: tl.constexpr,
    PLANE1: tl.constexpr,
    FP8_DTYPE: tl.constexpr,
):
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    rows = tl.arange(0, ROWS)
    row_ok = rows < tl.minimum(num_blocks - first_row, ROWS).to(tl.int32)
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    codes_ptr += first_row * row_bytes
    scales_ptr += first_row
    # -- scales ----------------------------------------------------------------------------------
    if SCALE == 2:
        s = _pow2_value(tl.load(scales_ptr + rows, mask=row_ok, other=127).to(tl.int32))
    else:
        s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    # -- unpack codes, map to values ------------------------------------------------------------
    v = decode_block_values(codes_ptr, values_ptr, rows, row_ok, KIND, BITS, BLOCK, ROWS, PLANE0, PLANE1, FP8_DTYPE)
    y = v * s[:, None]
    if KIND == 4:
        y = y * y
    elem_base = first_row * BLOCK
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    elems_left = tl.minimum(numel - elem_base, ROWS * BLOCK).to(tl.int32)
    y = saturate(y, out_ptr.dtype.element_ty)  # finite codes never dequantize to Inf (agoq.ref.quant.saturate)
    tl.store(out_ptr + elem_base + local, y.to(out_ptr.dtype.element_ty), mask=local < elems_left)


def quantize(x: torch.Tensor, fmt: QuantFormat | str, *, seed: int | None = None) -> QuantizedTensor:
    """Triton twin of agoq.ref.quant.ref_quantize (identical codes and scales)."""
    if seed is None and x.is_cuda:  # the saved-activation hot path: one site per (format, size, dtype, device)
        site = _QUANT_SITES.get((fmt, x.numel(), x.dtype, x.device.index))
        if site is not None and x.is_contiguous():
            return site.run(x)
    fmt = parse_format(fmt)
    return quantize_with_config(x, fmt, _launch.quant_config(fmt), seed=seed)


def quantize_with_config(
    x: torch.Tensor, fmt: QuantFormat | str, config: _launch.QuantConfig, *, seed: int | None = None
) -> QuantizedTensor:
    """quantize with an explicit launch config (benchmarks/bench_quant.py --variants); codes never depend
    on the config, only speed does."""
    fmt = parse_format(fmt)
    check_input(x, fmt, seed)
    if not fmt.quantized or x.numel() == 0:
        return ref_quantize(x, fmt, seed=seed)  # a plain cast (or nothing): no kernel needed
    x_flat = x.detach()  # the kernel reads the flat memory: no reshape needed when contiguous
    if not x_flat.is_contiguous():
        x_flat = x_flat.contiguous()
    site = _QuantSite(fmt, config, x_flat.numel(), x.dtype, x.device, seed)
    if seed is None and x.is_cuda and config == _launch.quant_config(fmt):
        # later calls skip all of the above
        _launch.remember_site(_QUANT_SITES, (fmt, site.numel, x.dtype, x.device.index), site)
    return site.run(x_flat)


# (QuantFormat, numel, dtype, CUDA index) -> _QuantSite, default launch config; at most _launch.MAX_LAUNCH_SITES
_QUANT_SITES: dict = {}


class _QuantSite:
    """Everything a quantize launch needs that depends only on (format, config, numel, dtype, device,
    seed), computed once: sizes, grid, constexprs and the LaunchSite that skips Triton's dispatch."""

    __slots__ = ("fmt", "numel", "device", "code_bytes", "num_blocks", "scale_dtype", "launch", "tail")

    def __init__(self, fmt: QuantFormat, config, numel: int, dtype: torch.dtype, device: torch.device,
                 seed: int | None):
        launch, self.scale_dtype, consts = _quantize_plan(fmt, config)
        self.fmt, self.numel, self.device = fmt, numel, device
        self.num_blocks = fmt.num_blocks(numel)
        self.code_bytes = fmt.code_bytes(numel)
        self.launch = LaunchSite(launch, (triton.cdiv(self.num_blocks, consts[0]),))
        if uses_bytes_kernel(fmt):
            self.tail = (numel, self.num_blocks, *consts[1:])
        else:  # the NF4 table is a tensor argument ahead of the sizes
            self.tail = (_launch.nf4_lut(str(device)), numel, self.num_blocks, _launch.seed_mix(seed), *consts[1:])

    def run(self, x_flat: torch.Tensor) -> QuantizedTensor:
        """Quantize a contiguous ``x_flat`` of this site's numel / dtype / device."""
        codes_u8 = torch.empty(self.code_bytes, dtype=torch.uint8, device=self.device)
        scales = torch.empty(self.num_blocks, dtype=self.scale_dtype, device=self.device)
        self.launch(x_flat.detach(), codes_u8, scales, *self.tail)
        return QuantizedTensor(codes_u8, scales, self.fmt, x_flat.shape, x_flat.dtype)


@functools.lru_cache(maxsize=256)
def _quantize_plan(fmt: QuantFormat, config: _launch.QuantConfig) -> tuple:
    """(launcher, scale dtype, (ROWS, constexprs in signature order)) of quantize for one format and
    launch config: built once, so a launch costs no per-call dict or format work."""
    rows = _launch.rows_for(fmt, config.elems_per_program)
    ce = _launch.constexprs(fmt)
    if uses_bytes_kernel(fmt):
        launch = _fast(_quantize_bytes_kernel, config.num_warps)
        consts = (rows, ce["KIND"], fmt.block, rows, ce["SCALE"], ce["QMAX"], ce["FP8_DTYPE"])
    else:
        launch = _fast(_quantize_fwd_kernel, config.num_warps)
        consts = (rows, ce["KIND"], ce["BITS"], ce["BLOCK"], rows, ce["SCALE"], ce["STOCHASTIC"], ce["QMAX"],
                  ce["PLANE0"], ce["PLANE1"], ce["FP8_DTYPE"], _launch.SUB_ELEMS, _launch.split_for(fmt, config))
    return launch, _launch.TORCH_SCALE_DTYPES[fmt.scale], consts


@functools.lru_cache(maxsize=64)
def _fast(kernel, num_warps: int) -> FastKernel:
    """One cached direct launcher per (kernel, num_warps); all quant kernels run without FMA contraction."""
    return FastKernel(kernel, num_warps=num_warps, enable_fp_fusion=False)


@functools.lru_cache(maxsize=256)
def _dequantize_plan(fmt: QuantFormat) -> tuple:
    rows = _launch.rows_for(fmt, _launch.DEQUANT_ELEMS_PER_PROGRAM)
    ce = _launch.constexprs(fmt)
    consts = (ce["KIND"], ce["BITS"], ce["BLOCK"], rows, ce["SCALE"], ce["STOCHASTIC"], ce["QMAX"], ce["PLANE0"],
              ce["PLANE1"], ce["FP8_DTYPE"])
    return _fast(_dequantize_fwd_kernel, _launch.DEQUANT_NUM_WARPS), rows, consts


def dequantize(q: QuantizedTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton twin of agoq.ref.quant.ref_dequantize."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    codes = q.codes
    key = (q.fmt, q.shape, out_dtype, codes.device.index) if codes.is_cuda else None
    site = _DEQUANT_SITES.get(key) if key is not None else None
    if site is None:
        fmt = q.fmt
        numel = q.numel
        if not fmt.quantized or numel == 0 or out_dtype not in _launch.TL_OUT_DTYPES:
            return ref_dequantize(q, out_dtype)  # plain cast, empty, or the reference's dtype error
        site = _DequantSite(fmt, numel, codes.device)
        if key is not None:
            _launch.remember_site(_DEQUANT_SITES, key, site)
    return site.run(q, out_dtype)


_DEQUANT_SITES: dict = {}  # (QuantFormat, shape, out dtype, CUDA index) -> _DequantSite; bounded as _QUANT_SITES


class _DequantSite:
    """A dequantize launch's fixed part for one (format, numel, device): grid, value table, constexprs."""

    __slots__ = ("device", "launch", "values", "tail")

    def __init__(self, fmt: QuantFormat, numel: int, device: torch.device):
        launch, rows, consts = _dequantize_plan(fmt)
        num_blocks = fmt.num_blocks(numel)
        self.device = device
        self.launch = LaunchSite(launch, (triton.cdiv(num_blocks, rows),))
        self.values = _launch.code_values(fmt, str(device))
        self.tail = (numel, num_blocks, *consts)

    def run(self, q: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=out_dtype, device=self.device)
        self.launch(q.codes, q.scales, out, self.values, *self.tail)
        return out
