"""agoq.optim: framework-agnostic optimizers over quantized state (FlashOptim-style).

    from agoq.optim import AdamW
    opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, master="split24",
                state_formats={"exp_avg": "cint8_b32", "exp_avg_sq": "cuint8_b32"}, fused=True)

See agoq.optim.base for options, state layout, savings and caveats; docs/numerics.md for the numbers.
"""

from agoq.optim.base import MASTER_CHOICES, SMALL_TENSOR_RULE, QuantizedOptimizer
from agoq.optim.optimizers import SGD, AdamW, Lion

__all__ = ["AdamW", "Lion", "SGD", "QuantizedOptimizer", "MASTER_CHOICES", "SMALL_TENSOR_RULE"]
