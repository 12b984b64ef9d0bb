"""What agoq's FP8 linears (--agoq-fp8) and Smooth-SwiGLU (--agoq-smooth-swiglu) change in a stage's memory.

Pure Python (no torch). Every term is read off the code named at it; the FP8 layer rule is
``agoq.policy.FP8Spec.uses_fp8`` (the one agoq.megatron.compute.layer_compute applies: the
first ``bf16_first_layers`` and last ``bf16_last_layers`` layers and the LM head stay bf16).

Persistent (``fp8_persistent_bytes``, held for the whole run like the weights):
- the FP8 weight cache (agoq.ops.fp8_weight_cache.FP8WeightCache, one per FP8 linear,
  agoq.megatron.layers._AgoqLinearMixin._fp8_weight_cache): ``_weight_fp8(..., both_layouts=True)``
  keeps the weight in FP8 twice, row-major for the forward GEMM and transposed for dgrad, 1 byte per
  element each: 2 B per parameter of every cached linear. The entry lives until the next forward after
  a weight change rebuilds it, so it is alive in the optimizer step too. fc2 with per-channel
  Smooth-SwiGLU keeps no persistent entry: unfused (current / row-wise scaling, or a quantized mlp.fc2_input
  request where the SwiGLU input is bf16) it passes ``w_col_scale``
  (agoq.ops.fp8_linear.FP8LinearFunction, no cache); fused (delayed scaling,
  agoq.ops.smooth_swiglu_fp8) its W * s entry is per micro-batch (below). Per-token fused, fc2's entry
  (the fused op's own cache) also holds the row-wise ``scale_b`` [1, h] (fp32); counted on every FP8 layer, also
  one where a quantized mlp.fc2_input request keeps the op from running (4 B x h, not told apart).
- row-wise scaling: the cache entry's scale vectors (``_cast`` with granularity "row": fwd scale_inv
  [N], dgrad scale_t_inv [K], scale_src scale_t [K], fp32).
- delayed scaling: one FP8ScalingState per FP8 linear (agoq.ops.fp8_scaling): per slot (x, w, g) a meta
  pool of META_POOL_ROWS rows (the current meta is one of its rows) and an int32[2] workspace. A
  pool whose last row is still referenced elsewhere (a saved scale) may outlive its successor: at
  most one more pool per slot, 5 KiB at the default history length, not counted.

Held per layer and micro-batch (``saved_delta_bytes``, on top of ``agoq.plan.storage.megatron_bytes``,
which models bf16 linears and Megatron's SwiGLU):
- an FP8 linear whose input role is Megatron's save (bf16 policy for that role) keeps x's transposed
  FP8 copy (1 B/element) instead of the bf16 input (agoq.ops.fp8_linear: ``keep_x_fp8``): -1 B per
  element of attn.qkv_input, mlp.fc1_input, mlp.fc2_input (nothing else holds those bf16 tensors:
  the norm keeps its own input, the SwiGLU its input); attn.proj_input was a view of SDPA's output
  (0 bytes), so its FP8 copy is +1 B per element. A quantized or recomputed role gives the FP8
  linear an ``x_saver`` (agoq.megatron.layers._fp8_forward_impl): the same bytes as without FP8.
- Smooth-SwiGLU (agoq.megatron.mlp.AgoqMLP._smooth_forward) on every layer's MLP: with
  mlp.swiglu_input bf16 it runs ``agoq.ops.saved_swiglu.swiglu_reference``, which at glu_linear_offset 0
  (required: AgoqMLP.check_smooth_supported) does not make Megatron's ``x_linear + 0`` tensor: -2 B x f
  per token; ``glu / s`` keeps only s (DivBackward, s needs no grad). s itself is kept (fp32, per
  token [T, 1] or per FFN channel [f]), also on the quantized path (``_SwiGLUSavingInput``).
  Per-channel on a bf16 layer folds s into fc2's weight (``fold_channel_scale``: W * s, bf16), which
  Megatron's linear saves for dgrad: +2 B x h x f per micro-batch.
- fused Smooth-SwiGLU on an FP8 layer under delayed scaling (agoq.ops.smooth_swiglu_fp8, fc2 fed the fc1
  output): with mlp.swiglu_input bf16 the op keeps h and fc2's FP8 input copy, not the silu output
  autograd kept: -2 B x f per token more; per channel each micro-batch holds its FP8 W * s (both
  layouts, released after its backward): +2 x 1 B x h x f.
- fused plain SwiGLU on an FP8 layer under delayed scaling (agoq.ops.smooth_swiglu_fp8.swiglu_fp8_fc2, the code
  since commit e9f6759, 2026-11-26 19:34 UTC; ``plain_fusion``, ``Recipe.fuse_plain_swiglu_fp8``: False for the
  code before it and for AGOQ_FP8_SWIGLU_FUSION=0; neither fused op runs where mlp.swiglu_input is bf16 and
  mlp.fc2_input quantized: the unfused ops store the asked copy): with mlp.swiglu_input bf16 the op keeps h and
  fc2's FP8 input copy where Megatron's SwiGLU kept the silu output and its ``x_linear + 0`` tensor besides:
  -2 x 2 B x f per token. With mlp.swiglu_input quantized both paths keep the same quantized h: no change. Its fc2
  weight entry is the op's own cache (the same 2 B per parameter, no row-wise scale): no persistent change.

Transients (why none is added): the forward casts of a layer (x in FP8, two layouts) run before the
later layers' saves exist, and in backward the casts of fc1's incoming gradient (E5M2, two layouts,
2 x 1 B x T x 2f) run after the SwiGLU's saves (4 x 2 B x T x f) and fc2's FP8 input are released, so
neither exceeds ``agoq.plan.peak.layer_backward_transient``'s moment; the step phase runs no casts.
Not modelled: per-channel Smooth-SwiGLU on FP8 fc2 materialises W * s in forward and backward
(``_effective_weight``: fp32 copies of fc2's weight, a temporary), and the per-micro-batch scale
vectors of row-wise scaling (4 B x K per linear).
"""

from __future__ import annotations

from agoq.plan.shape import ModelShape
from agoq.plan.storage import BF16_BYTES, FP32_BYTES, MEGATRON, QUANTIZED, LayerDims, LayerStorage
from agoq.policy import FP8Spec

FP8_BYTES = 1  # E4M3 / E5M2 element
WEIGHT_CACHE_LAYOUTS = 2  # agoq.ops.fp8_linear._weight_fp8(both_layouts=True): row-major + transposed
# agoq.ops.fp8_scaling (equal by test, tests/unit/test_plan_fp8.py): slots x, w, g; META_POOL_ROWS rows
# per pool, each META_HEADER + history floats padded to META_ROW_ALIGN; workspace int32[2] per slot.
SCALING_SLOTS = 3
META_HEADER = 4  # agoq.ref.fp8.META_HEADER: [scale_inv, scale, 0, 0]
META_POOL_ROWS = 64
META_ROW_ALIGN = 4
WORKSPACE_BYTES = 2 * 4
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# input role of each linear; attn.proj_input's bf16 save is a view of SDPA's output (storage.megatron_bytes)
LINEAR_INPUT_ROLE = {"linear_qkv": "attn.qkv_input", "linear_proj": "attn.proj_input",
                     "linear_fc1": "mlp.fc1_input", "linear_fc2": "mlp.fc2_input"}
VIEW_SAVED_ROLES = ("attn.proj_input",)


def linear_shapes(shape: ModelShape, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear of one layer on one tensor-parallel rank."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    d = h // shape.num_attention_heads
    return {"linear_qkv": (d * (shape.num_attention_heads + 2 * shape.num_query_groups) // tp, h),
            "linear_proj": (h, d * shape.num_attention_heads // tp),
            "linear_fc1": (2 * f // tp, h), "linear_fc2": (h, f // tp)}


def cached_linears(spec: FP8Spec) -> tuple[str, ...]:
    """Linears of an FP8 layer that keep a weight cache (fc2 with per-channel Smooth-SwiGLU does not)."""
    return tuple(n for n in LINEARS if not (n == "linear_fc2" and spec.smooth_swiglu == "per-channel"))


def fused_plain(spec: FP8Spec, plain_fusion: bool = True) -> bool:
    """Plain SwiGLU runs fused with an FP8 fc2 (agoq.megatron.mlp.AgoqMLP.plain_fusion_problems: per-tensor
    delayed scaling; the trainer's model has no bias_activation_fusion) when the code fuses it (``plain_fusion``)."""
    return plain_fusion and spec.smooth_swiglu == "off" and spec.recipe == "delayed"


def fused_smooth(spec: FP8Spec) -> bool:
    """Smooth-SwiGLU runs fused with an FP8 fc2 (agoq.ops.smooth_swiglu_fp8.fused_smooth_supported: per-tensor
    delayed scaling; SavePaths.fuse_smooth_fp8 at its default)."""
    return spec.smooth_swiglu != "off" and spec.recipe == "delayed"


def _fused_runs(storage: LayerStorage) -> bool:
    """The fused SwiGLU -> FP8 fc2 op runs on this layer (given the recipe): not where the SwiGLU input is bf16 and
    mlp.fc2_input asks a quantized format (agoq.megatron.mlp.AgoqMLP._fc2_request_problem: the unfused ops store
    what the policy asks)."""
    return not (storage.roles["mlp.swiglu_input"].how == MEGATRON and storage.roles["mlp.fc2_input"].how == QUANTIZED)


def _fused_keeps_fc2_input(storage: LayerStorage) -> bool:
    """The fused op runs and keeps fc2's input as its E4M3 copy (the SwiGLU input bf16, mlp.fc2_input bf16)."""
    return storage.roles["mlp.swiglu_input"].how == MEGATRON and storage.roles["mlp.fc2_input"].how == MEGATRON


def fp8_layers(spec: FP8Spec, layers, num_layers: int) -> list[int]:
    """The FP8 ones among global layer indices ``layers`` (the rule of agoq.megatron.compute.layer_compute)."""
    return [i for i in layers if spec.uses_fp8(i, num_layers)]


def weight_cache_bytes(spec: FP8Spec, shape: ModelShape, tp: int = 1) -> int:
    """FP8 weight cache of one FP8 layer (both layouts, 1 B each, plus row-wise scale vectors)."""
    total = 0
    for name in cached_linears(spec):
        n, k = linear_shapes(shape, tp)[name]
        total += WEIGHT_CACHE_LAYOUTS * FP8_BYTES * n * k
        if spec.recipe == "rowwise":
            total += FP32_BYTES * (n + 2 * k)
        if name == "linear_fc2" and fused_smooth(spec) and spec.smooth_swiglu == "per-token":
            total += FP32_BYTES * n  # the row-wise scale_b of the fused op's entry
    return total


def scaling_state_bytes(spec: FP8Spec) -> int:
    """Delayed scaling's state of one FP8 linear (FP8ScalingState: meta pool + workspace per slot)."""
    if spec.recipe != "delayed":
        return 0
    row = -(-(META_HEADER + spec.amax_history_len) // META_ROW_ALIGN) * META_ROW_ALIGN
    return SCALING_SLOTS * (META_POOL_ROWS * row * FP32_BYTES + WORKSPACE_BYTES)


def fp8_persistent_bytes(spec: FP8Spec | None, shape: ModelShape, tp: int, layers) -> int:
    """Weight caches and scaling states of the FP8 layers among global layer indices ``layers`` (one stage)."""
    if spec is None or not spec.fp8_enabled:
        return 0
    per_layer = weight_cache_bytes(spec, shape, tp) + len(LINEARS) * scaling_state_bytes(spec)
    return per_layer * len(fp8_layers(spec, layers, shape.num_layers))


def saved_delta_bytes(spec: FP8Spec | None, storage: LayerStorage, dims: LayerDims, fp8_layer: bool,
                      plain_fusion: bool = True) -> int:
    """Held bytes of one layer and micro-batch minus the bf16-linear model's (module docstring); ``plain_fusion``:
    the code fuses plain SwiGLU with an FP8 fc2 (``fused_plain``)."""
    if spec is None:
        return 0
    delta = 0
    if fp8_layer:
        for role in LINEAR_INPUT_ROLE.values():
            if storage.roles[role].how != MEGATRON:
                continue  # x_saver: agoq's quantized copy or recompute handle, as without FP8
            was = 0 if role in VIEW_SAVED_ROLES else BF16_BYTES
            delta += (FP8_BYTES - was) * dims.numel(role)
        if fused_plain(spec, plain_fusion) and _fused_keeps_fc2_input(storage):
            delta -= 2 * BF16_BYTES * dims.numel("mlp.fc2_input")  # no silu output, no x_linear + 0 tensor
    if spec.smooth_swiglu != "off":
        f_local = dims.numel("mlp.fc2_input") // dims.tokens
        if storage.roles["mlp.swiglu_input"].how == MEGATRON:
            delta -= BF16_BYTES * dims.numel("mlp.fc2_input")  # no x_linear + 0 tensor
        delta += FP32_BYTES * (dims.tokens if spec.smooth_swiglu == "per-token" else f_local)  # s
        if spec.smooth_swiglu == "per-channel" and not fp8_layer:
            delta += BF16_BYTES * dims.hidden * f_local  # W * s saved by Megatron's fc2
        if fp8_layer and fused_smooth(spec) and _fused_keeps_fc2_input(storage):
            delta -= BF16_BYTES * dims.numel("mlp.fc2_input")  # no silu output kept
        if fp8_layer and fused_smooth(spec) and _fused_runs(storage):
            if spec.smooth_swiglu == "per-channel":
                delta += WEIGHT_CACHE_LAYOUTS * FP8_BYTES * dims.hidden * f_local  # this micro-batch's W * s
    return delta

