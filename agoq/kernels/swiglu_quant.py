"""SwiGLU fused with the quantize / dequantize of its saved input (the fc1 output), Triton.

Twins of :mod:`agoq.ref.swiglu_quant` (same signatures)::

  swiglu_quantize(fc1_out [T.., 2F], fmt) -> (z [T.., F], QuantizedTensor of fc1_out)
  dequant_swiglu_fwd(q, s=None) -> z_hat [T.., F]                 = swiglu_fwd(dequantize(q), s)
  dequant_swiglu_bwd(q, grad_z, s=None) -> grad_fc1_out [T.., 2F] = swiglu_bwd(dequantize(q), grad_z, s)

Why: on the saved-activation path the SwiGLU forward was silu + mul (two ATen launches) plus a
quantize launch, and its backward a dequantize, the recompute for fc2 and the SwiGLU backward (three
launches and a dequantized [T, 2F] tensor held between them). Here the forward is one launch and the
backward two, reading the packed codes directly; the host pays one launch where it paid two or three
(docs/benchmarks/log.md, "Host cost").

Numerics (tests/kernels/test_swiglu_quant_kernels.py, tests/gpu/test_saved_act_gpu.py):
- codes and scales of ``swiglu_quantize`` are the reference's bit for bit (agoq.ref.quant step for
  step, as the quantize kernel: same jit helpers, compiled without FMA contraction);
- z of ``swiglu_quantize`` is Megatron's unfused ``silu(gate) * up`` as ATen computes it in the
  tensor's dtype: silu = x / (1 + exp(-x)) in fp32 with the accurate ``expf`` (libdevice, as ATen's
  ``::exp``) and a correctly rounded division, rounded to the dtype, times up in fp32, rounded again.
  So the agoq forward keeps Megatron's values (GPU test: bitwise). The CPU interpreter uses numpy's exp
  and truncates fp32 -> bf16 casts: within 2 ulp there;
- the backward kernels dequantize each element exactly as ``dequantize`` (value * scale in fp32,
  rounded to the saved dtype) and then run the expressions of agoq.kernels.swiglu on it, so they give
  what dequantize followed by swiglu_fwd / swiglu_bwd gives (one output ulp of the references).

Layout: fc1_out = [gate | up] per row, quantized as the flat tensor in blocks of ``fmt.block``. With
F % block == 0 no block straddles the two halves or two rows, so a program takes ROWS whole blocks of
one row's gate half and the ROWS blocks F columns later (up): grid (rows, cdiv(F, ROWS * block)).
Supported: int / nf / fp8 / cint kinds with round-to-nearest (the activation formats), F % block == 0,
bf16 / fp16 / fp32; :func:`fusable` says whether a call qualifies (the caller picks the unfused path
otherwise, by that rule).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from agoq.formats import QuantFormat
from agoq.kernels import _launch
from agoq.kernels._quant_math import USE_PTX, _encode_scale, _max_nan, saturate
from agoq.kernels._quant_tile import _load_part, _part_codes, _store_words
from agoq.kernels.fastlaunch import FastKernel, LaunchSite
from agoq.kernels.quant import decode_block_values, load_scale_f32
from agoq.kernels.swiglu import NUM_WARPS, SCALE_NONE, _scale_mode
from agoq.ref.quant import QuantizedTensor

__all__ = ["swiglu_quantize", "dequant_swiglu_fwd", "dequant_swiglu_bwd", "fusable", "TILE_ELEMS"]

TILE_ELEMS = 1024  # elements of one half (gate or up) per program: agoq.kernels.swiglu's BLOCK_F
FUSED_KINDS = ("int", "nf", "fp8", "cint")  # cuint quantizes sqrt(x): not an activation format
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fusable(h: torch.Tensor, fmt: QuantFormat) -> bool:
    """Whether the fused kernels take this fc1 output and format (else: quantize + ATen SwiGLU); the
    device is the caller's rule (CUDA, or CPU under TRITON_INTERPRET=1 in tests)."""
    width = h.shape[-1] if h.dim() else 0
    return (h.dtype in DTYPES and fmt.quantized and fmt.kind in FUSED_KINDS
            and fmt.rounding == "nearest" and width % 2 == 0 and width > 0
            and (width // 2) % fmt.block == 0 and h.is_contiguous())  # fmt: skip


@triton.jit
def _silu_megatron(gate, EXACT_EXP: tl.constexpr):
    """ATen's silu of a [b]f16/fp32 value in fp32: x / (1 + exp(-x)), accurate expf, IEEE division."""
    if EXACT_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)  # interpreter: numpy's exp (libdevice does not run there)
    return tl.math.div_rn(gate, 1.0 + e)


@triton.jit
def _quantize_tile(x, local, col, codes_ptr, scales_ptr, nf4_lut_ptr, rows, row_ok,
                   KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                   SCALE: tl.constexpr, QMAX: tl.constexpr, PLANE0: tl.constexpr, PLANE1: tl.constexpr,
                   FP8_DTYPE: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """Codes and scales of a [ROWS, BLOCK] fp32 tile of whole blocks, stored at codes_ptr / scales_ptr
    (the tile's first block): _quantize_fwd_kernel's steps with SPLIT = 1, round to nearest."""
    absmax = tl.reduce(tl.abs(x), 1, _max_nan)
    bad = (absmax != absmax) | (absmax == float("inf"))
    if QMAX == 1.0:
        raw = absmax
    else:
        raw = tl.math.div_rn(absmax, QMAX)
    stored, s = _encode_scale(raw, SCALE)
    bad = bad | (s != s) | (s == float("inf"))
    inv = tl.where((s > 0) & (~bad), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)
    w0, w1 = _part_codes(x, local, col, inv, bad, codes_ptr, rows, row_ok, nf4_lut_ptr, 0, KIND, BITS,
                         BLOCK, ROWS, SCALE, False, QMAX, PLANE0, PLANE1, FP8_DTYPE, SUB, 1)  # fmt: skip
    if PLANE0 < 8:
        ZERO: tl.constexpr = 2 ** (BITS - 1) if KIND == 0 else (7 if KIND == 1 else (128 if KIND == 3 else 0))
        row_bytes: tl.constexpr = BLOCK * BITS // 8
        _store_words(codes_ptr, w0, bad, rows, row_ok, row_bytes, 0, PLANE0, SUB, ZERO & ((1 << PLANE0) - 1))
        if PLANE1 > 0:
            _store_words(codes_ptr, w1, bad, rows, row_ok, row_bytes, BLOCK * PLANE0 // 8, PLANE1, SUB,
                         ZERO >> PLANE0)  # fmt: skip
    if SCALE == 2:
        stored = tl.where(bad, 255, stored).to(tl.uint8)
    else:
        stored = tl.where(bad, float("nan"), stored.to(tl.float32)).to(scales_ptr.dtype.element_ty)
    tl.store(scales_ptr + rows, stored, mask=row_ok)


@triton.jit
def _swiglu_quant_fwd_kernel(
    h_ptr,  # fc1_out [T, 2F] contiguous: gate = h[:, :F], up = h[:, F:]
    z_ptr,  # out: z [T, F], h's dtype
    codes_ptr,  # out: uint8 packed codes of h, T * 2F / BLOCK blocks
    scales_ptr,  # out: one scale per block
    nf4_lut_ptr,  # int64 [32] (_launch.nf4_lut); KIND == 1
    F,  # int: FFN width, a multiple of BLOCK
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr,
    QMAX: tl.constexpr, PLANE0: tl.constexpr, PLANE1: tl.constexpr, FP8_DTYPE: tl.constexpr, SUB: tl.constexpr,
    EXACT_EXP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * (ROWS * BLOCK)
    elems_left = tl.minimum(F - col0, ROWS * BLOCK).to(tl.int32)
    rows = tl.arange(0, ROWS)
    row_ok = rows < elems_left // BLOCK  # F % BLOCK == 0: whole blocks
    gate_base = row * 2 * F + col0
    gate, local, col = _load_part(h_ptr, gate_base, elems_left, rows, BLOCK, SUB, 1, 0, KIND)
    up, _, _ = _load_part(h_ptr, gate_base + F, elems_left, rows, BLOCK, SUB, 1, 0, KIND)
    # -- z = silu(gate) * up with ATen's two roundings ------------------------------------------------
    silu = _silu_megatron(gate, EXACT_EXP).to(z_ptr.dtype.element_ty).to(tl.float32)
    z = (silu * up).to(z_ptr.dtype.element_ty)
    tl.store(z_ptr + row * F + col0 + local, z, mask=local < elems_left)
    # -- codes of both halves (block index = flat offset / BLOCK) ------------------------------------
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    gate_block = gate_base // BLOCK
    up_block = gate_block + F // BLOCK
    _quantize_tile(gate, local, col, codes_ptr + gate_block * row_bytes, scales_ptr + gate_block, nf4_lut_ptr, rows,
                   row_ok, KIND, BITS, BLOCK, ROWS, SCALE, QMAX, PLANE0, PLANE1, FP8_DTYPE, SUB)  # fmt: skip
    _quantize_tile(up, local, col, codes_ptr + up_block * row_bytes, scales_ptr + up_block, nf4_lut_ptr, rows,
                   row_ok, KIND, BITS, BLOCK, ROWS, SCALE, QMAX, PLANE0, PLANE1, FP8_DTYPE, SUB)  # fmt: skip


@triton.jit
def _dequant_half(codes_ptr, scales_ptr, values_ptr, first_block, rows, row_ok, out_ptr,
                  KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                  SCALE: tl.constexpr, PLANE0: tl.constexpr, PLANE1: tl.constexpr,
                  FP8_DTYPE: tl.constexpr):  # fmt: skip
    """fp32 values of ROWS blocks from first_block on, rounded to out_ptr's dtype as dequantize does."""
    row_bytes: tl.constexpr = BLOCK * BITS // 8
    s = load_scale_f32(scales_ptr + first_block + rows, row_ok, SCALE)
    v = decode_block_values(codes_ptr + first_block * row_bytes, values_ptr, rows, row_ok, KIND, BITS, BLOCK, ROWS,
                            PLANE0, PLANE1, FP8_DTYPE)  # fmt: skip
    return saturate(v * s[:, None], out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _dequant_swiglu_kernel(
    codes_ptr, scales_ptr, values_ptr,  # the QuantizedTensor of fc1_out [T, 2F]; values: code table
    gz_ptr,  # grad_z [T, F] (BWD) or unused
    s_ptr,  # fp32 Smooth-SwiGLU scale [T] / [F], or unused
    out_ptr,  # out: z [T, F] (not BWD) or grad_fc1_out [T, 2F] (BWD), the saved dtype
    F,  # int: FFN width, a multiple of BLOCK
    BWD: tl.constexpr, SCALE_MODE: tl.constexpr,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr,
    PLANE0: tl.constexpr, PLANE1: tl.constexpr, FP8_DTYPE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * (ROWS * BLOCK)
    elems_left = tl.minimum(F - col0, ROWS * BLOCK).to(tl.int32)
    rows = tl.arange(0, ROWS)
    row_ok = rows < elems_left // BLOCK  # F % BLOCK == 0: whole blocks
    gate_block = (row * 2 * F + col0) // BLOCK
    gate = _dequant_half(codes_ptr, scales_ptr, values_ptr, gate_block, rows, row_ok, out_ptr, KIND, BITS, BLOCK, ROWS,
                         SCALE, PLANE0, PLANE1, FP8_DTYPE)  # fmt: skip
    up = _dequant_half(codes_ptr, scales_ptr, values_ptr, gate_block + F // BLOCK, rows, row_ok, out_ptr, KIND, BITS,
                       BLOCK, ROWS, SCALE, PLANE0, PLANE1, FP8_DTYPE)  # fmt: skip
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = local < elems_left
    cols = col0 + local
    # -- agoq.kernels.swiglu's expressions, unchanged ---------------------------------------------------
    if BWD:
        g = tl.load(gz_ptr + row * F + cols, mask=ok, other=0.0).to(tl.float32)
        if SCALE_MODE == 1:
            g = g / tl.load(s_ptr + row)
        elif SCALE_MODE == 2:
            g = g / tl.load(s_ptr + cols, mask=ok, other=1.0)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = g * gate * sig
        o_row = out_ptr + row * 2 * F
        tl.store(o_row + cols, d_gate.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(o_row + F + cols, d_up.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        z = gate / (1.0 + tl.exp(-gate)) * up
        if SCALE_MODE == 1:
            z = z / tl.load(s_ptr + row)
        elif SCALE_MODE == 2:
            z = z / tl.load(s_ptr + cols, mask=ok, other=1.0)
        tl.store(out_ptr + row * F + cols, z.to(out_ptr.dtype.element_ty), mask=ok)


# direct launchers (every parameter positionally). The forward quantizes: no FMA contraction, as the
# quantize kernels. The backward kernels keep Triton's default, as agoq.kernels.swiglu.
_FWD = FastKernel(_swiglu_quant_fwd_kernel, num_warps=NUM_WARPS, enable_fp_fusion=False)
_DQ = FastKernel(_dequant_swiglu_kernel, num_warps=NUM_WARPS)


@functools.lru_cache(maxsize=64)
def _consts(fmt: QuantFormat) -> tuple:
    """(ROWS, code constexprs KIND .. FP8_DTYPE) for one format."""
    ce = _launch.constexprs(fmt)
    rows = max(1, TILE_ELEMS // fmt.block)
    return rows, (ce["KIND"], ce["BITS"], fmt.block, rows, ce["SCALE"])


def _check(h: torch.Tensor, fmt: QuantFormat, what: str) -> None:
    if not fusable(h, fmt):
        raise ValueError(
            f"{what}: fc1 output {tuple(h.shape)} {h.dtype} on {h.device} with format {fmt.name} is not fusable "
            f"(contiguous, F a multiple of the block, int/nf/fp8/cint nearest); use quantize + swiglu_fwd")


def swiglu_quantize(fc1_out: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, QuantizedTensor]:
    """(z, q): Megatron's SwiGLU output and fc1_out quantized to ``fmt`` (agoq.ref twin:
    ref_swiglu_quantize)."""
    key = (fmt, fc1_out.shape, fc1_out.dtype, fc1_out.device.index, USE_PTX.value) if fc1_out.is_cuda else None
    site = _FWD_SITES.get(key) if key is not None else None
    if site is None or not fc1_out.is_contiguous():
        _check(fc1_out, fmt, "swiglu_quantize")
        site = _FwdSite(fc1_out, fmt)
        if key is not None:
            _launch.remember_site(_FWD_SITES, key, site)
    return site.run(fc1_out)


# Launch sites (agoq.kernels.fastlaunch.LaunchSite): everything but the tensors, once per key; at most
# _launch.MAX_LAUNCH_SITES per dict (the oldest dropped first).
_FWD_SITES: dict = {}  # (fmt, fc1_out shape, dtype, CUDA index, USE_PTX) -> _FwdSite
_DQ_SITES: dict = {}  # (fmt, fc1_out shape, dtype, BWD, SCALE_MODE, CUDA index) -> _DequantSwigluSite


class _FwdSite:
    __slots__ = ("fmt", "device", "z_shape", "code_bytes", "num_blocks", "scale_dtype", "launch", "tail")

    def __init__(self, fc1_out: torch.Tensor, fmt: QuantFormat):
        width = fc1_out.shape[-1]
        ffn, numel = width // 2, fc1_out.numel()
        self.fmt, self.device = fmt, fc1_out.device
        self.z_shape = (*fc1_out.shape[:-1], ffn)
        self.code_bytes, self.num_blocks = fmt.code_bytes(numel), fmt.num_blocks(numel)
        self.scale_dtype = _launch.TORCH_SCALE_DTYPES[fmt.scale]
        rows, (kind, bits, block, _, scale) = _consts(fmt)
        ce = _launch.constexprs(fmt)
        grid = (numel // width, triton.cdiv(ffn, rows * block)) if numel else None
        self.launch = LaunchSite(_FWD, grid) if numel else None
        self.tail = (_launch.nf4_lut(str(self.device)), ffn, kind, bits, block, rows, scale, ce["QMAX"],
                     ce["PLANE0"], ce["PLANE1"], ce["FP8_DTYPE"], _launch.SUB_ELEMS, USE_PTX.value)

    def run(self, fc1_out: torch.Tensor) -> tuple[torch.Tensor, QuantizedTensor]:
        device = self.device
        z = torch.empty(self.z_shape, dtype=fc1_out.dtype, device=device)
        codes = torch.empty(self.code_bytes, dtype=torch.uint8, device=device)
        scales = torch.empty(self.num_blocks, dtype=self.scale_dtype, device=device)
        if self.launch is not None:
            self.launch(fc1_out, z, codes, scales, *self.tail)
        return z, QuantizedTensor(codes, scales, self.fmt, fc1_out.shape, fc1_out.dtype)


class _DequantSwigluSite:
    __slots__ = ("device", "launch", "values", "tail")

    def __init__(self, q: QuantizedTensor, bwd: bool, mode: int):
        fmt, shape = q.fmt, q.shape
        width = shape[-1]
        ffn = width // 2
        numel = int(torch.Size(shape).numel())
        self.device = q.codes.device
        rows, code_consts = _consts(fmt)
        ce = _launch.constexprs(fmt)
        self.launch = LaunchSite(_DQ, (numel // width, triton.cdiv(ffn, rows * fmt.block))) if numel else None
        self.values = _launch.code_values(fmt, str(self.device))
        self.tail = (ffn, bwd, mode, *code_consts, ce["PLANE0"], ce["PLANE1"], ce["FP8_DTYPE"])


def _dequant_swiglu(q: QuantizedTensor, grad_z: torch.Tensor | None, s: torch.Tensor | None) -> torch.Tensor:
    shape = q.shape
    ffn = shape[-1] // 2
    device = q.codes.device
    bwd = grad_z is not None
    out = torch.empty(shape if bwd else (*shape[:-1], ffn), dtype=q.dtype, device=device)
    if bwd and tuple(grad_z.shape) != (*shape[:-1], ffn):
        raise ValueError(f"dequant_swiglu_bwd: grad_z {tuple(grad_z.shape)} does not match fc1 output {tuple(shape)}")
    gz = grad_z.contiguous() if bwd else out
    mode = _scale_mode(out, gz, s)  # gz is out in forward: [T.., F] either way
    key = (q.fmt, shape, q.dtype, bwd, mode, device.index)
    site = _DQ_SITES.get(key) if q.codes.is_cuda else None
    if site is None:
        site = _DequantSwigluSite(q, bwd, mode)
        if q.codes.is_cuda:
            _launch.remember_site(_DQ_SITES, key, site)
    if site.launch is not None:
        s_flat = out if s is None else s.contiguous().reshape(-1)
        site.launch(q.codes, q.scales, site.values, gz, s_flat, out, *site.tail)
    return out


def _check_q(q: QuantizedTensor, what: str) -> None:
    width = q.shape[-1] if len(q.shape) else 0
    fmt = q.fmt
    if not (q.dtype in DTYPES and fmt.quantized and fmt.kind in FUSED_KINDS
            and width % 2 == 0 and width > 0 and (width // 2) % fmt.block == 0):  # fmt: skip
        raise ValueError(f"{what}: quantized fc1 output {tuple(q.shape)} ({fmt.name}) is not fusable; "
                         "use dequantize + agoq.kernels.swiglu")


def dequant_swiglu_fwd(q: QuantizedTensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """swiglu_fwd(dequantize(q), s) in one pass (agoq.ref twin: ref_dequant_swiglu_fwd)."""
    _check_q(q, "dequant_swiglu_fwd")
    return _dequant_swiglu(q, None, s)


def dequant_swiglu_bwd(q: QuantizedTensor, grad_z: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """swiglu_bwd(dequantize(q), grad_z, s) in one pass (agoq.ref twin: ref_dequant_swiglu_bwd)."""
    _check_q(q, "dequant_swiglu_bwd")
    return _dequant_swiglu(q, grad_z, s)


assert SCALE_NONE == 0  # the kernels' SCALE_MODE numbering is agoq.kernels.swiglu's
