"""Convert LLaMA checkpoints between Hugging Face and agoq (Megatron distributed checkpoints).

    # a HF LlamaForCausalLM directory (config.json + safetensors) -> an agoq checkpoint + its model config
    python -m agoq.convert hf-to-agoq /models/Meta-Llama-3-8B --output ckpt/llama3-8b
    torchrun --nproc-per-node 4 scripts/pretrain_llama.py --config ckpt/llama3-8b/model.yaml \\
        --pipeline-model-parallel-size 4 --load ckpt/llama3-8b --save ckpt/run \\
        --data-path data/mydata --tokenizer-model /models/Meta-Llama-3-8B/tokenizer.json

    # any agoq checkpoint (any TP / PP layout, with or without optimizer state; it records its model shape) -> HF
    python -m agoq.convert agoq-to-hf ckpt/run \\
        --tokenizer-model /models/Meta-Llama-3-8B/tokenizer.json --output hf/llama3-8b-run --dtype bf16

Runs in one CPU process (no torchrun): the whole model is held once in host memory, in the checkpoint's
dtype (an 8B model: ~16 GB in bf16). Needs the optional extra: ``pip install 'agoq[hf]'``. See docs/user-guide.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from agoq.convert.request import DEFAULT_MAX_SHARD_BYTES, EXPORT_DTYPES, IMPORT_DTYPES, ExportRequest, ImportRequest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agoq.convert", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf-to-agoq", allow_abbrev=False,
                         help="HF LlamaForCausalLM directory -> agoq/Megatron distributed checkpoint + model YAML")
    imp.add_argument("hf_dir", type=Path, help="directory with config.json and model(-*).safetensors")
    imp.add_argument("--output", type=Path, required=True, help="checkpoint directory to create (pass it to --load)")
    imp.add_argument("--config-out", type=Path, default=None,
                     help="model config YAML for scripts/pretrain_llama.py --config (default: OUTPUT/model.yaml)")
    imp.add_argument("--dtype", choices=IMPORT_DTYPES, default="auto",
                     help="tensor dtype in the checkpoint (auto: the HF files' bf16 / fp32, fp16 as fp32); the "
                          "trainer casts on load to its own (bf16, or fp32 with --fp32)")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="pad the vocabulary for this TP size (the padded rows must match the training run's)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="as scripts/pretrain_llama.py: rows are a multiple of this x the TP size")
    exp = sub.add_parser("agoq-to-hf", allow_abbrev=False,
                         help="agoq checkpoint (any layout) -> HF LlamaForCausalLM directory that transformers loads")
    exp.add_argument("load_dir", type=Path, help="checkpoint directory (the one given to --save / --load)")
    exp.add_argument("--output", type=Path, required=True, help="HF model directory to write")
    exp.add_argument("--iteration", type=int, default=None, help="iter_N to export (default: the latest)")
    exp.add_argument("--config", type=Path, default=None,
                     help="the run's model YAML (--config of pretrain_llama.py); needed only for checkpoints that do "
                          "not record their whole shape (saved before agoq recorded it); a value that differs from "
                          "the checkpoint's record is an error")
    exp.add_argument("--tokenizer-model", type=Path, default=None,
                     help="the run's tokenizer: gives the real vocabulary size and BOS/EOS ids and is copied next to "
                          "the weights")
    exp.add_argument("--vocab-size", type=int, default=None,
                     help="real vocabulary size (rows kept; default: the tokenizer's or the checkpoint's record)")
    exp.add_argument("--dtype", choices=EXPORT_DTYPES, default="bf16", help="safetensors dtype")
    exp.add_argument("--max-shard-size", type=int, default=DEFAULT_MAX_SHARD_BYTES, help="bytes per safetensors shard")
    return parser


def request_of(namespace: argparse.Namespace) -> ImportRequest | ExportRequest:
    """The one place the Namespace is read: the command's flags, typed and frozen."""
    values = {k: v for k, v in vars(namespace).items() if k != "command"}
    if namespace.command == ImportRequest.COMMAND:
        return ImportRequest(**values)
    values["max_shard_bytes"] = values.pop("max_shard_size")
    return ExportRequest(**values)


def main(argv: list[str] | None = None) -> int:
    request = request_of(build_parser().parse_args(argv))
    start = time.perf_counter()
    try:
        lines = hf_to_agoq(request) if isinstance(request, ImportRequest) else agoq_to_hf(request)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as exc:
        print(f"python -m agoq.convert {request.COMMAND}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    for line in lines:
        print(line, flush=True)
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


def _torch_dtype(name: str, source=None):
    import torch

    if name == "auto":
        return torch.float32 if source in (torch.float32, torch.float16) else torch.bfloat16
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def hf_to_agoq(request: ImportRequest) -> list[str]:
    from agoq.convert import hf_io, llama

    config = hf_io.read_config(request.hf_dir)
    dims = llama.dims_from_hf_config(config)
    generation = hf_io.read_generation_config(request.hf_dir)
    padded = llama.padded_rows(dims.vocab_size, request.make_vocab_size_divisible_by,
                               request.tensor_model_parallel_size)
    hf_state = hf_io.read_state_dict(request.hf_dir)
    dtype = _torch_dtype(request.dtype, hf_state["model.embed_tokens.weight"].dtype)
    state = llama.hf_to_megatron(hf_state, dims, padded)
    del hf_state

    from agoq.megatron.ckpt import hf_checkpoint
    from agoq.train.environment import launch_from_environment

    hf_checkpoint.init_single_process(launch_from_environment())
    shape = _shape(dims, padded)
    model = hf_checkpoint.build_model(shape, dtype)[0]
    hf_checkpoint.load_model_state(model, state)
    del state
    extra = {hf_checkpoint.HF_DIMS_KEY: dims.as_dict(), hf_checkpoint.PADDED_VOCAB_KEY: padded,
             hf_checkpoint.GENERATION_KEY: generation, "converted_from": str(request.hf_dir)}
    target = hf_checkpoint.save_weights_only(model, request.output, shape, extra)
    yaml_path = request.config_out or request.output / "model.yaml"
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    yaml_path.write_text(llama.config_yaml(dims, divisible_by=request.make_vocab_size_divisible_by,
                                           source=str(request.hf_dir), tp=request.tensor_model_parallel_size,
                                           padded_vocab=padded))  # fmt: skip
    return [f"checkpoint: {target} ({shape.num_parameters() / 1e6:.1f}M parameters, {_dtype_name(dtype)}, "
            f"vocabulary {dims.vocab_size} padded to {padded} rows)",
            f"model: {_describe(dims)}",
            f"model config: {yaml_path}",
            f"train: scripts/pretrain_llama.py --config {yaml_path} --load {request.output} "
            f"--tokenizer-model {request.hf_dir / 'tokenizer.json'} ..."]


def _shape(dims, padded: int):
    from agoq.megatron.model import LlamaShape

    scaled = dims.rope_scaling_factor is not None
    return LlamaShape(num_layers=dims.num_layers, hidden_size=dims.hidden_size,
                      num_attention_heads=dims.num_attention_heads, num_query_groups=dims.num_query_groups,
                      ffn_hidden_size=dims.ffn_hidden_size, seq_length=dims.max_position_embeddings,
                      vocab_size=padded, rotary_base=dims.rotary_base, norm_epsilon=dims.norm_epsilon,
                      init_method_std=dims.init_method_std, rope_scaling=scaled,
                      rope_scaling_factor=dims.rope_scaling_factor if scaled else 8.0,
                      share_embeddings_and_output_weights=dims.tie_word_embeddings,
                      unpadded_vocab_size=dims.vocab_size)  # fmt: skip


def _describe(dims) -> str:
    rope = (f"RoPE base {dims.rotary_base}, llama3 scaling factor {dims.rope_scaling_factor:g}"
            if dims.rope_scaling_factor is not None else f"RoPE base {dims.rotary_base}")
    tying = "tied" if dims.tie_word_embeddings else "untied"
    return f"{rope}; embeddings {tying}; RMSNorm eps {dims.norm_epsilon:g}; eos {dims.eos_token_id}"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def agoq_to_hf(request: ExportRequest) -> list[str]:
    import torch

    from agoq.convert import hf_io, llama
    from agoq.megatron.ckpt import hf_checkpoint
    from agoq.train.environment import launch_from_environment

    hf_checkpoint.init_single_process(launch_from_environment())
    source = hf_checkpoint.checkpoint_source(request.load_dir, request.iteration)
    extras = hf_checkpoint.saved_extras(source)
    dims, padded, assumed = _export_dims(request, extras)
    dtype = _torch_dtype(request.dtype)
    # read in fp32 (exact for bf16 and fp32 checkpoints; Megatron keeps RMSNorm gains in fp32 in any case),
    # then round every tensor to the output dtype once
    model = hf_checkpoint.build_model(_shape(dims, padded), torch.float32)[0]
    hf_checkpoint.load_weights([model], source)
    state = {k: v.to(dtype) for k, v in llama.megatron_to_hf(hf_checkpoint.model_state(model), dims).items()}
    files = hf_io.write_model_dir(request.output, state, llama.hf_config(dims, dtype),
                                  max_shard_bytes=request.max_shard_bytes)
    hf_io.write_generation_config(request.output, _generation_config(extras, dims))
    copied = hf_io.copy_tokenizer(request.tokenizer_model, request.output) if request.tokenizer_model else []
    return [f"exported {source} -> {request.output}: {len(files)} safetensors file{'s' if len(files) > 1 else ''}, "
            f"{_dtype_name(dtype)}, vocabulary {dims.vocab_size} (of {padded} rows)"
            + (f"; tokenizer files: {', '.join(p.name for p in copied)}" if copied else ""),
            f"model: {_describe(dims)}; config.json + generation_config.json written"] + [
            f"note: {source} does not record {field} (saved before agoq recorded it) and --config gives none: "
            f"exported with the trainer's default {value!r}; pass the run's --config if it trained with another"
            for field, value in assumed]


def _generation_config(extras: dict, dims) -> dict:
    """The converted model's generation_config.json (carried by the checkpoint), else one with its token ids."""
    from agoq.megatron.ckpt.hf_checkpoint import hf_identity

    recorded = hf_identity(extras)[1]
    if recorded is not None:
        return recorded
    return {k: v for k, v in (("bos_token_id", dims.bos_token_id), ("eos_token_id", dims.eos_token_id))
            if v is not None}


# the model YAML's keys (trainer flags) -> the checkpoint record's fields, and how the YAML value reads as one
_YAML_TO_RECORD = {
    "num_layers": ("num_layers", int), "hidden_size": ("hidden_size", int),
    "num_attention_heads": ("num_attention_heads", int), "num_query_groups": ("num_query_groups", int),
    "ffn_hidden_size": ("ffn_hidden_size", int), "rotary_base": ("rotary_base", int),
    "norm_epsilon": ("norm_epsilon", float), "use_rope_scaling": ("rope_scaling", bool),
    "rope_scaling_factor": ("rope_scaling_factor", float),
    "untie_embeddings_and_output_weights": ("share_embeddings_and_output_weights", lambda v: not v),
}


def _trainer_defaults() -> dict:
    """scripts/pretrain_llama.py's defaults (its parser, agoq.cli.flags) as record fields: what an export
    uses where neither the checkpoint's record nor a --config gives a value."""
    from agoq.cli.flags import build_parser

    parser = build_parser()
    defaults = {field: read(parser.get_default(key)) for key, (field, read) in _YAML_TO_RECORD.items()
                if parser.get_default(key) is not None}
    return defaults  # num_query_groups / ffn_hidden_size: derived from the others (None in the parser)


def _export_dims(request: ExportRequest, extras: dict):
    """(LlamaDims, padded rows, [(field, value) taken from the trainer's defaults]): the checkpoint's record (its
    whole model shape, and a converted model's HF identity); a --config YAML fills only what an older checkpoint
    did not record, and a value of it that differs from the record is an error naming both; what neither gives is
    the trainer's default, reported. Token ids: the converted model's, else the tokenizer's."""
    from agoq.convert import llama
    from agoq.megatron.ckpt.hf_checkpoint import PADDED_VOCAB_KEY, hf_identity, saved_shape

    recorded = dict(saved_shape(extras))
    hf_dims, _ = hf_identity(extras)
    hf = llama.LlamaDims(**hf_dims) if hf_dims is not None else None
    if hf is not None:  # a converted checkpoint (or a run from one): its HF config fills what older records lack
        for field, value in (("rotary_base", hf.rotary_base), ("norm_epsilon", hf.norm_epsilon),
                             ("rope_scaling", hf.rope_scaling_factor is not None),
                             ("rope_scaling_factor", hf.rope_scaling_factor or 8.0),
                             ("share_embeddings_and_output_weights", hf.tie_word_embeddings)):
            recorded.setdefault(field, value)
        recorded.setdefault("vocab_size", extras.get(PADDED_VOCAB_KEY))
    values = _yaml_values(request.config, recorded) if request.config is not None else {}
    missing = [f for f in ("rotary_base", "norm_epsilon", "num_layers") if f not in recorded and f not in values]
    if missing and request.config is None:
        raise ValueError(f"{request.load_dir} does not record its whole model shape ({', '.join(missing)}: saved "
                         "before agoq recorded it): pass the run's --config YAML")  # fmt: skip
    defaults = _trainer_defaults()
    shape = {**defaults, **values, **recorded}
    assumed = [(field, value) for field, value in defaults.items() if field not in values and
               field not in recorded and not (field == "rope_scaling_factor" and not shape["rope_scaling"])]
    shape.setdefault("num_query_groups", shape["num_attention_heads"])
    shape.setdefault("ffn_hidden_size", 64 * -(-int(8 * shape["hidden_size"] / 3) // 64))
    padded = recorded.get("vocab_size")
    if padded is None:
        raise ValueError("the checkpoint has no resume record (saved before agoq recorded one): its vocabulary is "
                         "unknown")  # fmt: skip
    vocab, bos, eos = _vocab_from_tokenizer(request.tokenizer_model)
    known = recorded.get("unpadded_vocab_size") or (hf.vocab_size if hf is not None else None)
    if vocab is not None and known is not None and vocab != known and request.vocab_size is None:
        raise ValueError(f"--tokenizer-model {request.tokenizer_model} has {vocab} tokens, but the checkpoint was "
                         f"trained with a vocabulary of {known}; pass the run's tokenizer (or --vocab-size)")
    vocab = request.vocab_size or vocab or known or padded
    if vocab > padded:
        raise ValueError(f"vocabulary {vocab} is larger than the checkpoint's {padded} embedding rows")
    context = hf.max_position_embeddings if hf is not None else int(values.get("seq_length",
                                                                               recorded.get("seq_length", 128)))
    dims = llama.LlamaDims(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], num_query_groups=shape["num_query_groups"],
        ffn_hidden_size=shape["ffn_hidden_size"], vocab_size=vocab, rotary_base=int(shape["rotary_base"]),
        norm_epsilon=float(shape["norm_epsilon"]), max_position_embeddings=context,
        init_method_std=hf.init_method_std if hf is not None else float(values.get("init_method_std", 0.02)),
        bos_token_id=hf.bos_token_id if hf is not None and hf.bos_token_id is not None else bos,
        eos_token_id=hf.eos_token_id if hf is not None and hf.eos_token_id is not None else eos,
        rope_scaling_factor=float(shape["rope_scaling_factor"]) if shape["rope_scaling"] else None,
        tie_word_embeddings=bool(shape["share_embeddings_and_output_weights"]),
    )  # fmt: skip
    return dims, padded, assumed


def _yaml_values(path: Path, recorded: dict) -> dict:
    """The YAML's model values as record fields (plus seq_length, init_method_std); one that differs from the
    checkpoint's record raises naming both."""
    import yaml

    raw = yaml.safe_load(path.read_text()) or {}
    values = {}
    for key, (field, read) in _YAML_TO_RECORD.items():
        if key not in raw:
            continue
        value = read(raw[key])
        if field == "rope_scaling_factor" and not raw.get("use_rope_scaling", recorded.get("rope_scaling")):
            continue  # a factor without scaling is not part of the model
        if field in recorded and recorded[field] != value:
            raise ValueError(f"{path}: {key} {raw[key]!r}, but the checkpoint was saved with {field} "
                             f"{recorded[field]!r}; drop the key (the checkpoint's value is used) or pass the run's "
                             "own --config")  # fmt: skip
        values[field] = value
    for key in ("seq_length", "init_method_std"):
        if key in raw:
            values[key] = raw[key]
    return values


def _vocab_from_tokenizer(path: Path | None):
    if path is None:
        return None, None, None
    from agoq.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(path)
    bos = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
    try:
        eos = tokenizer.eod_id
    except ValueError:
        eos = None
    return tokenizer.vocab_size, bos, eos


if __name__ in ("__main__", "__mp_main__") and os.environ.get("AGOQ_SHOW_KNOWN_WARNINGS") != "1":
    # megatron-core / torch warnings known to be harmless (as scripts/pretrain_llama.py), before torch loads; also
    # in the checkpoint writer's process, which re-imports this module as __mp_main__
    from agoq.train.known_warnings import filter_known_warnings

    filter_known_warnings()

if __name__ == "__main__":
    sys.exit(main())
