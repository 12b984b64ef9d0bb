"""GPU: agoq's norm + linear autograd node (agoq.ops.norm_linear, the default for QKV and fc1 fed by a
recomputed pre-norm) against the two-node path it replaces (the norm's autograd function handing a recompute
stash to Megatron's linear: ``SavePaths(fuse_norm_linear=False)``), in the model on CUDA (Triton quantize /
dequantize, ATen's fused RMSNorm forward and backward, cuBLAS GEMMs). Both run the same kernels on the same
operands in the same order, so losses and gradients must be equal bit for bit, and the byte counter equal.
Run: ``pytest tests/gpu/test_norm_linear_gpu.py -m gpu``. The CPU twin is in tests/megatron/test_activations.py,
TP=2 in tests/megatron/test_layouts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu]

MODEL_KW = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                seq_length=128, vocab_size=256)


@pytest.fixture(scope="module")
def gpu_world():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("megatron.core", reason="needs megatron-core (the carried wheel on the GPU machine)")
    from agoq.config import AgoqConfig
    from agoq.megatron import runtime
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout

    handle = install(AgoqConfig(device="cuda"))
    device = runtime.choose_device("cuda", 0)
    runtime.init_distributed(device, runtime.SINGLE_PROCESS)
    runtime.init_model_parallel(ParallelLayout(), seed=1234, device=device)
    yield device
    runtime.shutdown()
    handle.uninstall()


def _model(device, fused: bool, reference=None):
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.activations import storage_of
    from agoq.megatron.model import (
        LlamaShape,
        ParallelLayout,
        agoq_layer_spec,
        build_model_chunks,
        llama_transformer_config,
    )
    from agoq.ops.saved_act import SavePaths
    from agoq.policy import ScheduleInfo

    shape = LlamaShape(**MODEL_KW)
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.bfloat16,
                                      use_cpu_initialization=False)
    path = Path(__file__).resolve().parents[2] / "configs" / "policy" / "agoq.yaml"
    spec = agoq_layer_spec("sdpa", policy=path, schedule=ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=1),
                           save_paths=SavePaths(fuse_norm_linear=fused))
    (model,) = build_model_chunks(shape, config, spec, None)
    model = Float16Module(config, model.to(device))
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    return model, storage_of(spec)


def _step(model, device, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL_KW["vocab_size"], (2, MODEL_KW["seq_length"] + 1), generator=g).to(device)
    pos = torch.arange(MODEL_KW["seq_length"], device=device).expand(2, -1)
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_norm_linear_node_equals_the_two_node_path_on_cuda(gpu_world):
    from agoq.kernels._fastlaunch import set_check_sites

    two_node, st_two = _model(gpu_world, fused=False)
    one_node, st_one = _model(gpu_world, fused=True, reference=two_node)
    assert all(h.accepts_feed for layer in one_node.module.decoder.layers for h in layer.agoq_handoffs)
    previous = set_check_sites(True)
    try:
        for seed in range(3):
            loss_two, grads_two = _step(two_node, gpu_world, seed)
            loss_one, grads_one = _step(one_node, gpu_world, seed)
            assert torch.equal(loss_one, loss_two), seed
            for name, grad in grads_two.items():
                assert torch.equal(grad, grads_one[name]), (seed, name)
    finally:
        set_check_sites(previous)
    assert st_one.counter.packed == st_two.counter.packed and st_one.counter.total() > 0
    assert st_one.counter.peak == st_two.counter.peak
