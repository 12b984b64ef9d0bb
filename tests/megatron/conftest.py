"""In-process megatron-core on CPU: a world of one gloo rank, agoq installed (CPU mode), torn down after."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def mcore_world1():
    """Process group of one + model-parallel state (TP=PP=1); restores torch after the module."""
    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    handle = install(AgoqConfig(device="auto"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runtime.init_distributed(device, runtime.SINGLE_PROCESS)
    runtime.init_model_parallel(ParallelLayout(), seed=1234, device=device)
    yield device
    runtime.shutdown()
    handle.uninstall()
