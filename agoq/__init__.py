"""agoq: low-bit activations, gradients and optimizer states for megatron-core pretraining.

Importing agoq has no side effects: no environment reads, no CUDA initialisation, no patching.
Megatron integration lives in :mod:`agoq.megatron` and is applied only by ``agoq.megatron.install``.
"""

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
