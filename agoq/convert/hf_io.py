"""Hugging Face model directories: ``config.json`` + safetensors (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``), read and written with the ``safetensors`` package (optional extra ``[hf]``).

Writing is deterministic (sorted tensor names, fixed metadata, no timestamps), so exporting the same
weights twice gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1000**3  # transformers' save_pretrained default (5 GB)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as err:
        raise ValueError("reading and writing Hugging Face checkpoints needs the optional extra: "
                         "pip install 'agoq[hf]' (safetensors)") from err  # fmt: skip
    return safetensors


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a Hugging Face model directory (config.json + safetensors)")
    return json.loads(path.read_text())


GENERATION_FILE = "generation_config.json"


def read_generation_config(model_dir: str | os.PathLike) -> dict | None:
    """The directory's ``generation_config.json`` (token ids and sampling defaults), None without one."""
    path = Path(model_dir) / GENERATION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_generation_config(out_dir: str | os.PathLike, config: dict) -> Path:
    path = Path(out_dir) / GENERATION_FILE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The weight files of a HF directory: the index's shards, else ``model.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = [model_dir / SINGLE_FILE]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = f" (found {', '.join(bins)}: re-save with safe_serialization=True)" if bins else ""
        raise FileNotFoundError(f"{model_dir}: missing {', '.join(missing)}{hint}")
    return files


def read_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the directory (all shards), on the CPU, in the file's dtype."""
    safetensors = _safetensors()
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key in state:
                    raise ValueError(f"{path}: tensor {key} appears in two shards")
                state[key] = f.get_tensor(key)
    return state


def write_model_dir(out_dir: str | os.PathLike, state: dict[str, torch.Tensor], config: dict, *,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """``config.json`` + safetensors (sharded above ``max_shard_bytes``, with transformers' index file)."""
    safetensors = _safetensors()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    written = []
    for stale in [out_dir / SINGLE_FILE, out_dir / INDEX_FILE, *out_dir.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file({n: state[n].contiguous() for n in shard}, str(out_dir / file),
                                    metadata={"format": "pt"})  # fmt: skip
        weight_map.update(dict.fromkeys(shard, file))
        written.append(out_dir / file)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


def copy_tokenizer(tokenizer_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Put the run's tokenizer next to the exported weights: a ``tokenizer.json`` (with its
    ``tokenizer_config.json`` / ``special_tokens_map.json`` when present) or a SentencePiece
    ``tokenizer.model``."""
    src = Path(tokenizer_path)
    out_dir = Path(out_dir)
    if src.suffix == ".json":
        pairs = [(src, "tokenizer.json")] + [(src.parent / n, n) for n in ("tokenizer_config.json",
                                                                            "special_tokens_map.json")]
    else:
        pairs = [(src, "tokenizer.model")]
    copied = []
    for source, name in pairs:
        if source.is_file() and source.resolve() != (out_dir / name).resolve():
            shutil.copyfile(source, out_dir / name)
            copied.append(out_dir / name)
    return copied
