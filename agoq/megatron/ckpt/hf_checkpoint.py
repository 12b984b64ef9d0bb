"""The Megatron side of ``python -m agoq.convert``: a TP=1 / PP=1 ``GPTModel`` in one CPU process, weights-only
distributed checkpoints written from it, and the model weights of any agoq checkpoint read into it.

Seam card
---------
Touches: ``dist_checkpointing.save`` / ``load`` / ``load_common_state_dict`` and
  ``MegatronModule.sharded_state_dict`` (public API), through agoq's model builder.
Why: Megatron's distributed checkpoint is keyed by global tensor names and whole-tensor shapes
  (``decoder.layers.<global index>...``; TP cuts ``linear_qkv`` into whole GQA groups and the gated
  ``linear_fc1`` into matching gate / up halves), so a checkpoint written from the TP=1 / PP=1 model loads
  into every TP / PP / VPP / DP layout whose padded vocabulary is the same, and a checkpoint written by any
  layout reads back into the TP=1 / PP=1 model.
Verified on: megatron-core 0.19.2 (CPU gloo).
Guarded by: ``tests/megatron/test_hf_convert.py`` (logits against transformers at TP=1 and PP=2, export /
  import / export bit-identical, a converted checkpoint trains under scripts/pretrain_llama.py).

A converted checkpoint is ``<dir>/iter_0000000/`` + ``latest_checkpointed_iteration.txt`` with the model's
tensors only; its common state says so (``agoq.weights_only``) and carries the model-shape part of the
resume record (:data:`CONVERTED_SHAPE_FIELDS`: widths, padded and real vocabulary, RoPE base and scaling, norm epsilon,
tying), so ``--load`` checks the shape, loads the weights and starts the optimizer, LR schedule and
data position fresh (``agoq.megatron.ckpt.load``). It also keeps the HF model's identity (``hf_dims``: token ids,
an eos list as a list, context; ``hf_generation_config``), which the trainer carries into its own checkpoints'
run record (:func:`carry_hf_identity`) so that ``agoq-to-hf`` writes them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from agoq.megatron import runtime
from agoq.megatron.ckpt.ckpt_files import PROGRESS_FILE, TRACKER_FILE, iteration_dir, latest_iteration
from agoq.megatron.ckpt.resume import CONTRACT_KEY, RECORD_KEY, SHAPE_FIELDS_LATER
from agoq.megatron.ckpt.state import WEIGHTS_ONLY_KEY, Progress
from agoq.megatron.model import (
    LlamaShape,
    ParallelLayout,
    agoq_layer_spec,
    build_model_chunks,
    llama_transformer_config,
)
from agoq.plan.shape import SHAPE_FIELDS

# the model's size (agoq.plan.shape) and the rest of its shape that run records keep (agoq.megatron.ckpt.resume)
CONVERTED_SHAPE_FIELDS = (*SHAPE_FIELDS, *SHAPE_FIELDS_LATER)
# a converted checkpoint's common state: the HF architecture (agoq.convert.llama.LlamaDims as a dict), the padded
# rows, the HF generation_config.json (dict or None); the trainer carries the first and last into its run record
HF_DIMS_KEY = "hf_dims"
PADDED_VOCAB_KEY = "padded_vocab_size"
GENERATION_KEY = "hf_generation_config"
HF_RECORD_KEY = "hf"  # in the run record: {"dims": ..., "generation_config": ...}


def init_single_process(launch: runtime.LaunchInfo) -> None:
    """agoq's CPU mode, a world-of-one gloo group and TP=1 / PP=1 model parallelism (idempotent). ``launch``: how
    the process was started (the converter's command line reads it from torchrun's environment); a launch of more
    than one process is refused."""
    from agoq.config import AgoqConfig
    from agoq.megatron.install import install

    device = torch.device("cpu")
    install(AgoqConfig(enabled=False, device="cpu"))
    if not dist.is_initialized():
        runtime.init_distributed(device, launch)
    if dist.get_world_size() != 1:
        raise RuntimeError("the converter runs in one process (it builds the TP=1 / PP=1 model); run it without "
                           "torchrun")
    if not parallel_state.model_parallel_is_initialized():
        runtime.init_model_parallel(ParallelLayout(), seed=0, device=device)


def build_model(shape: LlamaShape, dtype: torch.dtype, layout: ParallelLayout | None = None) -> list:
    """This rank's GPTModel chunks (unwrapped: no DDP, no Float16Module) with the trainer's layer names."""
    layout = layout or ParallelLayout()
    config = llama_transformer_config(shape, layout, params_dtype=dtype, use_cpu_initialization=True)
    with torch.device("cpu"):
        return build_model_chunks(shape, config, agoq_layer_spec("sdpa"), layout.vpp)


def model_state(model) -> dict[str, torch.Tensor]:
    """The TP=1 / PP=1 model's tensors by name (Megatron's ``_extra_state`` entries left out)."""
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def load_model_state(model, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the model; every parameter must be given, with its shape (dtype is cast)."""
    live = model_state(model)
    missing, unexpected = sorted(set(live) - set(state)), sorted(set(state) - set(live))
    if missing or unexpected:
        raise KeyError(f"converted state does not match agoq's model: missing {missing[:6]}, "
                       f"unexpected {unexpected[:6]}")
    with torch.no_grad():
        for name, tensor in live.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: converted shape {tuple(state[name].shape)}, agoq's model "
                                 f"{tuple(tensor.shape)}")
            tensor.copy_(state[name])


def save_weights_only(model, save_dir: str | os.PathLike, shape: LlamaShape, extra: dict) -> Path:
    """``save_dir/iter_0000000`` with the model's tensors, its shape record and ``extra``; then the tracker."""
    target = iteration_dir(save_dir, 0)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists; pass an empty or new output directory")
    target.mkdir(parents=True, exist_ok=True)
    record = {field: getattr(shape, field) for field in CONVERTED_SHAPE_FIELDS}
    agoq = dict(extra, **{WEIGHTS_ONLY_KEY: True, CONTRACT_KEY: record})
    dist_checkpointing.save({"model": model.sharded_state_dict(), "agoq": agoq}, str(target))
    (target / PROGRESS_FILE).write_text(
        json.dumps(Progress(iteration=0, consumed_samples=0).__dict__, indent=1) + "\n")
    (Path(save_dir) / TRACKER_FILE).write_text("0\n")
    return target


def checkpoint_source(load_dir: str | os.PathLike, iteration: int | None = None) -> Path:
    """The ``iter_N`` directory to read: ``iteration``, else the tracker's."""
    if iteration is None:
        iteration = latest_iteration(load_dir)
        if iteration is None:
            raise FileNotFoundError(f"{load_dir}: no {TRACKER_FILE}; pass the directory given to --save")
    source = iteration_dir(load_dir, iteration)
    if not source.is_dir():  # it used to read 'not a complete agoq checkpoint', as if the directory were there
        saved = sorted(int(d.name[len("iter_"):]) for d in Path(load_dir).glob("iter_*") if d.name[5:].isdigit())
        raise FileNotFoundError(f"{load_dir}: no checkpoint of iteration {iteration} ({source.name} does not exist); "
                                f"saved iterations: {', '.join(map(str, saved)) or 'none'}. Pass one of them, or "
                                "leave --iteration out for the latest")
    if not (source / PROGRESS_FILE).is_file():
        raise FileNotFoundError(f"{source}: not a complete agoq checkpoint ({PROGRESS_FILE} missing)")
    return source


def saved_extras(source: Path) -> dict:
    """The checkpoint's ``agoq`` common state (resume record, weights-only marker, conversion record)."""
    return dist_checkpointing.load_common_state_dict(str(source)).get("agoq", {})


def saved_shape(extras: dict) -> dict:
    """The model shape a checkpoint recorded (``vocab_size`` padded): the flat resume record of converted and
    older checkpoints, or the run record's ``model`` section; {} when it has neither."""
    return extras.get(CONTRACT_KEY) or (extras.get("config") or {}).get("model") or {}


def hf_identity(extras: dict) -> tuple[dict | None, dict | None]:
    """(HF dims, generation config) a checkpoint carries: a converted one's own, or the run record's copy of the
    converted checkpoint a training run started from; (None, None) for a model trained from scratch."""
    if HF_DIMS_KEY in extras:
        return extras[HF_DIMS_KEY], extras.get(GENERATION_KEY)
    carried = (extras.get(RECORD_KEY) or {}).get(HF_RECORD_KEY) or {}
    return carried.get("dims"), carried.get("generation_config")


def carry_hf_identity(loaded_extras: dict, record: dict) -> None:
    """The trainer, after --load: keep the HF identity of a converted checkpoint (token ids, generation config,
    context) in the run record every later checkpoint saves, so agoq-to-hf exports them."""
    dims, generation = hf_identity(loaded_extras)
    if dims is not None:
        record[HF_RECORD_KEY] = {"dims": dims, "generation_config": generation}


def load_weights(chunks: list, source: Path) -> None:
    """Read the model tensors of ``source`` (any layout, with or without optimizer state) into this rank's
    unwrapped chunks; the padded vocabulary and the shapes must match."""
    if len(chunks) == 1:
        template = {"model": chunks[0].sharded_state_dict()}
    else:
        template = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    state = dist_checkpointing.load(template, str(source))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"])
