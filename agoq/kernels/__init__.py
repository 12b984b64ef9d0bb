"""agoq.kernels."""
