"""FP8 linears and Smooth-SwiGLU in the Megatron model: checks, per-layer assignment, the report line.

``--agoq-fp8 {off,current,delayed,rowwise,te}`` and ``--agoq-smooth-swiglu {off,per-channel,per-token}``
(plus ``--agoq-fp8-bf16-first-layers`` / ``-last-layers`` / ``--agoq-fp8-amax-history-len``; the trainer's
flags, agoq.train.args) override the policy file's ``fp8:`` section (``agoq.policy.FP8Spec``); neither given
means off. The run's resolved spec is ``AgoqConfig.fp8`` (agoq.config builds it once from both). The model's
layers are resolved once, before Megatron builds them (``agoq.megatron.layer_plan.ModelPlan``), with
:func:`layer_compute`: each layer's spec carries its four linears' ``FP8Recipe`` (or none: the first/last layers stay
bf16 by rule; the LM head always) and its MLP's Smooth-SwiGLU mode, which the layer passes to its modules'
constructors.

Seam card
---------
Touches: the agoq modules of ``agoq.megatron.layers`` (spec substitution; constructor arguments
  ``agoq_fp8`` / ``agoq_smooth`` through agoq.megatron.transformer_layer), ``TransformerConfig.num_layers``.
Why: the FP8 rule is per global layer index (first/last layers stay bf16).
Verified on: megatron-core 0.19.2.
When disabled: ``--agoq-fp8 off`` and ``--agoq-smooth-swiglu off``: no module is touched.
Guarded by: ``tests/megatron/test_fp8_smooth.py``, ``tests/gpu/test_fp8_megatron_gpu.py``.
"""

from __future__ import annotations

import torch

from agoq.config import flag_for
from agoq.ops.fp8_linear import GEMM_DIM_MULTIPLE, MIN_FP8_CAPABILITY
from agoq.ops.fp8_scaling import FP8Recipe
from agoq.policy import FP8Spec

__all__ = ["check_compute", "compute_report", "fc2_input_amax", "fp8_recipe", "layer_compute"]

_SMOOTH_OPS_MODE = {"per-channel": "per_channel", "per-token": "per_token"}


def fp8_recipe(spec: FP8Spec) -> FP8Recipe | None:
    """The ops-level recipe of ``spec.recipe`` (None for off)."""
    if spec.recipe == "off":
        return None
    if spec.recipe == "rowwise":
        return FP8Recipe(granularity="row", scaling="current")
    return FP8Recipe(granularity="tensor", scaling=spec.recipe, amax_history_len=spec.amax_history_len)


def check_compute(spec: FP8Spec, device: torch.device, *, num_layers: int, hidden: int, ffn: int, heads: int,
                  groups: int, tp: int, tokens_per_microbatch: int) -> None:
    """Raise (naming the flag) when the FP8 settings cannot run here: no FP8 GPU, dims."""
    if not spec.fp8_enabled:
        return
    flag = f"{flag_for('fp8.recipe')} {spec.recipe} (or the policy's fp8.recipe)"
    if device.type != "cuda":
        raise ValueError(
            f"{flag} needs an NVIDIA GPU with FP8 tensor cores (compute capability >= "
            f"{'.'.join(map(str, MIN_FP8_CAPABILITY))}: Ada, Hopper or newer); this run is on the {device.type}. "
            f"Use {flag_for('fp8.recipe')} off; {flag_for('fp8.smooth_swiglu')} alone runs on the CPU")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise ValueError(f"{flag} needs compute capability >= {MIN_FP8_CAPABILITY} (FP8 tensor cores); this GPU "
                         f"({torch.cuda.get_device_name(device)}) has {capability}. Use {flag_for('fp8.recipe')} off")
    if not any(spec.uses_fp8(i, num_layers) for i in range(num_layers)):
        raise ValueError(f"{flag}: no layer runs in FP8 (--num-layers {num_layers}, bf16 first "
                         f"{spec.bf16_first_layers} and last {spec.bf16_last_layers}); lower "
                         f"{flag_for('fp8.bf16_first_layers')} / {flag_for('fp8.bf16_last_layers')} or use "
                         f"{flag_for('fp8.recipe')} off")
    head_dim = hidden // heads
    dims = {"tokens per micro-batch (--seq-length x --micro-batch-size)": tokens_per_microbatch,
            "--hidden-size": hidden, "--ffn-hidden-size / TP": ffn // tp,
            "QKV width / TP ((heads + 2 x query groups) x head dim)": (heads + 2 * groups) * head_dim // tp,
            "attention width / TP": heads * head_dim // tp}
    bad = {k: v for k, v in dims.items() if v % GEMM_DIM_MULTIPLE}
    if bad:
        raise ValueError(f"{flag}: torch._scaled_mm needs multiples of {GEMM_DIM_MULTIPLE}, got {bad}")


def layer_compute(spec: FP8Spec, layer_idx: int, num_layers: int) -> dict:
    """``{"fp8": FP8Recipe | None, "smooth": str | None}`` for global layer ``layer_idx`` of a model of ``num_layers``:
    its four linears' recipe (the first / last layers stay bf16 by rule) and its MLP's Smooth-SwiGLU mode. Applied
    once per layer when the model's layers are resolved (agoq.megatron.layer_plan.ModelPlan), and by the built-model
    check (agoq.megatron.built_check)."""
    fp8 = spec.uses_fp8(layer_idx, num_layers)
    return {"fp8": fp8_recipe(spec) if fp8 else None, "smooth": _SMOOTH_OPS_MODE.get(spec.smooth_swiglu)}


def compute_report(spec: FP8Spec, num_layers: int, *, plain_swiglu_fusion: bool = True) -> str:
    """One line for the start-up log; under delayed scaling it says whether fc2 takes the SwiGLU fused into its
    E4M3 cast (agoq.ops.smooth_swiglu_fp8: always with Smooth-SwiGLU; plain SwiGLU unless the process-wide switch,
    ``plain_swiglu_fusion``, is off)."""
    if spec.fp8_enabled:
        fp8 = [i for i in range(num_layers) if spec.uses_fp8(i, num_layers)]
        bf16 = [i for i in range(num_layers) if i not in fp8]
        scaling = {"current": "per-tensor current scaling", "delayed": f"per-tensor delayed scaling (amax history "
                   f"{spec.amax_history_len})", "rowwise": "row-wise current scaling"}
        text = (f"fp8: {scaling[spec.recipe]}, E4M3 forward / E5M2 backward, layers {_ranges(fp8)}; bf16: "
                f"{'layers ' + _ranges(bf16) + ' and ' if bf16 else ''}the LM head")
    else:
        text = "fp8: off (bf16 linears)"
    text = f"{text} | smooth-swiglu: {spec.smooth_swiglu}"
    if spec.recipe == "delayed":
        fused = spec.smooth_swiglu != "off" or plain_swiglu_fusion
        text += " | swiglu + fc2 cast: " + ("fused" if fused else "unfused (AGOQ_FP8_SWIGLU_FUSION=0)")
    return text


def fc2_input_amax(model_chunks) -> dict[str, float]:
    """The long-horizon outlier proxy (FP8 paper: SwiGLU weight alignment grows fc2's input
    outliers until FP8 overflows): the newest amax of every FP8 fc2's input on this rank, read from its
    delayed-scaling history (the x slot, newest first: what the last micro-batch's E4M3 cast saw; with
    Smooth-SwiGLU the smoothed z, which stays bounded where the plain SwiGLU output grows), keyed
    ``fc2_input_amax/layer_<global index>``, plus ``fc2_input_amax_max`` over them. No extra pass over any
    activation; one device-to-host copy of one float per layer. Empty when no fc2 runs FP8 with delayed
    scaling (current scaling keeps no history)."""
    amaxes: dict[int, torch.Tensor] = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            fc2 = getattr(getattr(module, "mlp", None), "linear_fc2", None)
            state = None if fc2 is None else fc2.__dict__.get("_agoq_fp8_state")
            if state is not None and state.num_updates["x"] and hasattr(module, "layer_number"):
                amaxes[module.layer_number - 1] = state.amax_history("x")[0]  # global 0-based index
    if not amaxes:
        return {}
    values = torch.stack([amaxes[i] for i in sorted(amaxes)]).tolist()
    out = {f"fc2_input_amax/layer_{i}": v for i, v in zip(sorted(amaxes), values, strict=True)}
    out["fc2_input_amax_max"] = max(values)
    return out


def _ranges(idx: list[int]) -> str:
    if not idx:
        return "none"
    parts, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None], strict=True):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)
