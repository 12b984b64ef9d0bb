"""Known-harmless start-up warnings of megatron-core and torch, filtered by exact message.

On the README's tiny PP=2 run these were 43 of 158 output lines, repeated per rank, and they buried agoq's
own start-up report. Each entry below names the message, where it comes from and why it does not matter
for a run of ``scripts/pretrain_llama.py``; :func:`filter_known_warnings` (called once per process by the
script, before torch and megatron load; nothing happens at import) ignores exactly those. Every other
warning still prints. These filters take precedence over ``python -W``; the script skips them when
``AGOQ_SHOW_KNOWN_WARNINGS=1`` is set (docs/troubleshooting.md).

Guarded by: tests/megatron/test_pretrain_script.py::test_pp2_1f1b_loss_falls (no third-party warning
lines in the README's first command) and tests/unit/test_known_warnings.py.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    """A ``warnings.warn`` (``logger`` None) or a log record of ``logger`` whose message starts with ``message``."""

    message: str  # the start of the message, matched literally
    module: str  # warnings: a regular expression matched at the start of the module it is attributed to;
    #              logs: the logger's name
    why: str  # why it is harmless here
    logger: bool = False


KNOWN_WARNINGS = (
    KnownWarning("Transformer Engine and Apex are not installed", r"megatron\.core",
                 "optional fused kernels: Megatron falls back to torch's optimizers and multi-tensor code; "
                 "agoq's layers, optimizer and gradients never use TE or Apex"),
    KnownWarning("Apex is not installed. Falling back to Torch Norm", r"megatron\.core",
                 "the local layer spec's norm is torch.nn.RMSNorm (WrappedTorchNorm; agoq's AgoqRMSNorm subclasses "
                 "it), the intended path, not a degraded one"),
    KnownWarning("absl.logging is not installed", r"megatron\.core",
                 "megatron.core.hyper_comm_grid logs through the standard logging module instead"),
    KnownWarning("full scope is deprecated", r"megatron\.core",
                 "TransformerConfig's own default (cuda_graph_modules='full') warns in 0.19.2 although CUDA "
                 "graphs are off (cuda_graph_impl='none')"),
    KnownWarning("MimoModelConfig is experimental", r"megatron\.core",
                 "raised when megatron.core.models.mimo is imported; agoq builds no MIMO model"),
    KnownWarning("GPTModel IS DEPRECATED", "megatron.core.models.gpt.gpt_model",
                 "GPTModel is the LLaMA model class of the pinned megatron-core 0.19.2 (agoq.megatron.compat)",
                 logger=True),
    KnownWarning("No CUDA runtime is found", "torch.utils.cpp_extension",
                 "torch looks for CUDA to build C++ extensions; on a machine without a GPU agoq runs in CPU "
                 "mode and builds none", logger=True),
    # checkpoints (megatron.core.dist_checkpointing over torch.distributed.checkpoint), once per save / load
    KnownWarning("MCore's async save is deprecated", "megatron.core.dist_checkpointing.strategies.torch",
                 "logged by every save through Megatron's default torch_dist strategy (async_strategy='mcore' "
                 "is its default argument), also for the synchronous saves agoq makes", logger=True),
    KnownWarning("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
                 r"torch\.distributed\.checkpoint",
                 "Megatron's loader calls torch's checkpoint.load with no_dist=True on purpose: each rank reads "
                 "its own shards, coordinated by Megatron"),
    KnownWarning("The argument order of load has been changed", r"(megatron\.core|torch\.distributed\.checkpoint)",
                 "Megatron 0.19.2 passes the storage reader positionally; torch maps it to the keyword"),
    KnownWarning("Please use DTensor instead and we are deprecating ShardedTensor", r"(torch|megatron|agoq\.megatron)",
                 "Megatron 0.19.2's checkpoint loader builds torch ShardedTensors (attributed to agoq's CPU-mode "
                 "shim on the CPU, which forwards the call)"),
)


class _DropKnown(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def filter_known_warnings(known: tuple[KnownWarning, ...] = KNOWN_WARNINGS) -> None:
    """Ignore exactly the ``known`` warnings in this process (idempotent: filters are added once)."""
    for entry in known:
        if entry.logger:
            logger = logging.getLogger(entry.module)
            if not any(isinstance(f, _DropKnown) for f in logger.filters):
                logger.addFilter(_DropKnown(tuple(e.message for e in known if e.logger and e.module == entry.module)))
        else:
            # append=False puts ours first; warnings.filterwarnings removes an identical earlier entry
            warnings.filterwarnings("ignore", message=re.escape(entry.message), module=entry.module)
