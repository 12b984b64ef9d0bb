"""agoq.ops: autograd-level building blocks (torch only, no Megatron).

``agoq.ops.saved_act``: activations saved for backward in low-bit formats (quantized saves of a
linear's input, RMSNorm / SwiGLU that store only their quantized input and recompute), with exact
byte accounting.
"""
