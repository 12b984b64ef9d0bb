"""agoq on Transformer Engine's layers (``--transformer-impl transformer_engine``): what composes and what is refused.

With TE the layers are Megatron's TE spec, unchanged: TE's LayerNorm-Linear and Linear modules, its fused attention,
its FP8 recipes (Megatron-LM's ``--fp8-format`` / ``--fp8-recipe``). agoq adds to them, module by module:

* **saved activations**: the policy's formats for the tensors TE keeps in 16 bits (the norms' inputs, the SwiGLU
  input, 16-bit GEMM inputs), through saved-tensor scopes around TE's modules (agoq/megatron/saved_scopes.py); FP8
  GEMM inputs stay TE's FP8 copies;
* **8-bit gradients** (``--agoq-grads``) and **agoq's optimizer** (``--agoq-optimizer``): they wrap Megatron's DDP
  and optimizer, whatever the layers are.

Refused, each naming the fix: agoq's own FP8 linears and Smooth-SwiGLU (``--agoq-fp8``, ``--agoq-smooth-swiglu``:
TE's FP8 runs the GEMMs; use Megatron-LM's ``--fp8-format hybrid --fp8-recipe delayed``), and the 8-bit gradient
store without a float ``main_grad`` under TE's fused weight-gradient accumulation (TE writes ``main_grad``).

Seam card
---------
Touches: ``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec`` (the spec Megatron-LM
  builds for ``--transformer-impl transformer_engine``), ``TransformerConfig.gradient_accumulation_fusion``.
Why: agoq composes with the layers Megatron-LM users run instead of replacing them.
Verified on: megatron-core 0.19.2 with Transformer Engine 2.20.2 on an H100 (tests/gpu/test_te_agoq_gpu.py,
  benchmarks/bench_te.py).
"""

from __future__ import annotations

import importlib.util

from agoq.config import AgoqConfig, flag_for

TE_INSTALL_HINT = ("pip install --no-build-isolation 'transformer-engine[pytorch]' (it builds against your torch and "
                   "CUDA; benchmarks/device/te_wheels.sh + te_device.sh do it on a machine without internet)")


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_missing_message(flag: str = "--transformer-impl transformer_engine") -> str:
    return f"{flag}: Transformer Engine is not installed; {TE_INSTALL_HINT}, or use --transformer-impl local"


def require_te(flag: str = "--transformer-impl transformer_engine") -> None:
    """One line naming the fix when Transformer Engine is asked for and not installed."""
    if not te_available():
        raise RuntimeError(te_missing_message(flag))


def check_te_composition(config: AgoqConfig, gradient_accumulation_fusion: bool) -> None:
    """Refuse the agoq settings that do not compose with TE's layers, naming the flag and the fix."""
    if not config.enabled:
        return
    if config.fp8.fp8_enabled:
        raise ValueError(f"{flag_for('fp8.recipe')} {config.fp8.recipe} with --transformer-impl transformer_engine: "
                         "TE's modules run the FP8 GEMMs; use Megatron-LM's --fp8-format hybrid --fp8-recipe delayed "
                         "(or tensorwise) instead, or --transformer-impl local for agoq's FP8 linears")
    if config.fp8.smooth_swiglu != "off":
        raise ValueError(f"{flag_for('fp8.smooth_swiglu')} with --transformer-impl transformer_engine: agoq's "
                         "Smooth-SwiGLU runs in its own MLP, not in TE's; drop the flag, or use --transformer-impl "
                         "local")
    if config.grads.quantized and config.grads.mode == "store" and gradient_accumulation_fusion:
        raise ValueError(f"{flag_for('grads.format')} in store mode with --gradient-accumulation-fusion: TE "
                         "accumulates weight gradients into the float main_grad that the 8-bit store replaces; add "
                         f"--no-gradient-accumulation-fusion, or {flag_for('grads.mode')} reduce")


def te_layer_spec():
    """Megatron's Transformer Engine layer spec of a dense GPT (LLaMA) layer, as Megatron-LM builds it."""
    require_te()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False)
