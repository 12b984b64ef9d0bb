"""Peak memory of a Megatron-LM run on Transformer Engine's layers (``--transformer-impl transformer_engine``), with and
without agoq, with and without TE's FP8 (``--fp8-format hybrid --fp8-recipe delayed``): one GPU.

Pure Python (no torch, no Megatron, no TE). It reuses agoq.plan.peak's terms (weights, Megatron's float gradient
buffer or agoq's 8-bit store, agoq's optimizer and its step, the runtime workspaces, the LM head's saves and logits,
the layer-backward transient, full recompute) and replaces what TE changes; ``TE_TERMS`` lists those, and
``python -m agoq.plan --transformer-impl transformer_engine`` prints them. What the model is checked against:
docs/benchmarks/planner.md, section "Megatron + Transformer Engine" (tests/unit/test_plan_te.py).

The run modelled is Megatron-LM's ``pretrain_gpt.py`` (megatron.training) with its defaults, the driver of
benchmarks/bench_te.py (benchmarks/megatron_gpt_upstream.py), through agoq's door (``--module agoq.megatron_lm``)
or not: the TE spec of megatron-core 0.19.2 (``get_gpt_layer_with_transformer_engine_spec``), Megatron's fused
SwiGLU (``bias_swiglu_impl``, the default ``--bias-swiglu-fusion``), fused RoPE (the default ``--rope-fusion``), TE's
fused (cuDNN) attention, the mock dataset's attention mask (the default ``--create-attention-mask-in-dataloader``).

Held per layer and micro-batch (``te_layer_bytes``; T tokens, h hidden, f FFN, n / g heads / groups, d head dim):

- TE's LayerNormLinear (``linear_qkv``, ``linear_fc1``: RMSNorm fused into the GEMM) keeps the norm's input
  (``norm.input``: bf16 2h, fp32 rsigma 4 per token) and the norm's output for the weight gradient
  (``attn.qkv_input`` / ``mlp.fc1_input``: bf16 2h; with FP8 its FP8 copy, the transposed (column-wise) data only on
  Hopper: 1 B per element);
- TE's fused attention keeps q and k (RoPE's outputs: 2nd, 2gd), v (a contiguous copy: TE's ``get_qkv_layout``
  makes one of the strided view of the fused QKV output, 2gd), its output (2nd) and the fp32 softmax statistics
  (4n per token);
- ``linear_proj`` keeps its input: the attention's output itself in bf16 (0 more), its FP8 copy with FP8 (nd);
- Megatron's fused SwiGLU keeps its input (``mlp.swiglu_input``: the fc1 output, 2 x 2f); ``linear_fc2`` keeps its
  input (``mlp.fc2_input``: 2f bf16, f with FP8: the SwiGLU output is dropped after the cast).

agoq's saved-tensor scopes (agoq/megatron/saved_scopes.py) store, per the policy, the 16-bit tensors saved inside
each scoped module in the role's format (``QuantFormat.storage_bytes``, as agoq.plan.storage counts them); FP8 data
passes through (1 B as above), and so do the norms' rsigma (under the scope's size floor). The norm's input and
output of a fused LayerNorm-Linear are one scope: the policy gives them one format (refused otherwise, as the
scopes refuse it). ``attn.proj_input`` quantized is a copy beside the bf16 output the attention keeps (a cost, not a
saving, in bf16); attn.q / k / v / out quantized are refused (TE's attention keeps them).

Persistent, besides agoq.plan.peak's weights and gradients:

- Megatron's optimizer on TE: Megatron picks TE's ``FusedAdam`` (megatron.core.optimizer). Without the
  precision-aware optimizer: fp32 master + exp_avg + exp_avg_sq (12 B per parameter, / DP with the distributed
  optimizer) and no step temporaries (multi-tensor kernels, in place). With ``--use-precision-aware-optimizer``
  (requires ``--use-distributed-optimizer``): the fp32 master kept as the 16-bit remainder of the bf16 parameter
  (``store_param_remainders``, Megatron's default: 2 B) and the moments in ``--exp-avg-dtype`` /
  ``--exp-avg-sq-dtype`` (fp32 4, bf16 / fp16 2).
- TE's FP8 weight workspaces (``te_fp8_weight_bytes``): each FP8 Linear / LayerNormLinear caches its weight in FP8
  across micro-batches, row-wise for the forward GEMM and column-wise (transposed) for dgrad on Hopper: 2 B per
  parameter of the layers' linears (the output layer is Megatron's, bf16); delayed scaling's amax histories
  (``--fp8-amax-history-len`` x 3 forward + 2 backward fp32 per module).
- TE's cuBLAS workspace (``TE_CUBLAS_WORKSPACE_BYTES``), beside torch's (CUDA_RUNTIME_BYTES).

Forward/backward: the mock dataset's batch on the GPU (``batch_bytes``: the [b, 1, s, s] bool attention mask, int64
tokens / labels / positions, fp32 loss mask) is alive through the forward, the LM head's peak included.
"""

from __future__ import annotations

from dataclasses import dataclass

from agoq.config import flag_for
from agoq.formats import QuantFormat, parse_format
from agoq.plan.memory import Layout, ModelShape
from agoq.plan.peak import (
    CUDA_RUNTIME_BYTES,
    MASTER_BYTES,
    Recipe,
    StagePeak,
    agoq_step_bytes,
    ddp_construction_bytes,
    grad_buffer_numel,
    layer_backward_transient,
    logits_transient,
    nonfinite_check_bytes,
    param_tensors,
)
from agoq.plan.storage import BF16_BYTES, FP32_BYTES, LayerDims, head_saved_bytes
from agoq.policy import LAYER_ROLES, PolicySpec, ScheduleInfo, Site, resolve

TE_IMPL = "transformer_engine"
IMPLS = ("local", TE_IMPL)
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES_MODELLED = ("delayed",)
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")  # Megatron-LM's --fp8-recipe choices
MOMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MOMENT_DTYPES = ("fp32", "fp16", "bf16", "fp8")  # Megatron-LM's --exp-avg-dtype / --exp-avg-sq-dtype choices
FP8_BYTES = 1
ATTENTION_ROLES = ("attn.q", "attn.k", "attn.v", "attn.out")
FUSED_NORM_ROLES = ("attn.qkv_input", "mlp.fc1_input")  # saved inside one LayerNormLinear with norm.input
# TE 2.x ``get_cublas_workspace_size_bytes`` on sm_90: one 32 MiB workspace, allocated through torch
TE_CUBLAS_WORKSPACE_BYTES = 32 * 2**20
STORE_PARAM_REMAINDER_BYTES = 2  # TE FusedAdam(store_param_remainders=True): the fp32 master's low 16 bits
DELAYED_FWD_TENSORS, DELAYED_BWD_TENSORS = 3, 2  # TE's delayed-scaling meta per module: input/weight/output, grads
TE_MODULES_PER_LAYER = 4  # linear_qkv, linear_proj, linear_fc1, linear_fc2
BATCH_INT64_PER_TOKEN = 3  # tokens, labels, position ids (megatron.training's get_batch)
LOSS_MASK_BYTES = FP32_BYTES

# what TE changes against agoq's local spec (printed by python -m agoq.plan)
TE_TERMS = (
    "activations: TE's LayerNormLinear keeps the norm's input and output (agoq's local spec recomputes the norm "
    "from its quantized input); fused attention's q, k, v, output and fp32 softmax statistics; Megatron's fused "
    "SwiGLU keeps only its input",
    "FP8 (--fp8-format / --fp8-recipe): the QKV, proj, fc1 and fc2 GEMM inputs kept as TE's FP8 copies (1 B per "
    "element), also where the policy quantizes that role (FP8 data passes agoq's scopes)",
    "FP8 weight workspaces: 2 B per layer-linear parameter (row-wise + transposed), persistent",
    "optimizer: Megatron's optimizer on TE's FusedAdam (no step temporaries); precision-aware: 2 B master remainder "
    "+ the moments' dtypes",
    "batch: the mock dataset's [b, 1, s, s] attention mask on the GPU through the forward",
)


@dataclass(frozen=True)
class TESettings:
    """Megatron-LM's TE flags that change memory (``settings_of``)."""

    fp8: bool = False  # --fp8-format given (the recipe: FP8_RECIPES_MODELLED)
    amax_history_len: int = 1024  # --fp8-amax-history-len
    precision_aware: bool = False  # --use-precision-aware-optimizer
    exp_avg: str = "fp32"  # --exp-avg-dtype
    exp_avg_sq: str = "fp32"  # --exp-avg-sq-dtype
    grad_accumulation_fusion: bool = True  # Megatron-LM's default; --no-gradient-accumulation-fusion
    attention_mask: bool = True  # --no-create-attention-mask-in-dataloader: False
    agoq: bool = True  # agoq's door on (False: --agoq-disable: Megatron + TE alone)


def add_arguments(parser) -> None:
    """Megatron-LM's flags of the TE path, as the planner takes them (defaults None: not given)."""
    g = parser.add_argument_group("Transformer Engine (Megatron-LM's flags; the planner models one GPU)")
    g.add_argument("--transformer-impl", choices=IMPLS, default=None,
                   help="transformer_engine: plan Megatron's TE spec (agoq's scopes on TE's modules; "
                        f"{flag_for('enabled')}: Megatron + TE alone)")
    g.add_argument("--fp8-format", choices=FP8_FORMATS, default=None, help="TE's FP8 GEMMs")
    g.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None, help="modelled: delayed")
    g.add_argument("--fp8-amax-history-len", type=int, default=None)
    g.add_argument("--fp8-amax-compute-algo", choices=("max", "most_recent"), default=None)
    g.add_argument("--use-precision-aware-optimizer", action="store_true", default=None)
    g.add_argument("--exp-avg-dtype", choices=MOMENT_DTYPES, default=None)
    g.add_argument("--exp-avg-sq-dtype", choices=MOMENT_DTYPES, default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with --recompute-granularity full; modelled: uniform")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   default=None)
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false", default=None)


TE_ONLY_KEYS = ("fp8_format", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo",
                "use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype", "gradient_accumulation_fusion",
                "create_attention_mask_in_dataloader", "recompute_method")


def is_te(values: dict) -> bool:
    return values.get("transformer_impl") == TE_IMPL


def _flag(key: str) -> str:
    return {"gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
            "create_attention_mask_in_dataloader": "--no-create-attention-mask-in-dataloader"}.get(
        key, "--" + key.replace("_", "-"))


def local_problem(values: dict) -> str | None:
    """A TE-only flag on a plan of agoq's local spec: one line naming it (it would change nothing there)."""
    given = [_flag(k) for k in TE_ONLY_KEYS if values.get(k) is not None]
    if given and not is_te(values):
        return (f"{', '.join(given)}: Megatron-LM's Transformer Engine flags; the planner models them with "
                f"--transformer-impl transformer_engine (agoq's own FP8 on the local spec: {flag_for('fp8.recipe')})")
    return None


def settings_of(values: dict, layout: Layout) -> TESettings:
    """The TE path's settings from the merged flag values, or a ValueError naming the combination not modelled."""
    fmt, recipe = values.get("fp8_format"), values.get("fp8_recipe")
    if recipe is not None and fmt is None:
        raise ValueError(f"--fp8-recipe {recipe} without --fp8-format: Megatron-LM runs bf16 then; give --fp8-format "
                         "hybrid, or drop --fp8-recipe")
    if fmt is not None and (recipe or "delayed") not in FP8_RECIPES_MODELLED:
        raise ValueError(f"--fp8-recipe {recipe}: not modelled by the planner's TE path (modelled: "
                         f"{', '.join(FP8_RECIPES_MODELLED)}; validated on H100, docs/benchmarks/planner.md)")
    single = {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp, "dp": layout.dp}
    many = [f"{_flag(k)} {v}" for k, v in single.items() if v != 1]
    if many or layout.sequence_parallel:
        raise ValueError(f"{', '.join(many) or '--sequence-parallel'} with --transformer-impl transformer_engine: the "
                         "planner's TE path models one GPU (TP = PP = DP = 1); plan --transformer-impl local for "
                         "layouts")
    aware = bool(values.get("use_precision_aware_optimizer"))
    dtypes = {k: values.get(k) or "fp32" for k in ("exp_avg_dtype", "exp_avg_sq_dtype")}
    if not aware and any(v != "fp32" for v in dtypes.values()):
        raise ValueError("--exp-avg-dtype / --exp-avg-sq-dtype other than fp32 need --use-precision-aware-optimizer "
                         "(Megatron-LM refuses them without it)")
    if aware and values.get("grad_reduce_in_bf16"):
        raise ValueError("--grad-reduce-in-bf16 with --use-precision-aware-optimizer: not modelled by the planner's "
                         "TE path (the optimizer's gradient dtype then is --main-grads-dtype's); drop one")
    if aware and not layout.distributed_optimizer:
        raise ValueError("--use-precision-aware-optimizer needs --use-distributed-optimizer (Megatron-LM requires it)")
    for key, dtype in dtypes.items():
        if dtype not in MOMENT_BYTES:
            raise ValueError(f"{_flag(key)} {dtype}: not modelled by the planner (FP8 moments' scales and the peak "
                             "they gave, 23.83 GiB as with bf16 moments in te_baseline_levers.json, are unexplained); "
                             f"modelled: {', '.join(MOMENT_BYTES)}")
    agoq = not values.get("agoq_disable")
    if aware and agoq and values.get("agoq_optimizer") not in (None, "torch"):
        raise ValueError(f"--use-precision-aware-optimizer with {flag_for('optimizer.kind')}: two optimizers; drop one")
    if values.get("recompute_method") not in (None, "uniform"):
        raise ValueError(f"--recompute-method {values['recompute_method']}: not modelled by the planner's TE path "
                         "(modelled: uniform, one layer per group)")
    if values.get("recompute_granularity") == "selective":
        raise ValueError("--recompute-granularity selective with --transformer-impl transformer_engine: not modelled "
                         "(TE's attention recompute); use full or none")
    if agoq and (values.get("agoq_fp8") or values.get("agoq_smooth_swiglu") not in (None, "off")):
        raise ValueError(f"{flag_for('fp8.recipe')} / {flag_for('fp8.smooth_swiglu')} with --transformer-impl "
                         "transformer_engine: TE's modules run the FP8 GEMMs (agoq.megatron.te refuses them); use "
                         "--fp8-format hybrid --fp8-recipe delayed")
    fusion = values.get("gradient_accumulation_fusion")
    fusion = True if fusion is None else fusion
    if agoq and fusion and values.get("agoq_grads") and (values.get("agoq_grads_mode") or "store") == "store":
        raise ValueError(f"{flag_for('grads.format')} (store mode) with gradient-accumulation fusion: TE writes the "
                         "float main_grad the 8-bit store replaces (agoq.megatron.te refuses it); add "
                         "--no-gradient-accumulation-fusion")
    mask = values.get("create_attention_mask_in_dataloader")
    return TESettings(fp8=fmt is not None, amax_history_len=values.get("fp8_amax_history_len") or 1024,
                      precision_aware=aware, exp_avg=dtypes["exp_avg_dtype"], exp_avg_sq=dtypes["exp_avg_sq_dtype"],
                      grad_accumulation_fusion=fusion, attention_mask=True if mask is None else mask, agoq=agoq)


def role_formats(policy: PolicySpec | None, layer_idx: int, layout: Layout) -> dict[str, QuantFormat | None]:
    """role -> the quantized format agoq's scopes store it in on layer ``layer_idx`` (None: as TE saves it), or a
    ValueError where the scopes refuse the policy (agoq.megatron.saved_scopes.check_policy_for_scopes' rules)."""
    if policy is None:
        return dict.fromkeys(LAYER_ROLES)
    schedule = ScheduleInfo(layout.pp, layout.vpp, layout.num_microbatches)
    fmt = {role: resolve(policy, Site(layer_idx, 0, layout.pp, None, None, role), schedule) for role in LAYER_ROLES}
    for role in ATTENTION_ROLES:
        if fmt[role].quantized:
            raise ValueError(f"{policy.source}: layer {layer_idx} role {role} resolves to {fmt[role].name}, but with "
                             "Transformer Engine's attention agoq keeps q / k / v / output as TE saves them (set it to "
                             "bf16, or plan --transformer-impl local)")
    for role in FUSED_NORM_ROLES:
        if fmt[role].name != fmt["norm.input"].name:
            raise ValueError(f"{policy.source}: layer {layer_idx}: norm.input resolves to {fmt['norm.input'].name} "
                             f"and {role} to {fmt[role].name}, but TE's fused LayerNorm-Linear saves both in one "
                             "scope; give them one format, or plan --transformer-impl local")
    return {role: f if f.quantized else None for role, f in fmt.items()}


def _saved(fmt: QuantFormat | None, numel: int, bf16_bytes: int | None = None) -> int:
    """A 16-bit tensor of ``numel`` elements as kept: the scope's format, else bf16."""
    return fmt.storage_bytes(numel) if fmt is not None else (BF16_BYTES * numel if bf16_bytes is None else bf16_bytes)


def te_layer_bytes(formats: dict[str, QuantFormat | None], dims: LayerDims, fp8: bool) -> dict[str, int]:
    """Held bytes of one TE layer and micro-batch, by role (module docstring)."""
    t = dims.tokens
    n, g, d = dims.heads, dims.groups, dims.head_dim
    h, f = dims.hidden, dims.ffn

    def gemm_input(role: str, numel: int, bf16_bytes: int | None = None) -> int:
        return FP8_BYTES * numel if fp8 else _saved(formats[role], numel, bf16_bytes)

    return {
        "norm.input": 2 * (_saved(formats["norm.input"], t * h) + FP32_BYTES * t),
        "attn.qkv_input": gemm_input("attn.qkv_input", t * h),
        "mlp.fc1_input": gemm_input("mlp.fc1_input", t * h),
        "attn.q": BF16_BYTES * t * n * d,
        "attn.k": BF16_BYTES * t * g * d,
        "attn.v": BF16_BYTES * t * g * d,
        "attn.out": BF16_BYTES * t * n * d + FP32_BYTES * t * n,
        "attn.proj_input": gemm_input("attn.proj_input", t * n * d, bf16_bytes=0),  # bf16: attn.out's tensor
        "mlp.swiglu_input": _saved(formats["mlp.swiglu_input"], t * 2 * f),
        "mlp.fc2_input": gemm_input("mlp.fc2_input", t * f),
    }


def te_fp8_weight_bytes(shape: ModelShape, settings: TESettings, layers: int) -> int:
    """TE's FP8 weight workspaces (row-wise + transposed, 1 B each) and delayed-scaling amax histories of ``layers``
    layers (0 without FP8)."""
    if not settings.fp8:
        return 0
    linears = shape.layer_params() - 2 * shape.hidden_size  # the layer's four weights, without the norms'
    history = FP32_BYTES * settings.amax_history_len * (DELAYED_FWD_TENSORS + DELAYED_BWD_TENSORS)
    return layers * (2 * FP8_BYTES * linears + TE_MODULES_PER_LAYER * history)


def batch_bytes(dims: LayerDims, settings: TESettings) -> int:
    """One micro-batch on the GPU (megatron.training's get_batch of the GPT dataset)."""
    mask = dims.micro_batch * dims.seq * dims.seq if settings.attention_mask else 0  # bool [b, 1, s, s]
    return mask + dims.tokens * (8 * BATCH_INT64_PER_TOKEN + LOSS_MASK_BYTES)


def megatron_optimizer_bytes(params: int, buffer: int, settings: TESettings, share: int) -> int:
    """Megatron's optimizer state on TE's FusedAdam (module docstring)."""
    if not settings.precision_aware:
        return 3 * FP32_BYTES * buffer // share
    per = STORE_PARAM_REMAINDER_BYTES + MOMENT_BYTES[settings.exp_avg] + MOMENT_BYTES[settings.exp_avg_sq]
    return per * buffer // share


def layer_dims(shape: ModelShape, layout: Layout) -> LayerDims:
    return LayerDims(seq=layout.seq, micro_batch=layout.mbs, hidden=shape.hidden_size, ffn=shape.ffn_hidden_size,
                     heads=shape.num_attention_heads, groups=shape.num_query_groups)


def held_layers_bytes(shape: ModelShape, layout: Layout, policy: PolicySpec | None, fp8: bool) -> tuple[int, int]:
    """(every layer's held bytes for one micro-batch, the largest single layer's)."""
    dims = layer_dims(shape, layout)
    per = [sum(te_layer_bytes(role_formats(policy, i, layout), dims, fp8).values()) for i in range(shape.num_layers)]
    return sum(per), max(per)


def head_bytes(shape: ModelShape, layout: Layout) -> int:
    return head_saved_bytes(layer_dims(shape, layout), shape.vocab_size)


def predict_te_peak(shape: ModelShape, layout: Layout, policy: PolicySpec | None, recipe: Recipe,
                    settings: TESettings) -> StagePeak:
    """The predicted peak of one GPU on the TE path (``policy`` None: no scopes; ``settings.agoq`` False: Megatron +
    TE alone: ``recipe``'s recompute only). The terms are agoq.plan.peak's, except those the module docstring names."""
    if not settings.agoq:
        policy, recipe = None, Recipe(recompute=recipe.recompute)
    dims = layer_dims(shape, layout)
    tensors = param_tensors(shape, layout, 0)
    params, buffer = sum(tensors), grad_buffer_numel(tensors, layout)
    share = layout.dp if layout.distributed_optimizer else 1
    step_extra, step_source = 0, "step temporaries"
    if recipe.grads is not None:  # agoq's 8-bit store (agoq.plan.peak.predict_peaks' terms)
        grads = int(parse_format(recipe.grads).bytes_per_element() * params)
        grads += BF16_BYTES * params if recipe.grad_error_feedback else 0
        if recipe.optimizer == "torch":
            step_extra += FP32_BYTES * buffer // share  # the float buffer the reduced gradients are dequantized into
    else:
        grads = layout.grad_bytes * buffer
        if recipe.optimizer == "torch" and layout.grad_bytes != FP32_BYTES:
            step_extra += FP32_BYTES * buffer // share  # Megatron's main_grad.float() copies for the fp32 step
    if recipe.optimizer == "torch":  # Megatron's optimizer on TE's FusedAdam: no step temporaries
        optimizer = megatron_optimizer_bytes(params, buffer, settings, share)
    else:
        per_param = sum(parse_format(m).bytes_per_element() for m in recipe.moments) + MASTER_BYTES[recipe.master]
        optimizer = int(per_param * params / share)
        step_extra += agoq_step_bytes(max(tensors), recipe)
    if settings.agoq and recipe.grads is None:  # agoq's non-finite check of the float buffer
        step_extra = max(step_extra, nonfinite_check_bytes(buffer, layout.grad_bytes))
    layers, largest = held_layers_bytes(shape, layout, policy, settings.fp8)
    if recipe.recompute:  # Megatron's full recompute, one layer per group (agoq.plan.peak.predict_peaks)
        layers = shape.num_layers * BF16_BYTES * dims.tokens * dims.hidden + largest
    head, batch = head_bytes(shape, layout), batch_bytes(dims, settings)
    swiglu_quantized = policy is not None and role_formats(policy, shape.num_layers - 1, layout)["mlp.swiglu_input"]
    backward = layer_backward_transient(dims, bool(swiglu_quantized), False)
    if settings.grad_accumulation_fusion:  # TE adds the weight gradient into main_grad: no bf16 wgrad
        backward -= BF16_BYTES * 2 * dims.ffn * dims.hidden
    # the loss's and the output layer's backward release the head's saves and forward_step's batch before the
    # last layer's backward
    transient, source = max((logits_transient(dims, shape.vocab_size), "LM-head logits"),
                            (backward - head - batch, "layer backward"))
    return StagePeak(0, BF16_BYTES * params, grads, optimizer, CUDA_RUNTIME_BYTES + TE_CUBLAS_WORKSPACE_BYTES,
                     layers + head + batch, transient, step_extra, source,
                     te_fp8_weight_bytes(shape, settings, shape.num_layers),
                     ddp_construction_bytes(BF16_BYTES * params, buffer, layout, recipe), head, step_source)
