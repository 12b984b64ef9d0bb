"""CPU execution mode: the shims that let megatron-core 0.19.2 run on a machine without a GPU.

Seam card
---------
Touches (runtime patches, all undone by :func:`exit_cpu_mode`):
  ``torch.cuda.current_device``, ``torch.cuda.current_stream``, ``torch.cuda.synchronize``,
  ``torch.Tensor.cuda``, ``torch.Tensor.type`` (no-argument form only), and a global
  ``TorchFunctionMode`` that rewrites ``device="cuda"`` / ``"cuda:N"`` arguments to the CPU;
  ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` (a placeholder
  state, a no-op restore: there is no CUDA generator; the CPU generator is saved and restored by the same
  ``_get_all_rng_states`` as on a GPU).
Why: megatron-core assumes CUDA in ~130 places (``device=torch.cuda.current_device()``, dummy
  streams in the bucket groups, ``torch.cuda.FloatTensor`` type checks in the optimizers,
  ``torch.cuda.synchronize`` in dist_checkpointing). Each shim below names the first place that
  needs it (measured on megatron-core 0.19.2).
Verified on: megatron-core 0.19.2, torch 2.13/2.14 CPU and CUDA builds without a GPU.
When disabled: GPU runs never import this module; ``agoq.megatron.install`` enters it only when
  ``torch.cuda.is_available()`` is False, and says so once in the log.
Guarded by: ``tests/megatron/test_install_and_cpu_mode.py`` (enter/exit restores every symbol) and every
  ``tests/megatron`` test, which run real megatron-core through these shims.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from agoq.config import flag_for

log = logging.getLogger("agoq.cpu_mode")

_CUDA_DEVICE_RE = re.compile(r"^cuda(:\d+)?$")
_CPU = torch.device("cpu")


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and bool(_CUDA_DEVICE_RE.match(value))


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device='cuda'`` (keyword or ``Tensor.to`` positional) to the CPU.

    First needed by ``pipeline_parallel/schedules.py`` (``torch.zeros(..., device="cuda")`` in all
    three schedules) and ``optimizer/clip_grads.py``.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device=_CPU)
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _no_cuda_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    """Stands in for ``megatron.core.tensor_parallel.random._get_cuda_rng_state``: an empty state.

    First needed by ``CheckpointFunction.forward`` (``_get_all_rng_states``), i.e. Megatron's full recompute
    and its selective recompute of core attention (``Attention._checkpointed_attention_forward``); its
    ``_set_cuda_rng_state`` counterpart is a no-op."""
    return torch.empty(0, dtype=torch.uint8)


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered.

    First needed by ``param_and_grad_buffer.py:_ParamAndGradBucketGroup.start_grad_sync``.
    """

    def wait_stream(self, _stream: Any) -> None:
        return None

    def wait_event(self, _event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, _event: Any = None) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _tensor_type_cuda_names(original):
    """No-argument ``Tensor.type()`` reports ``torch.cuda.*`` names, as on a GPU.

    First needed by ``optimizer/clip_grads.py`` (asserts ``'torch.cuda.FloatTensor'``) and the
    ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer`` dtype checks.
    """

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


@dataclass
class _CpuModeState:
    saved: dict[tuple[Any, str], Any] = field(default_factory=dict)
    mode: _CudaToCpuMode | None = None


_STATE = _CpuModeState()


def _patch(owner: Any, name: str, value: Any) -> None:
    _STATE.saved[(owner, name)] = getattr(owner, name)
    setattr(owner, name, value)


def cpu_mode_active() -> bool:
    return _STATE.mode is not None


def enter_cpu_mode() -> None:
    """Install every CPU shim (idempotent). Raises if a GPU is present: GPU runs must not get here."""
    if cpu_mode_active():
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "agoq CPU mode was requested on a machine with a CUDA GPU; GPU runs must not use the "
            f"CPU shims. Run without {flag_for('device')} cpu, or hide the GPUs with CUDA_VISIBLE_DEVICES=''."
        )
    _patch(torch.cuda, "current_device", lambda: _CPU)
    _patch(torch.cuda, "current_stream", lambda device=None: _NoOpStream())
    _patch(torch.cuda, "synchronize", lambda device=None: None)
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _patch(torch.Tensor, "type", _tensor_type_cuda_names(torch.Tensor.type))
    from megatron.core.tensor_parallel import random as mcore_random

    _patch(mcore_random, "_get_cuda_rng_state", _no_cuda_rng_state)
    _patch(mcore_random, "_set_cuda_rng_state", lambda *_a, **_k: None)
    mode = _CudaToCpuMode()
    mode.__enter__()
    _STATE.mode = mode
    log.warning(
        "agoq: no CUDA GPU found, running megatron-core in CPU mode (shims: current_device, "
        "current_stream, synchronize, Tensor.cuda, Tensor.type, device='cuda'->cpu, Megatron's CUDA RNG state). "
        "For correctness checks only: no speed or memory claim holds in this mode."
    )


def exit_cpu_mode() -> None:
    """Undo every shim (idempotent)."""
    if not cpu_mode_active():
        return
    _STATE.mode.__exit__(None, None, None)
    _STATE.mode = None
    for (owner, name), value in reversed(list(_STATE.saved.items())):
        setattr(owner, name, value)
    _STATE.saved.clear()
