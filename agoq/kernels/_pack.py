"""Triton helper of the optimizer kernel: in-register code packing.

The quantize kernel (agoq/kernels/quant.py) packs through its own store path (``_store_plane``); the
fused optimizer step packs codes in registers with ``pack_plane`` and must produce the same bytes
(tests/kernels/test_optim_kernels.py binds both to agoq.ref).
"""

import triton
import triton.language as tl


@triton.jit
def pack_plane(v, ROWS: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, BLOCK] codes < 2**WIDTH -> [ROWS, BLOCK*WIDTH//8] bytes, first code in the low bits."""
    if WIDTH == 8:
        out = v
    elif WIDTH == 4:
        lo, hi = tl.split(tl.reshape(v, [ROWS, BLOCK // 2, 2]))
        out = lo | (hi << 4)
    elif WIDTH == 2:
        a, b = tl.split(tl.reshape(v, [ROWS, BLOCK // 4, 2, 2]))
        lo, hi = tl.split(a | (b << 2))
        out = lo | (hi << 4)
    else:
        a, b = tl.split(tl.reshape(v, [ROWS, BLOCK // 8, 2, 2, 2]))
        c, d = tl.split(a | (b << 1))
        lo, hi = tl.split(c | (d << 2))
        out = lo | (hi << 4)
    return out.to(tl.uint8)
