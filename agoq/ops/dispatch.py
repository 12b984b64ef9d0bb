"""Where agoq chooses a Triton kernel or its plain-PyTorch reference: one function per op family, by the
tensor's device type (CUDA: Triton; every other device: the reference, identical results: tests/kernels).

- :func:`quant_ops`: block quantize / dequantize (:mod:`agoq.kernels.quant` / :mod:`agoq.ref.quant`);
- :func:`swiglu_ops`: SwiGLU fused with the quantize / dequantize of its saved input and the scaled SwiGLU
  forward / backward (:mod:`agoq.kernels.swiglu_quant`, :mod:`agoq.kernels.swiglu` / :mod:`agoq.ref.swiglu_quant`,
  :mod:`agoq.ref.swiglu`);
- :func:`rope_ops`: rotary position embedding forward / backward (:mod:`agoq.kernels.rope` / :mod:`agoq.ref.rope`);
- :func:`qkv_rope_ops`: the QKV split + RoPE forward / backward (the same modules);
- the FP8 casts: :func:`agoq.ops.fp8_linear.fp8_cast_ops` (kept there, beside its unchecked reference wrappers).

The eager saved-activation code (:mod:`agoq.ops.saved_act`) and the ``torch.library`` custom ops
(:mod:`agoq.ops.custom_ops`) both call these, so eager and compiled runs take the same implementation. The choice
is logged once per (family, device type) and never falls back silently: a CUDA tensor without Triton raises the
ImportError.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import SimpleNamespace

import torch

__all__ = ["qkv_rope_ops", "quant_ops", "rope_ops", "swiglu_ops"]

log = logging.getLogger("agoq.ops.dispatch")
_LOGGED_PATHS: set[tuple[str, str]] = set()
_LOG_LOCK = threading.Lock()
_OPS_BY_KIND: dict[str, tuple[Callable, Callable]] = {}  # host-side fast path: one lookup per call
_SWIGLU_BY_KIND: dict[str, SimpleNamespace] = {}
_QKV_ROPE_BY_KIND: dict[str, tuple[Callable, Callable]] = {}
_ROPE_BY_KIND: dict[str, tuple[Callable, Callable]] = {}


def _kind(device) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def _log_once(family: str, kind: str, path: str) -> None:
    with _LOG_LOCK:
        if (family, kind) not in _LOGGED_PATHS:
            _LOGGED_PATHS.add((family, kind))
            log.info("%s on %s tensors runs %s", family, kind, path)


def quant_ops(device: torch.device) -> tuple[Callable, Callable]:
    """(quantize, dequantize) for tensors on ``device``: Triton on CUDA, the reference elsewhere."""
    kind = _kind(device)
    ops = _OPS_BY_KIND.get(kind)
    if ops is None:
        ops = _OPS_BY_KIND[kind] = _resolve_quant_ops(kind)
    return ops


def _resolve_quant_ops(kind: str) -> tuple[Callable, Callable]:
    if kind == "cuda":
        from agoq.kernels.quant import dequantize, quantize  # lazily: needs Triton

        path = "agoq.kernels.quant (Triton)"
    else:
        from agoq.ref.quant import ref_dequantize as dequantize
        from agoq.ref.quant import ref_quantize as quantize

        path = "agoq.ref.quant (reference)"
    _log_once("block quantization", kind, path)
    return quantize, dequantize


def swiglu_ops(device: torch.device) -> SimpleNamespace:
    """``swiglu_quantize(h, fmt) -> (z, q)``, ``dequant_swiglu_fwd(q, s)``, ``dequant_swiglu_bwd(q, grad_z, s)``,
    ``swiglu_fwd(h, s)``, ``swiglu_bwd(h, grad_z, s)`` for tensors on ``device``: Triton on CUDA (the fused
    kernels take only the shapes of ``agoq.kernels.swiglu_quant.fusable`` and raise otherwise), the reference
    elsewhere."""
    kind = _kind(device)
    ops = _SWIGLU_BY_KIND.get(kind)
    if ops is None:
        ops = _SWIGLU_BY_KIND[kind] = _resolve_swiglu_ops(kind)
    return ops


def _resolve_swiglu_ops(kind: str) -> SimpleNamespace:
    if kind == "cuda":
        from agoq.kernels import swiglu as plain  # lazily: needs Triton
        from agoq.kernels import swiglu_quant as fused

        _log_once("SwiGLU", kind, "agoq.kernels.swiglu_quant / agoq.kernels.swiglu (Triton)")
        return SimpleNamespace(swiglu_quantize=fused.swiglu_quantize, dequant_swiglu_fwd=fused.dequant_swiglu_fwd,
                               dequant_swiglu_bwd=fused.dequant_swiglu_bwd, swiglu_fwd=plain.swiglu_fwd,
                               swiglu_bwd=plain.swiglu_bwd)
    from agoq.ref import swiglu as plain
    from agoq.ref import swiglu_quant as fused

    _log_once("SwiGLU", kind, "agoq.ref.swiglu_quant / agoq.ref.swiglu (reference)")
    return SimpleNamespace(swiglu_quantize=fused.ref_swiglu_quantize, dequant_swiglu_fwd=fused.ref_dequant_swiglu_fwd,
                           dequant_swiglu_bwd=fused.ref_dequant_swiglu_bwd, swiglu_fwd=plain.ref_swiglu_scaled,
                           swiglu_bwd=plain.ref_swiglu_bwd_scaled)


def rope_ops(device: torch.device) -> tuple[Callable, Callable]:
    """(rope_fwd, rope_bwd) for tensors on ``device``: Triton on CUDA, the reference elsewhere (same bits)."""
    kind = _kind(device)
    ops = _ROPE_BY_KIND.get(kind)
    if ops is None:
        ops = _ROPE_BY_KIND[kind] = _rope_pair(kind, "RoPE", ("rope_fwd", "rope_bwd"))
    return ops


def qkv_rope_ops(device: torch.device) -> tuple[Callable, Callable]:
    """(qkv_rope_fwd, qkv_rope_bwd) for tensors on ``device``: Triton on CUDA, the reference elsewhere (same bits)."""
    kind = _kind(device)
    ops = _QKV_ROPE_BY_KIND.get(kind)
    if ops is None:
        ops = _QKV_ROPE_BY_KIND[kind] = _rope_pair(kind, "QKV split + RoPE", ("qkv_rope_fwd", "qkv_rope_bwd"))
    return ops


def _rope_pair(kind: str, family: str, names: tuple[str, str]) -> tuple[Callable, Callable]:
    """The forward / backward ``names`` from agoq.kernels.rope on CUDA (imported lazily: needs Triton), else their
    ``ref_`` twins from agoq.ref.rope."""
    if kind == "cuda":
        from agoq.kernels import rope as impl

        path, prefix = "agoq.kernels.rope (Triton)", ""
    else:
        from agoq.ref import rope as impl

        path, prefix = "agoq.ref.rope (reference)", "ref_"
    _log_once(family, kind, path)
    fwd, bwd = (getattr(impl, prefix + name) for name in names)
    return fwd, bwd
