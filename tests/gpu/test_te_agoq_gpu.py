"""GPU: agoq's activation policy on Transformer Engine's layers (agoq/megatron/saved_scopes.py on Megatron's TE spec,
agoq/megatron/te.py), one GPU, TP=PP=1, bf16 and TE's FP8 (delayed, hybrid). Needs Transformer Engine
(benchmarks/device/te_device.sh) and an sm_89+ GPU for the FP8 case. Run: ``pytest tests/gpu/test_te_agoq_gpu.py``.

Claims:
  * bf16 policy: no scope, and the model trains bit-identically to plain TE (losses and every gradient, 3 steps);
  * agoq's default policy (nf4 at PP=1, attention tensors in bf16): the forward is unchanged bit for bit and each
    parameter's gradient stays above nf4's SQNR floor less 10 dB (the argument of tests/megatron/test_activations.py:
    a handful of quantized saved tensors per backward path, non-Gaussian activations);
  * the scopes store every layer's norm inputs and the SwiGLU input, and under FP8 leave TE's FP8 copies alone;
  * with TE's FP8, agoq's policy moves the gradients no further from FP8 alone than the floor above.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu._world import gpu_megatron_world

# TE picks its fused-attention backend per call: deterministic kernels, so that bit-identical claims can hold
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

pytestmark = [pytest.mark.gpu]

te = pytest.importorskip("transformer_engine", reason="needs Transformer Engine (benchmarks/device/te_device.sh)")

SEQ, MICRO_BATCH, VOCAB = 256, 2, 512
SHAPE_KW = dict(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1024,
                seq_length=SEQ, vocab_size=VOCAB)
GRAD_FLOOR_SLACK_DB = 10.0
MIN_NUMEL = 1 << 14  # this model's activations are 512 tokens x >= 512; its norm statistics 512 values


@pytest.fixture(scope="module")
def gpu_world():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    yield from gpu_megatron_world()


def _te_model(device, fp8: bool, reference=None):
    from megatron.core.transformer.module import Float16Module

    from agoq.megatron.model import LlamaShape, ParallelLayout, build_model_chunks, llama_transformer_config
    from agoq.megatron.te import te_layer_spec

    shape = LlamaShape(**SHAPE_KW)
    config = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.bfloat16,
                                      use_cpu_initialization=False)
    config.transformer_impl = "transformer_engine"
    if fp8:
        config.fp8, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo = \
            "hybrid", "delayed", 16, "max"
    (model,) = build_model_chunks(shape, config, te_layer_spec(), None)
    model = Float16Module(config, model.to(device))
    if reference is not None:
        model.load_state_dict(reference.state_dict())
    return model


def _policy(path: str):
    from agoq.policy import load_policy

    return load_policy(path)


def _apply(model, policy_path):
    from agoq.megatron.saved_scopes import apply_saved_scopes
    from agoq.policy import ScheduleInfo

    return apply_saved_scopes([model.module], _policy(policy_path), ScheduleInfo(1, None, 1), min_numel=MIN_NUMEL)


def _train(model, device, steps):
    losses, grads = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(40 + step)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g).to(device)
        pos = torch.arange(SEQ, device=device).expand(MICRO_BATCH, -1)
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 1e-3 * p.grad
    return losses, grads


def _policies():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "policy"
    return root / "bf16.yaml", root / "agoq.yaml"


def test_bf16_policy_trains_bit_identically_to_plain_te(gpu_world):
    bf16, _ = _policies()
    plain = _te_model(gpu_world, fp8=False)
    model = _te_model(gpu_world, fp8=False, reference=plain)
    stats, handles = _apply(model, bf16)
    assert stats.scopes == 0 and not handles
    losses_ref, grads_ref = _train(plain, gpu_world, 3)
    losses, grads = _train(model, gpu_world, 3)
    for step in range(3):
        assert torch.equal(losses[step], losses_ref[step])
        for name, g in grads_ref[step].items():
            assert torch.equal(grads[step][name], g), f"step {step}: {name}"


@pytest.mark.parametrize("fp8", [False, True])
def test_agoq_policy_on_te_layers(gpu_world, fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    from agoq.formats import parse_format
    from agoq.testing.numerics import gaussian_floor_db, sqnr_db

    _, agoq = _policies()
    plain = _te_model(gpu_world, fp8=fp8)
    model = _te_model(gpu_world, fp8=fp8, reference=plain)
    stats, _ = _apply(model, agoq)
    losses_ref, grads_ref = _train(plain, gpu_world, 1)
    losses, grads = _train(model, gpu_world, 1)
    assert torch.equal(losses[0], losses_ref[0]), "the forward changed"
    floor = gaussian_floor_db(parse_format("nf4_b64")) - GRAD_FLOOR_SLACK_DB
    for name, g in grads_ref[0].items():
        assert sqnr_db(g, grads[0][name]) >= floor, f"{name}: gradient SQNR below {floor:.1f} dB"
    roles = {role for (_, role) in stats.counter.packed}
    assert {"attn.qkv_input", "mlp.fc1_input", "mlp.swiglu_input"} <= roles, roles  # the fused norms' inputs too
    for layer in range(SHAPE_KW["num_layers"]):
        assert any(idx == layer for (idx, _) in stats.counter.packed), f"layer {layer} stored nothing"
    if fp8:
        assert stats.kept_bytes.get("not floating point (FP8 data, indices)", 0) + \
            stats.kept_bytes.get("tensor subclass (TE's quantized tensors)", 0) > 0, stats.kept_bytes
