"""Run a ``megatron.training.pretrain`` script (Megatron-LM's trainer) on the CPU, for tests.

``python tests/megatron/_megatron_lm_cpu.py SCRIPT <flags>`` runs ``SCRIPT`` as ``__main__`` (e.g.
scripts/pretrain_gpt_agoq.py); ``python tests/megatron/_megatron_lm_cpu.py -m agoq.megatron_lm SCRIPT <flags>`` runs
agoq's zero-edit door on ``SCRIPT``, as ``python -m`` would. Set torchrun's RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT; add ``--distributed-backend gloo --use-cpu-initialization --inference-rng-tracker`` to the
flags. ``megatron.training`` is CUDA-only; on top of agoq's CPU mode (agoq/megatron/cpu_mode.py, entered after
install_for_megatron_training's contract check, as agoq's own trainer does) this test driver stands in for what
``initialize_megatron`` and ``get_model`` ask of CUDA. Each stand-in is here and nowhere in the product:

* the door's ``require_cuda`` (agoq/train/megatron_lm_door.py) a no-op: it refuses a machine without CUDA.

* ``initialize_megatron(allow_no_cuda=True)``: it asserts ``torch.cuda.is_available()`` otherwise.
* ``torch.cuda.device_count() == 1``: with 0, ``_initialize_distributed`` skips ``initialize_model_parallel`` and
  ``_set_random_seed`` skips ``model_parallel_cuda_manual_seed``; ``torch.cuda.set_device`` a no-op.
* ``torch.cuda.Stream`` / ``torch.cuda.stream``: ``get_model`` wraps DDP construction in a side stream.
* ``torch.cuda.get_rng_state`` / ``set_rng_state``: the rerun state machine saves them every iteration.
* ``torch.cuda.memory_allocated`` and friends report 0 (Megatron's memory report; no GPU claim on CPU).
* ``set_jit_fusion_options`` a no-op: on a GPU its warm-up draws random tensors from the CUDA generator, which
  the model's initialisation does not use; under the CPU shims the draws would come from the CPU generator,
  which ``--use-cpu-initialization`` does use, and the weights would differ from scripts/pretrain_llama.py's.
"""

from __future__ import annotations

import contextlib
import functools
import runpy
import sys

import torch


def _zero(*_args, **_kwargs) -> int:
    return 0


def _enter_cpu_stand_ins() -> None:
    from agoq.megatron import cpu_mode

    cpu_mode.enter_cpu_mode()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *_: None
    torch.cuda.Stream = lambda *a, **k: cpu_mode._NoOpStream()
    torch.cuda.stream = lambda *_: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, _zero)


def main() -> None:
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    from agoq.megatron import megatron_lm
    from agoq.train import megatron_lm_door

    install = megatron_lm.install_for_megatron_training

    def install_then_cpu(*args, **kwargs):
        handle = install(*args, **kwargs)  # the contract check inspects symbols CPU mode replaces: check first
        _enter_cpu_stand_ins()
        return handle

    megatron_lm.install_for_megatron_training = install_then_cpu  # looked up on the module at call time
    megatron_lm_door.require_cuda = lambda: None
    training.set_jit_fusion_options = lambda *a, **k: None
    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    if sys.argv[1] == "-m":
        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
