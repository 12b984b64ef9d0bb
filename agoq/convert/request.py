"""``python -m agoq.convert``'s requests: each command's flags, parsed once into a frozen, typed object.

``agoq.convert.__main__.request_of`` builds one from argparse's Namespace right after parsing; the commands take it,
never the Namespace. A field is named as its flag's destination (``--vocab-size`` -> ``vocab_size``; a unit
added: ``--max-shard-size`` -> ``max_shard_bytes``), so an error names the flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

IMPORT_DTYPES = ("auto", "bf16", "fp32")  # auto: the HF files' bf16 / fp32, fp16 as fp32
EXPORT_DTYPES = ("bf16", "fp32")
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3


def _check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} {value!r}: choose one of {list(allowed)}")


@dataclass(frozen=True)
class ImportRequest:
    """``hf-to-agoq``: a HF LlamaForCausalLM directory -> an agoq checkpoint + its model YAML."""

    COMMAND: ClassVar[str] = "hf-to-agoq"
    hf_dir: Path  # config.json + model(-*).safetensors
    output: Path  # the checkpoint directory to create
    config_out: Path | None = None  # the model YAML (None: OUTPUT/model.yaml)
    dtype: str = "auto"  # the checkpoint's tensor dtype (IMPORT_DTYPES)
    tensor_model_parallel_size: int = 1  # the vocabulary is padded for this TP size
    make_vocab_size_divisible_by: int = 128  # embedding rows: a multiple of this x the TP size

    def __post_init__(self):
        _check_choice("--dtype", self.dtype, IMPORT_DTYPES)


@dataclass(frozen=True)
class ExportRequest:
    """``agoq-to-hf``: an agoq checkpoint (any layout) -> a HF LlamaForCausalLM directory."""

    COMMAND: ClassVar[str] = "agoq-to-hf"
    load_dir: Path  # the checkpoint directory (--save / --load)
    output: Path  # the HF model directory to write
    iteration: int | None = None  # iter_N (None: the latest)
    config: Path | None = None  # the run's model YAML (None: the checkpoint's own record)
    tokenizer_model: Path | None = None  # the run's tokenizer, copied next to the weights
    vocab_size: int | None = None  # real vocabulary entries kept (None: the tokenizer's or the record's)
    dtype: str = "bf16"  # the safetensors dtype (EXPORT_DTYPES)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES  # --max-shard-size: bytes per safetensors shard

    def __post_init__(self):
        _check_choice("--dtype", self.dtype, EXPORT_DTYPES)
