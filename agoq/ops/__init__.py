"""agoq.ops: autograd-level building blocks (torch only, no Megatron).

``agoq.ops.saved_act``: activations saved for backward in low-bit formats (quantized saves of a
linear's input, the recompute stash), with exact byte accounting; ``agoq.ops.saved_norm`` and
``agoq.ops.saved_swiglu``: RMSNorm and SwiGLU that store only their quantized input and recompute.
``agoq.ops.custom_ops``: the kernels as ``torch.library`` custom ops (``torch.ops.agoq.*``, fake implementations,
autograd where differentiable) for torch.compile; ``agoq.ops.dispatch``: where kernel or reference is chosen.
"""
