"""AgoqConfig: the run-time options of agoq, one frozen dataclass (the single source of truth).

Core agoq code reads only this object; ``agoq.megatron.args`` maps ``--agoq-*`` flags onto it and
``scripts/`` map environment variables onto flags. No field is read from the environment here.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class AgoqConfig:
    enabled: bool = True
    """False runs plain Megatron (the baseline): no agoq seam is installed."""

    policy_path: str | None = None
    """Bit-width policy YAML (configs/policy/*.yaml); None means the default policy."""

    device: str = "auto"
    """auto: CUDA when available, else megatron-core's CPU mode; cpu / cuda force one."""

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"AgoqConfig.device={self.device!r}: choose one of {DEVICES}")
