"""install() is idempotent and undoable; CPU mode patches exactly the listed symbols and restores them."""

from __future__ import annotations

import pytest
import torch

from agoq.config import AgoqConfig
from agoq.megatron.install import install

pytestmark = pytest.mark.megatron

needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode is refused when a GPU is present")


def _patched_symbols():
    return (torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.synchronize,
            torch.Tensor.cuda, torch.Tensor.type)


@needs_cpu
def test_install_twice_then_uninstall_restores_torch():
    before = _patched_symbols()
    handle = install(AgoqConfig(device="cpu"))
    assert install(AgoqConfig(device="cpu")) is handle  # idempotent
    assert [s.name for s in handle.applied] == ["cpu_mode"]
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(2, device="cuda").device.type == "cpu"  # device='cuda' rewritten
    assert torch.zeros(2).type() == "torch.cuda.FloatTensor"  # Megatron's optimizer type checks
    assert torch.zeros(2).type(torch.float64).dtype == torch.float64  # the 1-arg form is untouched
    with pytest.raises(RuntimeError, match="different config"):
        install(AgoqConfig(device="cpu", policy_path="x.yaml"))
    handle.uninstall()
    assert _patched_symbols() == before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")  # the real error again: no GPU here


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="choose one of"):
        AgoqConfig(device="tpu")
