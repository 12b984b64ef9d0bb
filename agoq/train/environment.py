"""The environment variables the trainer reads, once, at start-up, and where each one goes.

Library code (agoq/megatron, agoq/kernels, agoq/ops, ...) reads no environment (tests/unit/test_config_boundary.py);
the trainer reads it here and passes what it found in:

* torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` -> :class:`agoq.megatron.runtime.LaunchInfo`
  (:func:`launch_from_environment`), given to ``runtime.init_distributed`` and ``runtime.choose_device``;
* ``AGOQ_TRITON_FAST_LAUNCH=0`` (Triton's own launch path instead of agoq's direct launches, the escape hatch of
  agoq.kernels.fastlaunch) -> ``AgoqConfig.kernels.fast_launch`` (:func:`kernels_from_environment`; applied by
  ``agoq.megatron.install.install``);
* ``AGOQ_FP8_SWIGLU_FUSION=0`` (plain FP8 MLPs run Megatron's SwiGLU then the FP8 fc2 instead of the fused SwiGLU +
  FP8 fc2 op; benchmarks' A/B; ``1``, the default, fuses) -> ``AgoqConfig.kernels.fuse_swiglu_fp8``
  (:func:`kernels_from_environment`; the layers and the start-up memory prediction read it from the config);
* ``TRITON_INTERPRET=1`` -> ``AgoqConfig.triton_interpret`` (agoq.train.args builds the config);
* PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` -> whether the start-up memory warning asks for expandable segments
  (:func:`expandable_segments`, agoq.plan.headroom);
* torchrun's ``TORCHELASTIC_RUN_ID`` (set for every rank its agent starts) -> whether a rank watches its launcher
  (:func:`launched_by_torchrun`, agoq.train.orphan).

With ``--deterministic-mode``, agoq.train.determinism checks and fills ``NCCL_ALGO``, ``CUBLAS_WORKSPACE_CONFIG`` and
``NVTE_ALLOW_NONDETERMINISTIC_ALGO`` (for the libraries that read them, before torch loads).

Other readers outside the library: ``scripts/pretrain_llama.py`` (``AGOQ_CACHE``, ``AGOQ_SHOW_KNOWN_WARNINGS``,
rank-0 printing) and the command-line tools' ``__main__`` modules.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from agoq.config.sections import KernelsConfig

if TYPE_CHECKING:  # the flags' parse (agoq.train.args) reads the kernel switches before torch loads
    from agoq.megatron.runtime import LaunchInfo

FAST_LAUNCH_ENV = "AGOQ_TRITON_FAST_LAUNCH"
PLAIN_FUSION_ENV = "AGOQ_FP8_SWIGLU_FUSION"
_SWITCH_VALUES = {"1": True, "0": False}


def launch_from_environment(environ: Mapping[str, str] = os.environ) -> LaunchInfo:
    """torchrun's launch variables (a single process when they are absent), as torch.distributed's env:// reads
    them."""
    from agoq.megatron.runtime import LaunchInfo

    return LaunchInfo(rank=int(environ.get("RANK", "0")), world_size=int(environ.get("WORLD_SIZE", "1")),
                      local_rank=int(environ.get("LOCAL_RANK", "0")),
                      rendezvous_from_environment="MASTER_ADDR" in environ)


def expandable_segments(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` turns on the CUDA allocator's expandable segments."""
    options = environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower().split(",")
    return "expandable_segments:true" in options


def launched_by_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a rank that torchrun's agent started (the agent sets ``TORCHELASTIC_RUN_ID`` for its workers)."""
    return "TORCHELASTIC_RUN_ID" in environ


def fast_launch_from_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """``AGOQ_TRITON_FAST_LAUNCH``: 1 (the default) or 0; anything else stops the run (``false`` used to leave the
    fast launch on without a word)."""
    value = environ.get(FAST_LAUNCH_ENV, "1")
    if value not in _SWITCH_VALUES:
        raise ValueError(f"{FAST_LAUNCH_ENV}={value!r}: use 1 (agoq's cached Triton launcher, the default) or 0 "
                         "(Triton's own launch path)")
    return _SWITCH_VALUES[value]


def plain_fusion_from_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """``AGOQ_FP8_SWIGLU_FUSION``: 1 (the default) or 0; anything else stops the run (a typo is never ignored)."""
    value = environ.get(PLAIN_FUSION_ENV, "1")
    if value not in _SWITCH_VALUES:
        raise ValueError(f"{PLAIN_FUSION_ENV}={value!r}: use 1 (fused SwiGLU + FP8 fc2, the default) or 0 (unfused)")
    return _SWITCH_VALUES[value]


def kernels_from_environment(environ: Mapping[str, str] = os.environ) -> KernelsConfig:
    """The run's ``AgoqConfig.kernels`` from the environment (read once, by agoq.train.args.build_config)."""
    return KernelsConfig(fast_launch=fast_launch_from_environment(environ),
                         fuse_swiglu_fp8=plain_fusion_from_environment(environ))
