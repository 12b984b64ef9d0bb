"""Known-harmless start-up warnings of megatron-core and torch, filtered by exact message (issue 21).

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
    module: str  # warnings: the module it is attributed to (a prefix); logs: the logger's name
    why: str  # why it is harmless here
    logger: bool = False


KNOWN_WARNINGS = (
    KnownWarning("Transformer Engine and Apex are not installed", "megatron.core",
                 "optional fused kernels: Megatron falls back to torch's optimizers and multi-tensor code; "
                 "agoq's layers, optimizer and gradients never use TE or Apex"),
    KnownWarning("Apex is not installed. Falling back to Torch Norm", "megatron.core",
                 "the local layer spec's norm is torch.nn.RMSNorm (WrappedTorchNorm; agoq's AgoqRMSNorm subclasses "
                 "it), the intended path, not a degraded one"),
    KnownWarning("absl.logging is not installed", "megatron.core",
                 "megatron.core.hyper_comm_grid logs through the standard logging module instead"),
    KnownWarning("full scope is deprecated", "megatron.core",
                 "TransformerConfig's own default (cuda_graph_modules='full') warns in 0.19.2 although CUDA "
                 "graphs are off (cuda_graph_impl='none')"),
    KnownWarning("MimoModelConfig is experimental", "megatron.core",
                 "raised when megatron.core.models.mimo is imported; agoq builds no MIMO model"),
    KnownWarning("GPTModel IS DEPRECATED", "megatron.core.models.gpt.gpt_model",
                 "GPTModel is the LLaMA model class of the pinned megatron-core 0.19.2 (agoq.megatron.compat)",
                 logger=True),
    KnownWarning("No CUDA runtime is found", "torch.utils.cpp_extension",
                 "torch looks for CUDA to build C++ extensions; on a machine without a GPU agoq runs in CPU "
                 "mode and builds none", logger=True),
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
            warnings.filterwarnings("ignore", message=re.escape(entry.message), module=re.escape(entry.module))
