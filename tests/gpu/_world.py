"""The one-GPU megatron-core world the model-level GPU tests share: agoq installed for CUDA, one process on
cuda:0, model-parallel groups of one. A generator for module-scoped fixtures (``yield from gpu_megatron_world()``),
skipping where megatron-core is not importable; callers skip on their own hardware needs first."""

from __future__ import annotations

import pytest


def gpu_megatron_world():
    pytest.importorskip("megatron.core", reason="needs megatron-core (the carried wheel on the GPU machine)")
    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    handle = install(AgoqConfig(device="cuda"))
    device = runtime.choose_device("cuda", 0)
    runtime.init_distributed(device, runtime.SINGLE_PROCESS)
    runtime.init_model_parallel(ParallelLayout(), seed=1234, device=device)
    try:
        yield device
    finally:
        runtime.shutdown()
        handle.uninstall()


def gpu_model(device, model_kw: dict, *, policy, compute=None, save_paths=None, reference=None):
    """(bf16 model on ``device`` in Float16Module, its layer spec): agoq's SDPA spec with configs/policy/<policy>.yaml
    (a Path: that YAML; None: no activation policy), ``compute`` (an FP8Spec or None) and ``save_paths``, one
    micro-batch, PP=1; weights copied from ``reference`` when given."""
    from pathlib import Path

    import torch
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.model import (
        LlamaShape,
        ParallelLayout,
        agoq_layer_spec,
        build_model_chunks,
        llama_transformer_config,
    )
    from agoq.policy import ScheduleInfo

    shape = LlamaShape(**model_kw)
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.bfloat16,
                                      use_cpu_initialization=False)
    path = policy if isinstance(policy, Path) or policy is None else \
        Path(__file__).resolve().parents[2] / "configs" / "policy" / f"{policy}.yaml"
    spec = agoq_layer_spec("sdpa", policy=path, schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1),
                           compute=compute, save_paths=save_paths)
    (model,) = build_model_chunks(shape, config, spec, None)
    model = Float16Module(config, model.to(device))
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    return model, spec


def gpu_model_step(model, device, seed: int, model_kw: dict, batch: int = 2):
    """One forward + backward of ``model`` on ``batch`` random sequences (seeded): (loss, {name: gradient}), both
    detached copies in the model's dtypes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model_kw["vocab_size"], (batch, model_kw["seq_length"] + 1), generator=g).to(device)
    pos = torch.arange(model_kw["seq_length"], device=device).expand(batch, -1)
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}
