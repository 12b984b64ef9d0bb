"""Never silent: after the model, its DDP and the optimizer are built, check that what the run's ``AgoqConfig`` asks
for is what was built, on every rank, before the first step. Used by both trainers: agoq's own
(agoq/train/pretrain.py) and Megatron-LM's ``megatron.training`` through agoq's door
(agoq/megatron/megatron_lm.py wraps ``setup_model_and_optimizer`` with :func:`check_built`).

What is checked, with agoq on (``config.enabled``; ``--agoq-disable`` asks for nothing):

* every transformer layer of this rank's model chunks is agoq's ``AgoqTransformerLayer``, with agoq's norms,
  linears and MLP (agoq.megatron.activations.agoq_modules), and stores per the policy: the layer's resolved
  storage equals the policy's at the layer's site (global index, pipeline rank, virtual stage; the storage rule
  of agoq.plan.storage under the run's schedule), and each module got that role's format / recompute setting;
* the core attention is the one asked for (agoq's SDPA attention or Megatron's ``DotProductAttention``);
* FP8 (``--agoq-fp8``): each layer's linears carry the recipe the FP8 rule gives the layer (first / last layers bf16);
* 8-bit gradients (``--agoq-grads FORMAT``): every chunk is agoq's ``AgoqDistributedDataParallel`` with that format
  and mode; otherwise none is;
* agoq's optimizer (``--agoq-optimizer adamw|lion|sgd``): the optimizer is agoq's (its Megatron interface:
  ``AgoqMegatronOptimizer`` or, with the distributed optimizer, ``AgoqDistributedOptimizer``); otherwise it is not;
  with the 8-bit gradient store and agoq's optimizer, the optimizer reads the 8-bit gradients (a grad reader).

A mismatch raises :class:`BuiltMismatch` naming each missing piece and why it is missing (which layer spec, DDP
class or optimizer factory was used instead, and how to get agoq's).

Seam card
---------
Touches (read-only): the built chunks (``Float16Module`` / DDP ``.module`` chains, ``GPTModel.decoder.layers``,
  ``GPTModel.vp_stage``, ``TransformerLayer.layer_number`` / ``pg_collection`` / ``config`` /
  ``self_attention.core_attention``), Megatron's ``DistributedDataParallel`` and optimizer classes.
Why: the door to Megatron-LM builds through Megatron's own construction paths (its model builder or a model provider,
  its DDP and optimizer factories); a path agoq does not reach would otherwise train without agoq and exit 0.
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_built_check.py`` (each mismatch named), ``tests/megatron/test_megatron_lm_door.py``
  (both construction paths; the old hooks without the door stop before the first step).
"""

from __future__ import annotations

from dataclasses import dataclass

from agoq.config import AgoqConfig, flag_for
from agoq.policy import ScheduleInfo

__all__ = ["BuiltMismatch", "Expectation", "any_rank_failed", "built_problems", "built_summary", "check_built"]


class BuiltMismatch(RuntimeError):
    """What the run's flags asked of agoq is not what was built (the message lists each piece and why). ``local``:
    False when this rank built what was asked and stops because another rank did not."""

    def __init__(self, message: str, *, local: bool = True):
        super().__init__(message)
        self.local = local


@dataclass(frozen=True)
class Expectation:
    """What the run asked for beyond ``AgoqConfig``: the core attention ("sdpa" or "megatron") and the schedule the
    policy is resolved under (pipeline / virtual sizes, micro-batches per step: a policy's ``auto`` bits)."""

    attention: str
    schedule: ScheduleInfo
    transformer_engine: bool = False
    """Megatron's TE spec (``--transformer-impl transformer_engine``): TE's modules with agoq's saved-activation scopes
    (agoq.megatron.saved_scopes) instead of agoq's layers."""
    how_to_fix: str = ""
    """Appended to the message: how to build agoq's model on this entry (the door names itself)."""


def _unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    seen = 0
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder") and seen < 8:
        chunk, seen = chunk.module, seen + 1
    return chunk


def _spans(numbers: list[int]) -> str:
    """'1-3, 5' for [1, 2, 3, 5]."""
    out, start, prev = [], None, None
    for n in sorted(numbers):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = n
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def _qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _te_layer_problems(config: AgoqConfig, expect: Expectation, chunks: list) -> list[str]:
    """With Transformer Engine: every layer is built from TE's modules and carries the policy's scopes."""
    from agoq.megatron.saved_scopes import layer_positions, scope_problems

    problems, not_te = [], []
    layers = layer_positions(chunks)
    for layer, pos in layers:
        number = pos.layer_idx + 1
        qkv = getattr(getattr(layer, "self_attention", None), "linear_qkv", None)
        if "transformer_engine" not in type(qkv).__module__:
            not_te.append(number)
            continue
        wrong = scope_problems(layer, pos, config.policy.spec, expect.schedule)
        if wrong:
            problems.append(f"layer {number}: {'; '.join(wrong)}")
    if not layers and chunks:
        problems.append("no transformer layer in this rank's model chunks")
    if not_te:
        problems.append(f"layers {_spans(not_te)} are not built from Transformer Engine's modules although "
                        "--transformer-impl transformer_engine was asked for")
    return problems


def _layer_problems(config: AgoqConfig, expect: Expectation, chunks: list) -> list[str]:
    if expect.transformer_engine:
        return _te_layer_problems(config, expect, chunks)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from agoq.megatron.activations import agoq_modules
    from agoq.megatron.attention import SDPACoreAttention
    from agoq.megatron.compute import layer_compute
    from agoq.megatron.sites import position_of
    from agoq.megatron.transformer_layer import AgoqTransformerLayer
    from agoq.plan.storage import RECOMPUTED, layer_storage

    not_agoq: dict[str, list[int]] = {}  # class name -> 1-based layer numbers
    problems: list[str] = []
    wrong_attention: dict[str, list[int]] = {}
    wanted_attention = SDPACoreAttention if expect.attention == "sdpa" else DotProductAttention
    layers_seen = 0
    for chunk in chunks:
        model = _unwrap(chunk)
        decoder = getattr(model, "decoder", None)
        if decoder is None:
            problems.append(f"model chunk {_qualname(model)} has no transformer decoder agoq recognises (a GPTModel)")
            continue
        for layer in decoder.layers:
            layers_seen += 1
            number = layer.layer_number
            core = layer.self_attention.core_attention
            if type(core) is not wanted_attention and not isinstance(core, wanted_attention):
                wrong_attention.setdefault(_qualname(core), []).append(number)
            if not isinstance(layer, AgoqTransformerLayer) or layer.agoq_options is None:
                not_agoq.setdefault(_qualname(layer), []).append(number)
                continue
            try:
                modules = agoq_modules(layer)
            except ValueError as error:
                problems.append(str(error))
                continue
            position = position_of(layer.config, number, layer.pg_collection.pp, getattr(model, "vp_stage", None))
            built = layer.agoq_options.storage
            wanted = layer_storage(config.policy.spec, position.site, expect.schedule)
            if built is None or built.roles != wanted.roles:
                problems.append(f"layer {number}: stores {_describe(built)}, the policy asks {_describe(wanted)} at "
                                f"its site (pipeline rank {position.pp_rank}, virtual stage {position.vp_stage})")
                continue
            problems += _module_problems(number, modules, wanted, RECOMPUTED)
            if config.fp8.fp8_enabled:
                fp8 = layer_compute(config.fp8, position.layer_idx, layer.config.num_layers)["fp8"]
                linears = [modules[n] for n in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")]
                if any((getattr(m, "agoq_fp8", None) is None) != (fp8 is None) for m in linears):
                    problems.append(f"layer {number}: its linears' FP8 recipes are not the {flag_for('fp8.recipe')} "
                                    f"rule's ({'FP8' if fp8 else 'bf16'} for this layer)")
    if layers_seen == 0 and chunks:
        problems.append("no transformer layer in this rank's model chunks")
    for name, numbers in sorted(not_agoq.items()):
        problems.append(f"layers {_spans(numbers)} are {name}, not agoq's AgoqTransformerLayer: the model was built "
                        "from a layer spec without agoq's modules, so no activation is stored per the policy")
    for name, numbers in sorted(wrong_attention.items()):
        problems.append(f"layers {_spans(numbers)}: core attention is {name}, not {_qualname(wanted_attention)} "
                        f"(--agoq-attention {expect.attention})")
    return problems


def _describe(storage) -> str:
    if storage is None:
        return "nothing of agoq's (no policy reached the layer)"
    return ", ".join(f"{r.role} {r.describe()}" for r in storage.roles.values())


_ROLE_MODULES = (("input_layernorm", "norm.input"), ("pre_mlp_layernorm", "norm.input"),
                 ("linear_qkv", "attn.qkv_input"), ("linear_proj", "attn.proj_input"),
                 ("linear_fc1", "mlp.fc1_input"), ("linear_fc2", "mlp.fc2_input"), ("mlp", "mlp.swiglu_input"))


def _module_problems(number: int, modules: dict, wanted, recomputed: str) -> list[str]:
    wrong = []
    for name, role in _ROLE_MODULES:
        save = modules[name].agoq_save
        want = wanted.roles[role]
        if save.fmt != want.fmt or (name.startswith("linear") and save.recomputed != (want.how == recomputed)):
            wrong.append(f"{name} ({role}: built {save.fmt.name if save.fmt else 'no quantized save'}"
                         f"{', recomputed' if save.recomputed else ''}; policy {want.describe()})")
    return [f"layer {number}: {'; '.join(wrong)}"] if wrong else []


def _ddp_problems(config: AgoqConfig, chunks: list) -> list[str]:
    from megatron.core.distributed import DistributedDataParallel

    from agoq.megatron.grads.ddp import AgoqDistributedDataParallel

    problems = []
    grads = config.grads
    for idx, chunk in enumerate(chunks):
        if config.optimizer.gradient_release:  # agoq's ReleaseDataParallel: the optimizer steps inside backward
            from agoq.megatron.optim.release import ReleaseDataParallel

            if not isinstance(chunk, ReleaseDataParallel):
                problems.append(f"model chunk {idx} is {_qualname(chunk)}, not agoq's ReleaseDataParallel that "
                                f"{flag_for('optimizer.gradient_release')} asks for")
        elif grads.quantized:
            grad = getattr(chunk, "agoq_grads", None)
            if not isinstance(chunk, AgoqDistributedDataParallel) or grad is None:
                problems.append(f"model chunk {idx} is wrapped by {_qualname(chunk)}, not agoq's 8-bit gradient DDP "
                                "(agoq.megatron.grads.ddp.AgoqDistributedDataParallel) that "
                                f"{flag_for('grads.format')} {grads.format} "
                                "asks for: the DDP class this construction path uses was not agoq's")
            elif (grad.format, grad.mode) != (grads.format, grads.mode):
                problems.append(f"model chunk {idx}: 8-bit gradients {grad.format} ({grad.mode} mode), asked "
                                f"{grads.format} ({grads.mode} mode)")
        elif isinstance(chunk, AgoqDistributedDataParallel):
            problems.append(f"model chunk {idx} is agoq's 8-bit gradient DDP, but no {flag_for('grads.format')} format "
                            "was asked")
        elif not isinstance(chunk, DistributedDataParallel):
            problems.append(f"model chunk {idx} is {_qualname(chunk)}, not Megatron's DistributedDataParallel "
                            "(agoq's gradients and optimizer hook its buffers)")
    return problems


def _optimizer_problems(config: AgoqConfig, optimizer) -> list[str]:
    from agoq.megatron.optim.dist_optimizer import AgoqDistributedOptimizer
    from agoq.megatron.optim.megatron_optimizer import AgoqMegatronOptimizer

    if optimizer is None:
        return []
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    agoq_parts = [p for p in parts if isinstance(p, (AgoqMegatronOptimizer, AgoqDistributedOptimizer))]
    opt = config.optimizer
    if opt.agoq and len(agoq_parts) != len(parts):
        names = ", ".join(_qualname(p) for p in parts if p not in agoq_parts)
        return [f"the optimizer is {names}, not agoq's {opt.kind} (agoq.megatron.optim.optimizer) that "
                f"{flag_for('optimizer.kind')} "
                f"{opt.kind} asks for: Megatron's optimizer factory was called instead of agoq's"]
    if not opt.agoq and agoq_parts:
        return [f"the optimizer is agoq's ({_qualname(agoq_parts[0])}), but {flag_for('optimizer.kind')} is torch"]
    if opt.agoq and config.grads.quantized and config.grads.mode == "store":
        unread = [_qualname(p) for p in parts if getattr(p, "grad_reader", None) is None]
        if unread:
            return [f"the optimizer ({', '.join(unread)}) has no reader of the 8-bit gradient store "
                    "(agoq.megatron.grads.grad_reader.attach was not called on it)"]
    return []


def built_problems(config: AgoqConfig, model_chunks: list, optimizer, expect: Expectation) -> list[str]:
    """What of ``config`` this rank's built ``model_chunks`` (DDP-wrapped) and ``optimizer`` (None: not built yet)
    lack; empty when everything asked for was built (always empty with agoq disabled)."""
    if not config.enabled:
        return []
    return (_layer_problems(config, expect, model_chunks) + _ddp_problems(config, model_chunks)
            + _optimizer_problems(config, optimizer))


def check_built(config: AgoqConfig, model_chunks: list, optimizer, expect: Expectation, *, rank: int | None = None,
                agree=None) -> None:
    """Raise :class:`BuiltMismatch` when :func:`built_problems` finds anything. ``agree(failed: bool) -> bool``
    (optional): a collective returning whether any rank failed, so every rank stops together (a rank that passes
    raises naming the failure elsewhere); ``rank`` goes into the message."""
    problems = built_problems(config, model_chunks, optimizer, expect)
    anywhere = agree(bool(problems)) if agree is not None else bool(problems)
    if not anywhere:
        return
    where = "" if rank is None else f" (rank {rank})"
    if not problems:
        raise BuiltMismatch(f"agoq: another rank built something else than the --agoq-* flags ask for{where}; see its "
                            "message", local=False)
    fix = f" {expect.how_to_fix}" if expect.how_to_fix else ""
    raise BuiltMismatch(f"agoq: the run asks for what was not built{where}, stopping before the first step: "
                        + " | ".join(problems) + "." + fix)


def any_rank_failed(failed: bool) -> bool:
    """``check_built``'s ``agree``: whether any rank of the world failed (a MAX all-reduce over the default group;
    NCCL needs a CUDA tensor). Without an initialised process group: this rank's answer."""
    import torch

    if not torch.distributed.is_initialized():
        return failed
    backend = str(torch.distributed.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    flag = torch.tensor([int(failed)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def built_summary(model_chunks: list, optimizer) -> str:
    """One line naming what this rank built: its transformer layers' and core attentions' classes, the DDP class (and
    its parent agoq or Megatron class, its 8-bit gradient format) and the optimizer class."""
    from megatron.core.distributed import DistributedDataParallel

    from agoq.megatron.grads.ddp import AgoqDistributedDataParallel

    layers: dict[str, int] = {}
    attention: set[str] = set()
    for chunk in model_chunks:
        decoder = getattr(_unwrap(chunk), "decoder", None)
        for layer in getattr(decoder, "layers", ()):
            layers[type(layer).__name__] = layers.get(type(layer).__name__, 0) + 1
            attention.add(type(layer.self_attention.core_attention).__name__)
    ddp = []
    for chunk in model_chunks:
        base = AgoqDistributedDataParallel if isinstance(chunk, AgoqDistributedDataParallel) else \
            DistributedDataParallel if isinstance(chunk, DistributedDataParallel) else None
        grad = getattr(chunk, "agoq_grads", None)
        parent = f" ({base.__name__}" if base is not None and base is not type(chunk) else " ("
        ddp.append(type(chunk).__name__ + parent
                   + (f", 8-bit gradients {grad.format} {grad.mode} mode)" if grad is not None else ")"))
    parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    return (f"layers {', '.join(f'{n} x{c}' for n, c in layers.items()) or 'none'} (core attention "
            f"{', '.join(sorted(attention)) or 'none'}) | DDP {', '.join(dict.fromkeys(ddp)).replace(' ()', '')} | "
            f"optimizer {', '.join(type(p).__name__ for p in parts)}")
