"""Shared pytest configuration: markers are declared in pyproject.toml; capability skips live here."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    """Skip (never exit) tests whose hardware is missing; the reason says what to run instead."""
    try:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a hard dependency
        num_gpus = 0
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: pytest -m gpu on a GPU machine"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs >= 2 CUDA GPUs"))
        if "kernels" in item.keywords and num_gpus < 1 and not interpret:
            item.add_marker(
                pytest.mark.skip(reason="Triton kernel test: run with TRITON_INTERPRET=1 in its own process")
            )


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT

