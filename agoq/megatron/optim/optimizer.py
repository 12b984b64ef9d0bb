"""Megatron glue for agoq.optim: build_agoq_optimizer(config, megatron_config, model_chunks) -> optimizer,
the agoq counterpart of Megatron's get_megatron_optimizer (agoq.train.megatron_setup.build_optimizer). ``config``
is the run's AgoqConfig (its ``optimizer`` section: kind, state formats, master; ``grads.reduce_in_bf16``);
``megatron_config`` is Megatron's OptimizerConfig (lr, weight decay, Adam betas / eps, clipping, dtype,
distributed optimizer) that the trainer builds; the trainer builds the LR schedule too.

Without --use-distributed-optimizer: agoq.megatron.optim.megatron_optimizer.AgoqMegatronOptimizer (agoq's optimizer on
the bf16 params inside Megatron's FP32Optimizer wrapper; no fp32 main-param copy); with --agoq-gradient-release:
agoq.megatron.optim.release.AgoqReleaseOptimizer. Megatron's LR schedule writes group["lr"] / group["weight_decay"]
(wd_mult 0 for biases and 1-D params, Megatron's default rule: ``param_groups``); hyperparameters are this run's
flags.
With --use-distributed-optimizer: agoq.megatron.optim.dist_optimizer.AgoqDistributedOptimizer (Megatron's
DistributedOptimizer in precision-aware mode; agoq states for this rank's shard only; DP-independent
compressed checkpoints), with DP shards aligned to the quantization groups (shard_alignment_for).
"""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from agoq.config import AgoqConfig, flag_for
from agoq.config.values import parse_moments
from agoq.megatron.grads import grad_reader
from agoq.megatron.graphs import check_cuda_graphs
from agoq.megatron.optim.dist_optimizer import AgoqDistributedOptimizer, shard_alignment
from agoq.megatron.optim.megatron_optimizer import AgoqMegatronOptimizer, init_all_states, keep_autograd_grad_dtype
from agoq.megatron.optim.release import AgoqReleaseOptimizer
from agoq.optim import SGD, AdamW, Lion
from agoq.optim.release import check_release_compatible


def param_groups(model_chunks: list) -> list[dict]:
    """Megatron's default grouping: no weight decay for biases and 1-D params (norm gains)."""
    decay, no_decay = [], []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    groups = [dict(params=decay, wd_mult=1.0), dict(params=no_decay, wd_mult=0.0)]
    return [dict(g, default_config=True) for g in groups if g["params"]]


def make_agoq_optimizer(config: AgoqConfig, megatron_config: OptimizerConfig, groups: list[dict]):
    opt, mc = config.optimizer, megatron_config
    states = opt.states  # parsed once by the config; the param groups carry the names (saved in checkpoints)
    m_fmt = states.m.name
    # The fused Triton step needs a GPU (or Triton's CPU interpreter, TRITON_INTERPRET=1, as the kernel
    # tests use: config.triton_interpret); otherwise (CI, CPU mode) the plain-PyTorch reference step runs,
    # which computes the same values (tests/kernels/test_optim_kernels.py). The choice is printed at start.
    fused = not opt.unfused and (torch.cuda.is_available() or config.triton_interpret)
    common = dict(master=opt.master, fused=fused, small_numel=opt.small_numel)
    if opt.kind == "adamw":
        return AdamW(groups, lr=mc.lr, betas=(mc.adam_beta1, mc.adam_beta2), eps=mc.adam_eps,
                     weight_decay=mc.weight_decay, state_formats={"exp_avg": m_fmt, "exp_avg_sq": states.v.name},
                     **common)  # fmt: skip
    if opt.kind == "lion":
        return Lion(groups, lr=mc.lr, betas=(opt.lion_beta1, opt.lion_beta2),
                    weight_decay=mc.weight_decay, state_formats={"exp_avg": m_fmt}, **common)  # fmt: skip
    return SGD(groups, lr=mc.lr, momentum=opt.sgd_momentum, nesterov=opt.sgd_nesterov,
               weight_decay=mc.weight_decay, state_formats={"momentum_buffer": m_fmt}, **common)  # fmt: skip


def _layer_global_names(model_chunks: list) -> dict[int, str]:
    names = {}
    for chunk in model_chunks:
        for layer_name, layer in chunk.named_modules():
            if not hasattr(layer, "layer_number") or not layer_name.split(".")[-1].isdigit():
                continue
            prefix = layer_name[: layer_name.rfind(".") + 1] + str(layer.layer_number - 1)
            for param_name, param in layer.named_parameters():
                names[id(param)] = f"{prefix}.{param_name}"
    for chunk in model_chunks:
        for param_name, param in chunk.named_parameters():
            names.setdefault(id(param), param_name)
    return {k: v.removeprefix("module.").removeprefix("module.") for k, v in names.items()}


def build_agoq_optimizer(agoq_config: AgoqConfig, config: OptimizerConfig, model_chunks: list):
    """agoq's optimizer (``agoq_config.optimizer.kind`` adamw|lion|sgd) over ``model_chunks`` in Megatron's
    optimizer interface; ``config``: Megatron's OptimizerConfig of the run (a copy is kept and adjusted). The
    caller keeps Megatron's own optimizer for kind torch and builds the LR schedule."""
    if not agoq_config.optimizer.agoq:
        raise ValueError(
            f"build_agoq_optimizer needs {flag_for('optimizer.kind')} adamw|lion|sgd (torch = "
            "megatron_setup.build_optimizer)"
        )
    if agoq_config.optimizer.gradient_release:  # the trainer checked its flags; what the process groups say
        check_release_compatible(pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size(),
                                 data_parallel=parallel_state.get_data_parallel_world_size(),
                                 clip_grad=config.clip_grad)  # fmt: skip
    config = copy.copy(config)
    inner = make_agoq_optimizer(agoq_config, config, param_groups(model_chunks))
    names = _layer_global_names(model_chunks)
    if config.use_distributed_optimizer:
        optimizer = AgoqDistributedOptimizer(inner, config, model_chunks, names)
        grad_reader.attach(optimizer, model_chunks)  # 8-bit gradient store: shards read one param at a time
    elif agoq_config.optimizer.gradient_release:
        # it steps each parameter in a backward hook, which a graphed backward never calls
        check_cuda_graphs(model_chunks[0].config, ["gradient_release"])

        optimizer = AgoqReleaseOptimizer(inner, config, init_all_states, model_chunks)  # steps in backward hooks
        optimizer.param_names = names
        return optimizer
    else:
        optimizer = AgoqMegatronOptimizer(inner, config, init_all_states)
        optimizer.param_names = names
        grad_reader.attach(optimizer, model_chunks)  # 8-bit gradient store: per-parameter reads, no float buffer
        if agoq_config.grads.reduce_in_bf16:
            config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True  # see prepare_grads
            inner.grad_attr = "decoupled_grad"
        elif optimizer.grad_reader is None:
            # prepare_grads sets grad_dtype = None from the first step on; doing it now makes the first
            # backward like every later one (see keep_autograd_grad_dtype)
            keep_autograd_grad_dtype([p for g in inner.param_groups for p in g["params"]
                                      if getattr(p, "main_grad", None) is not None and p.main_grad.dtype != p.dtype])
    return optimizer


def build_megatron_optimizer(config: OptimizerConfig, model_chunks: list):
    """Megatron's own optimizer (``--agoq-optimizer torch``: Megatron's Adam) over ``model_chunks``, with the reader of
    agoq's 8-bit gradient store attached where the distributed optimizer needs it (agoq.megatron.grads.grad_reader)."""
    optimizer = get_megatron_optimizer(config, model_chunks)
    grad_reader.attach(optimizer, model_chunks)  # 8-bit gradient store + distributed optimizer: shard reads
    return optimizer


def shard_alignment_for(options, distributed_optimizer: bool) -> int | None:
    """Elements the DDP buffer layout must align DP shards to for agoq's optimizer (``options``: an
    ``AgoqConfig.optimizer``) with --use-distributed-optimizer (None otherwise): see
    agoq.megatron.optim.dist_optimizer."""
    if not options.agoq or not distributed_optimizer:
        return None
    return shard_alignment(parse_moments(options.moments))
