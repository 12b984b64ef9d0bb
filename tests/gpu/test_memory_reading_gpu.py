"""agoq.megatron.runtime.outside_allocator_gib on a GPU: the memory outside PyTorch's allocator (CUDA context,
NCCL, workspaces) does not move when the allocator reserves more, and is not zero (the context alone is hundreds of
MiB on an H100)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_outside_memory_stays_put_while_the_allocator_grows():
    from agoq.megatron.runtime import outside_allocator_gib

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the context exists
    before = outside_allocator_gib(device)
    block = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB through the allocator
    after = outside_allocator_gib(device)
    assert 0.1 < before["outside_allocator_gib"] < before["device_total_gib"] / 4
    assert abs(after["outside_allocator_gib"] - before["outside_allocator_gib"]) < 0.0625  # 64 MiB: page rounding
    del block
