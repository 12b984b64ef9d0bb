"""GPU: agoq's norm + linear autograd node (agoq.ops.norm_linear, the default for QKV and fc1 fed by a
recomputed pre-norm) against the two-node path it replaces (the norm's autograd function handing a recompute
stash to Megatron's linear: ``SavePaths(fuse_norm_linear=False)``), in the model on CUDA (Triton quantize /
dequantize, ATen's fused RMSNorm forward and backward, cuBLAS GEMMs). Both run the same kernels on the same
operands in the same order, so losses and gradients must be equal bit for bit, and the byte counter equal.
Run: ``pytest tests/gpu/test_norm_linear_gpu.py -m gpu``. The CPU twin is in tests/megatron/test_activations.py,
TP=2 in tests/megatron/test_layouts.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._world import gpu_megatron_world, gpu_model, gpu_model_step

pytestmark = [pytest.mark.gpu]

MODEL_KW = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                seq_length=128, vocab_size=256)


@pytest.fixture(scope="module")
def gpu_world():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    yield from gpu_megatron_world()


def _model(device, fused: bool, reference=None):
    from agoq.megatron.activations import storage_of
    from agoq.ops.saved_act import SavePaths

    model, spec = gpu_model(device, MODEL_KW, policy="agoq", save_paths=SavePaths(fuse_norm_linear=fused),
                            reference=reference)
    return model, storage_of(spec)


def test_norm_linear_node_equals_the_two_node_path_on_cuda(gpu_world):
    from agoq.kernels._fastlaunch import set_check_sites

    two_node, st_two = _model(gpu_world, fused=False)
    one_node, st_one = _model(gpu_world, fused=True, reference=two_node)
    assert all(h.accepts_feed for layer in one_node.module.decoder.layers for h in layer.agoq_handoffs)
    previous = set_check_sites(True)
    try:
        for seed in range(3):
            loss_two, grads_two = gpu_model_step(two_node, gpu_world, seed, MODEL_KW)
            loss_one, grads_one = gpu_model_step(one_node, gpu_world, seed, MODEL_KW)
            assert torch.equal(loss_one, loss_two), seed
            for name, grad in grads_two.items():
                assert torch.equal(grad, grads_one[name]), (seed, name)
    finally:
        set_check_sites(previous)
    assert st_one.counter.packed == st_two.counter.packed and st_one.counter.total() > 0
    assert st_one.counter.peak == st_two.counter.peak
