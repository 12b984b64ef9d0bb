"""GPU: agoq's one-node linears against the paths they replace, in the model on CUDA (Triton quantize /
dequantize, the fused SwiGLU-quantize kernels, ATen's fused RMSNorm forward and backward, cuBLAS GEMMs):
- the norm + linear node (agoq.ops.norm_linear; QKV and fc1 fed by a recomputed pre-norm) against the norm's
  autograd function handing a recompute stash to Megatron's linear;
- the SwiGLU + linear node (agoq.ops.swiglu_linear; fc2 fed by a recomputed SwiGLU, codes from the fused kernel)
  against SwiGLU's autograd function handing its stash to Megatron's linear;
- the quantized-input linear node (agoq.ops.quant_linear; a linear storing its own input: the out-projection under
  the default policy, all four linears under a policy that keeps the norms and SwiGLU in bf16) against Megatron's
  linear inside agoq's saved-tensor hook scope.
``SavePaths(fuse_norm_linear=False, fuse_swiglu_linear=False, quantized_linear_node=False)`` runs the old paths. Both
run the same kernels on the same operands in the same order, so losses and gradients must be equal bit for bit, and
the byte counter equal. Run: ``pytest tests/gpu/test_norm_linear_gpu.py -m gpu``. The CPU twins are in
tests/megatron/test_activations.py, TP=2 in tests/megatron/test_layouts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu._world import gpu_megatron_world, gpu_model, gpu_model_step

pytestmark = [pytest.mark.gpu]

MODEL_KW = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                seq_length=128, vocab_size=256)
_OLD_PATHS = {"fuse_norm_linear": False, "fuse_swiglu_linear": False, "quantized_linear_node": False}
# every linear stores its own input (the norms and SwiGLU in bf16)
_LINEARS_INT8 = Path(__file__).resolve().parents[1] / "megatron" / "policies" / "linears_int8.yaml"


@pytest.fixture(scope="module")
def gpu_world():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    yield from gpu_megatron_world()


def _model(device, policy, nodes: bool, reference=None, fuse_swiglu: bool = True):
    from agoq.megatron.activations import storage_of
    from agoq.ops.saved_act import SavePaths

    paths = SavePaths(fuse_swiglu=fuse_swiglu, **({} if nodes else _OLD_PATHS))
    model, spec = gpu_model(device, MODEL_KW, policy=policy, save_paths=paths, reference=reference)
    return model, storage_of(spec)


@pytest.mark.parametrize("policy", ["agoq", "agoq_unfused_swiglu", "linears_int8"])
def test_one_node_linears_equal_the_old_paths_on_cuda(gpu_world, policy):
    """``agoq_unfused_swiglu``: SwiGLU's recompute and backward from the dequantized fc1 output (agoq.kernels.swiglu)
    instead of the fused kernels that read the codes (``SavePaths(fuse_swiglu=False)`` on both sides)."""
    from agoq.kernels.fastlaunch import set_check_sites

    fuse_swiglu = policy != "agoq_unfused_swiglu"
    policy = _LINEARS_INT8 if policy == "linears_int8" else "agoq"
    old, st_old = _model(gpu_world, policy, nodes=False, fuse_swiglu=fuse_swiglu)
    new, st_new = _model(gpu_world, policy, nodes=True, reference=old, fuse_swiglu=fuse_swiglu)
    layers = new.module.decoder.layers
    if policy == "agoq":
        assert all(h.accepts_feed for layer in layers for h in (*layer.agoq_handoffs, layer.mlp.agoq_fc2_handoff))
        assert all(layer.self_attention.linear_proj.agoq_quantized_node for layer in layers)
    else:
        assert all(layer.mlp.linear_fc1.agoq_quantized_node and layer.mlp.linear_fc2.agoq_quantized_node
                   and layer.self_attention.linear_qkv.agoq_quantized_node for layer in layers)
    previous = set_check_sites(True)
    try:
        for seed in range(3):
            loss_old, grads_old = gpu_model_step(old, gpu_world, seed, MODEL_KW)
            loss_new, grads_new = gpu_model_step(new, gpu_world, seed, MODEL_KW)
            assert torch.equal(loss_new, loss_old), seed
            for name, grad in grads_old.items():
                assert torch.equal(grad, grads_new[name]), (seed, name)
    finally:
        set_check_sites(previous)
    assert st_new.counter.packed == st_old.counter.packed and st_new.counter.total() > 0
    assert st_new.counter.peak == st_old.counter.peak
