"""The planner's request: ``python -m agoq.plan``'s command line, parsed once into a frozen, typed object.

``agoq.plan.__main__.parse`` builds it from argparse's Namespace right after parsing; everything below the entry
point takes a ``PlanRequest`` (or plain values), never the Namespace. The planner takes ``scripts/pretrain_llama.py``'s
own flags (agoq.cli.flags: one definition each), so a field is named as the trainer's flag destination
(``--tensor-model-parallel-size`` -> ``tensor_model_parallel_size``) and an error names the flag; ``None``: the flag
was not given (the --config file, then the defaults, decide). The trainer's other flags given on the command line
(``--lr``, ``--data-path``, ...) do not change memory; they are kept in ``trainer`` and passed on to the launch
command ``--gpus`` prints."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agoq.config.values import MASTER_CHOICES, OPTIMIZERS, RECOMPUTE_GRANULARITIES, ROPE_FUSIONS
from agoq.plan.capacity import DEFAULT_MAX_GPUS, DEFAULT_MAX_MBS
from agoq.plan.memory import parse_bytes
from agoq.policy import FP8_RECIPES, SMOOTH_SWIGLU_MODES

# the settings the planner models: the trainer's flags of the same names, read by AgoqConfig.from_flags (the other
# --agoq-* flags of agoq.config.AGOQ_FLAGS are not modelled)
PLANNED_AGOQ_KEYS = ("agoq_optimizer", "agoq_moments", "agoq_master", "agoq_grads", "grad_reduce_in_bf16",
                     "agoq_gradient_release", "recompute_granularity", "agoq_fp8", "agoq_smooth_swiglu",
                     "agoq_fp8_bf16_first_layers", "agoq_fp8_bf16_last_layers", "rope_fusion")
CHOICES = {"agoq_optimizer": OPTIMIZERS, "agoq_master": MASTER_CHOICES,
           "recompute_granularity": RECOMPUTE_GRANULARITIES, "agoq_fp8": FP8_RECIPES,
           "agoq_smooth_swiglu": SMOOTH_SWIGLU_MODES, "rope_fusion": ROPE_FUSIONS}
def flag_name(field: str) -> str:
    """The command-line flag of a field: ``max_gpus`` -> ``--max-gpus``."""
    return "--" + field.replace("_", "-")


# counts that must be >= 1 (layers, widths, heads, vocabulary, GPUs per dimension, batch, tokens, chunks, search bounds)
POSITIVE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                   "vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "dp",
                   "micro_batch_size", "global_batch_size", "seq_length", "num_layers_per_virtual_pipeline_stage",
                   "make_vocab_size_divisible_by", "gpus", "max_gpus", "max_mbs")


@dataclass(frozen=True)
class PlanRequest:
    # per GPU, as written (80GiB, 80GB, a byte count); None: the visible GPU's memory, else 80 GiB (__main__)
    memory_budget: str | None = None
    config: str | None = None  # --config: the trainer's model YAML (configs/model/*.yaml)
    # the shape: layers, elements per hidden / FFN row, heads, the vocabulary before padding
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None
    tokenizer_model: str | None = None  # the vocabulary of this tokenizer, where --vocab-size is not given
    make_vocab_size_divisible_by: int | None = None
    # the layout (GPUs per parallel dimension, layers per virtual chunk) and the batch (sequences; tokens per sequence)
    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    dp: int | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    seq_length: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    use_distributed_optimizer: bool | None = None
    # agoq's settings (PLANNED_AGOQ_KEYS)
    agoq_optimizer: str | None = None
    agoq_moments: str | None = None
    agoq_master: str | None = None
    agoq_grads: str | None = None
    grad_reduce_in_bf16: bool | None = None
    agoq_gradient_release: bool | None = None
    recompute_granularity: str | None = None
    agoq_fp8: str | None = None
    agoq_smooth_swiglu: str | None = None
    agoq_fp8_bf16_first_layers: int | None = None
    agoq_fp8_bf16_last_layers: int | None = None
    rope_fusion: str | None = None  # --rope-fusion (off: Megatron's RoPE keeps cos / sin per layer)
    # the trainer's other flags given on the command line: (destination, value) pairs, values as parsed (lists as
    # tuples); read for the settings the planner refuses (UNMODELLED_KEYS) and passed on to --gpus's command
    trainer: tuple[tuple[str, Any], ...] = ()
    # what to do: the candidates (policy YAML paths, richest first), the output path, capacity mode's search, the
    # GPUs to launch on (--gpus: the fastest layout that fits and its torchrun command)
    policies: tuple[str, ...] | None = None
    out: str | None = None
    capacity: bool = False
    max_gpus: int = DEFAULT_MAX_GPUS
    max_mbs: int = DEFAULT_MAX_MBS
    gpus: int | None = None

    def __post_init__(self):
        for field, allowed in CHOICES.items():
            value = getattr(self, field)
            if value is not None and value not in allowed:
                raise ValueError(f"{flag_name(field)} {value!r}: choose one of {list(allowed)}")
        if self.policies is not None and not isinstance(self.policies, tuple):
            raise ValueError(f"--policies {self.policies!r}: a tuple of policy YAML paths")
        for field in POSITIVE_FIELDS:  # --dp 0 was a ZeroDivisionError traceback
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"{flag_name(field)} {value}: use a positive integer")
        if self.capacity and self.gpus is not None:
            raise ValueError("--capacity and --gpus: choose one (--capacity: the fewest GPUs per preset; --gpus N: "
                             "the fastest layout on N GPUs and its launch command)")

    @property
    def memory_budget_bytes(self) -> int | None:
        """--memory-budget in bytes (agoq.plan.memory.parse_bytes; its errors name the flag); None: not given."""
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)

    def given(self, fields: Iterable[str]) -> dict[str, Any]:
        """The fields among ``fields`` whose flags were given (not None), in that order."""
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
