"""Whether this torch runs FP8 ``torch._scaled_mm`` on the CPU (the CPU tests of the FP8 linears need it; the
same tests run on a GPU under tests/gpu)."""

from __future__ import annotations

import torch

CPU_SCALED_MM_SKIP_REASON = "this torch has no CPU torch._scaled_mm; run tests/gpu on a GPU"


def cpu_scaled_mm_available() -> bool:
    try:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError):
        return False
