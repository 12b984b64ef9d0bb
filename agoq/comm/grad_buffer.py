"""QuantizedGradBuffer: gradient accumulation in 8-bit codes + per-block scales.

Layout: a list of segments (one per parameter), each quantized on its own block grid (the tail
block of a segment is zero-padded), stored back to back in one flat ``codes_u8`` tensor and one
flat ``scales`` tensor. Segments never share a block, so accumulating one parameter never
re-rounds another (AGoQ keeps one block grid per parameter).

Accumulation (per micro-batch, per segment): dequantize -> add the new gradient in fp32 ->
requantize with a fresh block absmax (AGoQ's dequant-add-requant); on CUDA with a one-byte format
this is one fused kernel (agoq.kernels.comm.accumulate_) with no fp32 temporary. Optional error feedback keeps
the requantization error in a ``residual`` tensor (bf16 by default) that is added back on the next
accumulate and when the value is read, so the stored value is ``dequantize(codes) + residual``.

Savings (int8_b256, fp32 scales): 1 + 4/256 = 1.016 bytes per element vs 4 for an fp32 main_grad
(3.9x), plus per-segment padding (< 256 elements per parameter). Caveats: each accumulation adds up
to half a quantization step (absmax / 254) of error per element; error feedback removes most of it
but costs ``residual_dtype`` bytes per element (bf16: 2), i.e. 3.02 bytes in total.

Non-finite values: a block that receives NaN / Inf gets a NaN scale and stays NaN until
:meth:`zero_` (agoq.ref.quant's policy), so downstream NaN checks see it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agoq.comm.reduce import check_grad_format, quant_ops_for
from agoq.formats import QuantFormat
from agoq.ref.quant import QuantizedTensor

__all__ = ["QuantizedGradBuffer"]

_SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "pow2": torch.uint8}


class QuantizedGradBuffer:
    """8-bit storage of the gradients of ``segment_numels`` parameters (see module docstring).

    fmt: a signed, round-to-nearest quantized format (``int8_b256``).
    error_feedback: keep the requantization error in a ``residual_dtype`` tensor.
    block_multiple: pad the block count to a multiple of this (the data-parallel size for
        :func:`agoq.comm.reduce.allreduce_blocks_`).
    storage: ``storage(num_blocks) -> (codes_u8, scales)``, zeroed tensors to hold the blocks (e.g.
        agoq.comm.symm_store.SymmetricBlocks, which the peers of the reduction map); default: fresh tensors.
    """

    def __init__(self, segment_numels: list[int], fmt: QuantFormat | str, device: torch.device | str = "cpu", *,
                 error_feedback: bool = False, residual_dtype: torch.dtype = torch.bfloat16,
                 block_multiple: int = 1,
                 storage: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.fmt = check_grad_format(fmt)
        if any((not isinstance(n, int)) or n < 0 for n in segment_numels):
            raise ValueError(f"segment_numels must be non-negative ints, got {segment_numels!r}")
        self.segment_numels = list(segment_numels)
        self.device = torch.device(device)
        blocks = [self.fmt.num_blocks(n) for n in self.segment_numels]
        self.block_offsets = [0]
        for nb in blocks:
            self.block_offsets.append(self.block_offsets[-1] + nb)
        # trailing zero blocks (no segment) so that num_blocks is a multiple of block_multiple: the
        # 8-bit all-reduce (agoq.comm.reduce.allreduce_blocks_) splits the blocks evenly over W ranks
        num_blocks = -(-self.block_offsets[-1] // block_multiple) * block_multiple
        self.num_blocks = num_blocks
        self.code_bytes_per_block = self.fmt.block * self.fmt.bits // 8
        if storage is None:
            self.codes_u8 = torch.zeros(num_blocks * self.code_bytes_per_block, dtype=torch.uint8,
                                        device=self.device)
            self.scales = torch.zeros(num_blocks, dtype=_SCALE_DTYPES[self.fmt.scale], device=self.device)
        else:
            self.codes_u8, self.scales = storage(num_blocks)
            self._check_storage(num_blocks)
        self.residual = None
        if error_feedback:
            self.residual = torch.zeros(num_blocks * self.fmt.block, dtype=residual_dtype, device=self.device)
        self._quantize, self._dequantize = quant_ops_for(self.device)
        # CUDA + one-byte format: one fused kernel per accumulate (agoq.kernels.comm.accumulate_, the twin
        # of agoq.ref.comm.ref_accumulate_, which computes exactly the composition below)
        self._fused_accumulate = None
        if self.device.type == "cuda" and self.fmt.bits == 8 and self.fmt.kind in ("int", "fp8"):
            from agoq.kernels.comm import accumulate_

            self._fused_accumulate = accumulate_

    def _check_storage(self, num_blocks: int) -> None:
        want = ((num_blocks * self.code_bytes_per_block, torch.uint8), (num_blocks, _SCALE_DTYPES[self.fmt.scale]))
        for name, t, (numel, dtype) in zip(("codes", "scales"), (self.codes_u8, self.scales), want, strict=True):
            if t.numel() != numel or t.dtype != dtype or t.device != self.device or not t.is_contiguous():
                raise ValueError(f"QuantizedGradBuffer storage: {name} must be {numel} contiguous {dtype} on "
                                 f"{self.device}, got {t.numel()} {t.dtype} on {t.device}")
        if bool(self.codes_u8.any()) or bool(self.scales.any()):
            raise ValueError("QuantizedGradBuffer storage must start zeroed")

    # -- accounting -------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return sum(self.segment_numels)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + scales (+ residual with error feedback)."""
        total = self.codes_u8.numel() + self.scales.numel() * self.scales.element_size()
        if self.residual is not None:
            total += self.residual.numel() * self.residual.element_size()
        return total

    def bytes_per_param(self) -> float:
        return self.nbytes / max(self.numel, 1)

    # -- views ------------------------------------------------------------------------------
    def _slices(self, index: int) -> tuple[slice, slice, slice]:
        b0, b1 = self.block_offsets[index], self.block_offsets[index + 1]
        cb = self.code_bytes_per_block
        return slice(b0 * cb, b1 * cb), slice(b0, b1), slice(b0 * self.fmt.block, b1 * self.fmt.block)

    def quantized(self, index: int) -> QuantizedTensor:
        """Segment ``index`` as a QuantizedTensor (views into the buffer, padded to whole blocks)."""
        codes, scales, elems = self._slices(index)
        padded = elems.stop - elems.start
        return QuantizedTensor(self.codes_u8[codes], self.scales[scales], self.fmt, torch.Size((padded,)),
                               torch.float32)

    def _padded_value_f32(self, index: int) -> torch.Tensor:
        value = self._dequantize(self.quantized(index), torch.float32)
        if self.residual is not None:
            value = value + self.residual[self._slices(index)[2]].to(torch.float32)
        return value

    def dequantize(self, index: int) -> torch.Tensor:
        """fp32 value of segment ``index`` (flat, ``segment_numels[index]`` elements)."""
        return self._padded_value_f32(index)[: self.segment_numels[index]]

    # -- updates ----------------------------------------------------------------------------
    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """segment[index] += grad (dequantize, add in fp32, requantize with a fresh absmax)."""
        n = self.segment_numels[index]
        if grad.numel() != n:
            raise ValueError(f"segment {index} holds {n} elements, got a gradient of {grad.numel()}")
        if n == 0:
            return
        if self._fused_accumulate is not None:
            codes, scales, elems = self._slices(index)
            self._fused_accumulate(self.codes_u8[codes], self.scales[scales], grad.detach(), self.fmt,
                                   None if self.residual is None else self.residual[elems])
            return
        value = self._padded_value_f32(index)
        value[:n] += grad.detach().reshape(-1).to(torch.float32)
        self._store(index, value)

    def copy_(self, index: int, value: torch.Tensor) -> None:
        """segment[index] = value (quantized; the residual keeps the rounding error)."""
        n = self.segment_numels[index]
        padded = torch.zeros(self._slices(index)[2].stop - self._slices(index)[2].start, dtype=torch.float32,
                             device=self.device)
        padded[:n] = value.detach().reshape(-1).to(torch.float32)
        self._store(index, padded)

    def dequantize_blocks(self, first: int, count: int) -> torch.Tensor:
        """fp32 values of blocks [first, first + count) (global block indices, residual added)."""
        block, cb = self.fmt.block, self.code_bytes_per_block
        q = QuantizedTensor(self.codes_u8[first * cb: (first + count) * cb], self.scales[first: first + count],
                            self.fmt, torch.Size((count * block,)), torch.float32)
        value = self._dequantize(q, torch.float32)
        if self.residual is not None:
            value = value + self.residual[first * block: (first + count) * block].to(torch.float32)
        return value

    def store_blocks_(self, first: int, values_f32: torch.Tensor) -> None:
        """Blocks [first, first + n) = ``values_f32`` (whole blocks, quantized with a fresh absmax per block;
        the residual, with error feedback, keeps the rounding error)."""
        block, cb = self.fmt.block, self.code_bytes_per_block
        count = values_f32.numel() // block
        q = self._quantize(values_f32, self.fmt)
        self.codes_u8[first * cb: (first + count) * cb].copy_(q.codes.reshape(-1))
        self.scales[first: first + count].copy_(q.scales.reshape(-1))
        if self.residual is not None:
            err = values_f32 - self._dequantize(q, torch.float32)
            self.residual[first * block: (first + count) * block].copy_(err.to(self.residual.dtype))

    def scale_(self, factor: float | torch.Tensor) -> None:
        """Multiply every stored value by ``factor``: fp32 scales are multiplied in place (codes kept;
        the value changes by one fp32 rounding of the scale, none for powers of two); fp16 / pow2 scales
        requantize each segment. The residual (error feedback) is scaled with it."""
        if self.fmt.scale == "fp32":
            self.scales.mul_(factor)
            if self.residual is not None:
                self.residual.mul_(factor)
            return
        for index in range(len(self.segment_numels)):
            if self.segment_numels[index]:
                self._store(index, self._padded_value_f32(index) * factor)

    def _store(self, index: int, value_f32: torch.Tensor) -> None:
        codes, scales, elems = self._slices(index)
        q = self._quantize(value_f32, self.fmt)
        self.codes_u8[codes].copy_(q.codes)
        self.scales[scales].copy_(q.scales)
        if self.residual is not None:
            err = value_f32 - self._dequantize(q, torch.float32)  # NaN in a non-finite block: stays NaN
            self.residual[elems].copy_(err.to(self.residual.dtype))

    def fold_residual_(self) -> None:
        """Error feedback: requantize every segment to ``dequantize(codes) + residual`` and zero the
        residual, so the codes alone hold the value (what the 8-bit reduction sends). No-op without it."""
        if self.residual is None:
            return
        for index in range(len(self.segment_numels)):
            if self.segment_numels[index]:
                codes, scales, elems = self._slices(index)
                q = self._quantize(self._padded_value_f32(index), self.fmt)
                self.codes_u8[codes].copy_(q.codes)
                self.scales[scales].copy_(q.scales)
        self.residual.zero_()

    def sq_norm(self, segments: list[int] | None = None) -> torch.Tensor:
        """fp32 sum of squares of the stored values of ``segments`` (default all), one segment at a
        time (transient memory: one segment in fp32). NaN when a block is non-finite."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for index in range(len(self.segment_numels)) if segments is None else segments:
            if self.segment_numels[index]:
                value = self.dequantize(index)
                total += torch.dot(value, value)
        return total

    def zero_(self) -> None:
        self.codes_u8.zero_()
        self.scales.zero_()
        if self.residual is not None:
            self.residual.zero_()

    def has_nonfinite(self) -> bool:
        """True when any block holds NaN / Inf (its scale is NaN; pow2: byte 255)."""
        if self.fmt.scale == "pow2":
            return bool((self.scales == 255).any())
        return bool((~torch.isfinite(self.scales)).any())
