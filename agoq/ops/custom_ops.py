"""agoq's kernels as ``torch.library`` custom ops (namespace ``agoq``), so that ``torch.compile`` sees one opaque
node per kernel instead of tracing into a Triton launcher or the reference's Python.

Every op has a fake (meta) implementation giving its output shapes and dtypes, and dispatches through the one
place that chooses kernel or reference by device (:mod:`agoq.ops.dispatch`; the FP8 casts:
:func:`agoq.ops.fp8_linear.fp8_cast_ops`): Triton on CUDA, the reference elsewhere, the same bits as the eager
calls. Formats travel as their canonical names (``QuantFormat.name``; ``parse_format(name) == fmt``) and a
:class:`~agoq.ref.quant.QuantizedTensor` as its ``(codes, scales)`` plus format, shape and dtype.

  agoq::quantize(x, fmt, seed)                        -> (codes, scales)       not differentiable
  agoq::dequantize(codes, scales, fmt, shape, dtype)  -> x_hat                 not differentiable
  agoq::swiglu_quantize(h, fmt)                       -> (z, codes, scales)    d z / d h at the dequantized h
  agoq::dequant_swiglu(codes, scales, fmt, shape, dtype, s)           -> z_hat   not differentiable
  agoq::dequant_swiglu_bwd(codes, scales, fmt, shape, dtype, grad_z, s) -> grad_h  not differentiable
  agoq::swiglu(h, s)                                  -> z                     d z / d h (s a constant)
  agoq::swiglu_bwd(h, grad_z, s)                      -> grad_h                not differentiable
  agoq::fp8_cast_current(x, variant, margin, pow2, rowmajor, transposed)     -> (out, out_t, meta)
  agoq::fp8_cast_delayed(x, variant, meta, workspace, margin, pow2, rowmajor, transposed) -> (out, out_t, new_meta)

``swiglu_quantize`` is the saved-activation SwiGLU as one differentiable op: it keeps only the codes for
backward, whose gradient is ``dequant_swiglu_bwd`` at the dequantized fc1 output (agoq's storage semantics,
arXiv 2605.00539), not at the exact one. In the FP8 casts an output that was not asked for
(``rowmajor`` / ``transposed`` False) is an empty fp8 tensor (a custom op returns tensors); :func:`fp8_cast_current`
and :func:`fp8_cast_delayed` give it back as None, as the eager casts do. ``workspace`` (the kernel's amax
accumulator, zero on entry and exit) is declared mutated.

Validated by ``torch.library.opcheck`` (tests/unit/test_custom_ops.py). Importing this module registers the ops
(no CUDA initialisation); :mod:`agoq.ops.saved_act` imports it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agoq.formats import parse_format
from agoq.ops.dispatch import quant_ops, swiglu_ops
from agoq.ref.quant import SCALE_DTYPES, QuantizedTensor

__all__ = ["quantize", "dequantize", "swiglu_quantize", "dequant_swiglu", "dequant_swiglu_bwd", "swiglu",
           "swiglu_bwd", "fp8_cast_current", "fp8_cast_delayed"]

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_NOT_ASKED = (0,)  # shape of an FP8 cast output that was not asked for


def _q(codes: Tensor, scales: Tensor, fmt: str, shape, dtype: torch.dtype) -> QuantizedTensor:
    return QuantizedTensor(codes, scales, parse_format(fmt), torch.Size(shape), dtype)


def _fresh(t: Tensor, *inputs: Tensor) -> Tensor:
    """``t``, cloned if it shares memory with an input (a custom op's outputs may not alias its inputs: the
    plain formats' "codes" are the input's own bytes when no cast is needed)."""
    for i in inputs:
        if i is not None and t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() and t.numel():
            return t.clone()
    return t


def _quant_sizes(fmt: str, numel):
    """(code bytes, scales, scale dtype) of ``numel`` elements in ``fmt`` (SymInt-friendly, formats.py's formulas)."""
    f = parse_format(fmt)
    if not f.quantized:
        return numel * f.bits // 8, 0, torch.float32
    blocks = (numel + f.block - 1) // f.block
    return blocks * f.block * f.bits // 8, blocks, SCALE_DTYPES[f.scale]


# ------------------------------------------------------------------------------- quantize ----
@torch.library.custom_op("agoq::quantize", mutates_args=())
def quantize(x: Tensor, fmt: str, seed: int | None = None) -> tuple[Tensor, Tensor]:
    """Block-quantize ``x`` to ``fmt``: (packed codes uint8, per-block scales)."""
    q = quant_ops(x.device)[0](x, parse_format(fmt), seed=seed)
    return _fresh(q.codes, x), q.scales


@quantize.register_fake
def _(x, fmt, seed=None):
    code_bytes, blocks, scale_dtype = _quant_sizes(fmt, x.numel())
    return x.new_empty((code_bytes,), dtype=torch.uint8), x.new_empty((blocks,), dtype=scale_dtype)


@torch.library.custom_op("agoq::dequantize", mutates_args=())
def dequantize(codes: Tensor, scales: Tensor, fmt: str, shape: list[int], dtype: torch.dtype) -> Tensor:
    """``shape`` in ``dtype`` from codes and scales (``dtype``: the original dtype, also the output's)."""
    return _fresh(quant_ops(codes.device)[1](_q(codes, scales, fmt, shape, dtype)), codes)


@dequantize.register_fake
def _(codes, scales, fmt, shape, dtype):
    return codes.new_empty(shape, dtype=dtype)


# --------------------------------------------------------------------------------- SwiGLU ----
@torch.library.custom_op("agoq::swiglu_quantize", mutates_args=())
def swiglu_quantize(h: Tensor, fmt: str) -> tuple[Tensor, Tensor, Tensor]:
    """(z, codes, scales): Megatron's SwiGLU of the fc1 output ``h`` = [gate | up] and ``h`` quantized."""
    z, q = swiglu_ops(h.device).swiglu_quantize(h, parse_format(fmt))
    return z, q.codes, q.scales


@swiglu_quantize.register_fake
def _(h, fmt):
    code_bytes, blocks, scale_dtype = _quant_sizes(fmt, h.numel())
    return (h.new_empty((*h.shape[:-1], h.shape[-1] // 2)), h.new_empty((code_bytes,), dtype=torch.uint8),
            h.new_empty((blocks,), dtype=scale_dtype))


def _swiglu_quantize_setup(ctx, inputs, output):
    h, fmt = inputs
    _, codes, scales = output
    ctx.save_for_backward(codes, scales)
    ctx.fmt, ctx.shape, ctx.dtype = fmt, tuple(h.shape), h.dtype
    ctx.mark_non_differentiable(codes, scales)


def _swiglu_quantize_bwd(ctx, grad_z, _grad_codes, _grad_scales):
    codes, scales = ctx.saved_tensors
    return dequant_swiglu_bwd(codes, scales, ctx.fmt, list(ctx.shape), ctx.dtype, grad_z, None), None


swiglu_quantize.register_autograd(_swiglu_quantize_bwd, setup_context=_swiglu_quantize_setup)


@torch.library.custom_op("agoq::dequant_swiglu", mutates_args=())
def dequant_swiglu(codes: Tensor, scales: Tensor, fmt: str, shape: list[int], dtype: torch.dtype,
                   s: Tensor | None = None) -> Tensor:
    """fc2's input rebuilt from the quantized fc1 output (``shape``, ``dtype``): swiglu(dequantize) / s."""
    return swiglu_ops(codes.device).dequant_swiglu_fwd(_q(codes, scales, fmt, shape, dtype), s)


@dequant_swiglu.register_fake
def _(codes, scales, fmt, shape, dtype, s=None):
    return codes.new_empty((*shape[:-1], shape[-1] // 2), dtype=dtype)


@torch.library.custom_op("agoq::dequant_swiglu_bwd", mutates_args=())
def dequant_swiglu_bwd(codes: Tensor, scales: Tensor, fmt: str, shape: list[int], dtype: torch.dtype,
                       grad_z: Tensor, s: Tensor | None = None) -> Tensor:
    """d loss / d fc1 output at the dequantized fc1 output."""
    return swiglu_ops(codes.device).dequant_swiglu_bwd(_q(codes, scales, fmt, shape, dtype), grad_z, s)


@dequant_swiglu_bwd.register_fake
def _(codes, scales, fmt, shape, dtype, grad_z, s=None):
    return codes.new_empty(shape, dtype=dtype)


@torch.library.custom_op("agoq::swiglu", mutates_args=())
def swiglu(h: Tensor, s: Tensor | None = None) -> Tensor:
    """silu(gate) * up / s in fp32, one rounding to h's dtype (agoq's recompute SwiGLU)."""
    return _fresh(swiglu_ops(h.device).swiglu_fwd(h, s), h)


@swiglu.register_fake
def _(h, s=None):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


def _swiglu_setup(ctx, inputs, output):
    h, s = inputs
    ctx.save_for_backward(h, s)


def _swiglu_bwd_autograd(ctx, grad_z):
    h, s = ctx.saved_tensors
    return swiglu_bwd(h, grad_z, s), None  # s is a constant (Smooth-SwiGLU computes it without grad)


swiglu.register_autograd(_swiglu_bwd_autograd, setup_context=_swiglu_setup)


@torch.library.custom_op("agoq::swiglu_bwd", mutates_args=())
def swiglu_bwd(h: Tensor, grad_z: Tensor, s: Tensor | None = None) -> Tensor:
    """d loss / d h of z = swiglu(h) / s."""
    return swiglu_ops(h.device).swiglu_bwd(h, grad_z, s)


@swiglu_bwd.register_fake
def _(h, grad_z, s=None):
    return torch.empty_like(h)


# ------------------------------------------------------------------------------- FP8 casts ----
def _cast_ops(device):
    from agoq.ops.fp8_linear import fp8_cast_ops  # the FP8 family's dispatch (agoq.ops.dispatch's docstring)

    return fp8_cast_ops(device)


def _fill(t: Tensor | None, like: Tensor, variant: str) -> Tensor:
    return like.new_empty(_NOT_ASKED, dtype=_FP8[variant]) if t is None else t.contiguous()


@torch.library.custom_op("agoq::fp8_cast_current", mutates_args=())
def fp8_cast_current_op(x: Tensor, variant: str, margin: int, pow2: bool, rowmajor: bool,
                        transposed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Current scaling of x [..., N] read as [M, N]: (out [M, N], out_t [N, M], meta [5])."""
    out, out_t, meta = _cast_ops(x.device).cast_current(x, variant, margin, pow2, rowmajor, transposed)
    return _fill(out, x, variant), _fill(out_t, x, variant), meta


@fp8_cast_current_op.register_fake
def _(x, variant, margin, pow2, rowmajor, transposed):
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    fp8 = _FP8[variant]
    return (x.new_empty((m, n) if rowmajor else _NOT_ASKED, dtype=fp8),
            x.new_empty((n, m) if transposed else _NOT_ASKED, dtype=fp8), x.new_empty((5,), dtype=torch.float32))


@torch.library.custom_op("agoq::fp8_cast_delayed", mutates_args=("workspace",))
def fp8_cast_delayed_op(x: Tensor, variant: str, meta: Tensor, workspace: Tensor, margin: int, pow2: bool,
                        rowmajor: bool, transposed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Delayed scaling (cast with meta's scale, push x's amax): (out, out_t, new_meta)."""
    out, out_t, new_meta = _cast_ops(x.device).cast_delayed(x, variant, meta, workspace, margin, pow2, rowmajor,
                                                            transposed)
    return _fill(out, x, variant), _fill(out_t, x, variant), _fresh(new_meta, meta)


@fp8_cast_delayed_op.register_fake
def _(x, variant, meta, workspace, margin, pow2, rowmajor, transposed):
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    fp8 = _FP8[variant]
    return (x.new_empty((m, n) if rowmajor else _NOT_ASKED, dtype=fp8),
            x.new_empty((n, m) if transposed else _NOT_ASKED, dtype=fp8), torch.empty_like(meta))


def fp8_cast_current(x, variant, margin, pow2, rowmajor, transposed):
    """``agoq::fp8_cast_current`` with the eager casts' return convention (None for an output not asked for)."""
    out, out_t, meta = fp8_cast_current_op(x, variant, margin, pow2, rowmajor, transposed)
    return (out if rowmajor else None), (out_t if transposed else None), meta


def fp8_cast_delayed(x, variant, meta, workspace, margin, pow2, rowmajor, transposed):
    """``agoq::fp8_cast_delayed`` with the eager casts' return convention (None for an output not asked for)."""
    out, out_t, new_meta = fp8_cast_delayed_op(x, variant, meta, workspace, margin, pow2, rowmajor, transposed)
    return (out if rowmajor else None), (out_t if transposed else None), new_meta
