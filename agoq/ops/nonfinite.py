"""NaN/Inf detection over large flat buffers without buffer-sized temporaries."""

from __future__ import annotations

import torch

# Elements per isfinite() slice: torch.isfinite(x) of a float tensor allocates |x| (one copy) plus three
# bool temporaries. Over a whole fp32 gradient buffer that was 7 B per parameter at the step's start
# (6.45 GiB for a 1B model, the H100 peak of the agoq runs: benchmarks/mem_trace.py, 2026-11-25); per
# slice it is at most 2**24 x 7 B = 112 MiB.
NONFINITE_CHECK_SLICE = 2**24


def nonfinite_in(flat: torch.Tensor, found: torch.Tensor | None = None) -> torch.Tensor | None:
    """0-dim bool tensor on flat's device: ``found`` or any NaN/Inf in the 1-D ``flat`` (no host sync)."""
    for start in range(0, flat.numel(), NONFINITE_CHECK_SLICE):
        part_bad = ~torch.isfinite(flat[start:start + NONFINITE_CHECK_SLICE]).all()
        found = part_bad if found is None else found | part_bad
    return found
