"""agoq.kernels: Triton kernels with the same signatures as their agoq.ref twins.

Import the submodules directly (``from agoq.kernels.quant import quantize``): importing this package
does not import Triton.
"""
