"""The calls of Megatron-LM's training package (``megatron.training``) that agoq's door to Megatron-LM's own
``pretrain_gpt.py`` makes (agoq.train.megatron_lm_door): parse the flags, replace
``parse_and_validate_args``, observe ``train_step``, read the model config and the micro-batch count.

Seam card
---------
Touches (Megatron-LM 0.19.x, ``megatron.training``): ``arguments.parse_args`` / ``parse_and_validate_args``
  (replaced through ``agoq.megatron.install.set_module_attr``: marked, undone by ``undo_runtime_changes``),
  ``training.train_step`` (wrapped the same way; its ``iteration`` argument, by name or 8th positional),
  ``argument_utils.core_transformer_config_from_args``; megatron-core's ``get_num_microbatches``.
Why: the door runs an unmodified ``pretrain_gpt.py``; these are the calls every such script makes.
Imported on use: agoq's own trainer never imports ``megatron.training``.
Guarded by: tests/megatron/test_megatron_lm_door.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from agoq.megatron.install import mark, set_module_attr


def parse_args(extra_args_provider, ignore_unknown_args: bool):
    """Megatron-LM's flags parsed (``arguments.parse_args``), not yet validated."""
    import megatron.training.arguments as arguments

    return arguments.parse_args(extra_args_provider, ignore_unknown_args)


def replace_parse_and_validate_args(make: Callable[[Callable], Callable], seam: str) -> None:
    """Put ``make(original)`` in ``megatron.training.arguments.parse_and_validate_args`` (marked ``seam``)."""
    import megatron.training.arguments as arguments

    original = arguments.parse_and_validate_args
    if getattr(original, "__agoq_patch__", None):
        raise RuntimeError("agoq's door is already installed (megatron.training.arguments.parse_and_validate_args)")
    set_module_attr(arguments, "parse_and_validate_args", mark(make(original), seam), seam=seam)


def observe_train_step(after_step: Callable[[int | None, dict, int], None], seam: str) -> None:
    """Wrap ``megatron.training.training.train_step`` (marked ``seam``): after each call,
    ``after_step(iteration, loss_dict, skipped_iter)`` with the iteration ``train()`` passed it."""
    import megatron.training.training as mtt

    original = mtt.train_step

    @functools.wraps(original)  # Megatron's signature (the contract check reads it)
    def train_step(*args, **kwargs):
        out = original(*args, **kwargs)
        iteration = kwargs.get("iteration", args[7] if len(args) > 7 else None)  # train() passes it by name
        after_step(iteration, out[0], out[1])
        return out

    set_module_attr(mtt, "train_step", mark(train_step, seam), seam=seam)


def transformer_config_from_args(args):
    """The TransformerConfig Megatron-LM builds from its validated flags."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


def num_microbatches() -> int:
    """Micro-batches per step of the running Megatron-LM job."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return get_num_microbatches()
