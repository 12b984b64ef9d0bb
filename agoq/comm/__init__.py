"""agoq.comm: 8-bit gradient buffers and reductions on plain torch.distributed process groups."""

from agoq.comm.grad_buffer import QuantizedGradBuffer
from agoq.comm.reduce import (
    DEFAULT_GRAD_FORMAT,
    allreduce_8bit,
    allreduce_blocks_,
    make_reduce_scatter,
    reduce_blocks_to_owners,
    reduce_scatter_8bit,
    reduce_scatter_int8,
    wire_bytes,
)

__all__ = [
    "DEFAULT_GRAD_FORMAT",
    "QuantizedGradBuffer",
    "allreduce_8bit",
    "allreduce_blocks_",
    "make_reduce_scatter",
    "reduce_blocks_to_owners",
    "reduce_scatter_8bit",
    "reduce_scatter_int8",
    "wire_bytes",
]
