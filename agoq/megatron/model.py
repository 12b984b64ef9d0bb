"""LLaMA on megatron-core: TransformerConfig, agoq's layer spec, one GPTModel per chunk, DDP wrap.

Seam card
---------
Touches: ``TransformerConfig``, the layer spec built from agoq's ``BackendSpecProvider`` (agoq.megatron.specs;
  agoq's layer, norm, linear and MLP modules for activation storage and FP8 / Smooth-SwiGLU; ``ModuleSpec.params``
  carries the model's plan, resolved into one spec per layer before the build: agoq.megatron.layer_plan),
  ``GPTModel``, ``DistributedDataParallel`` (public constructors only).
Why: building the model through the spec is the first-choice seam; agoq never patches model code.
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_layouts.py`` (every TP/PP/VPP/DP layout trains the PP=1 model),
  ``tests/megatron/test_activations.py`` (bf16 policy bit-identical to the plain local spec).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from agoq.plan.shape import ModelShape


@dataclass(frozen=True)
class LlamaShape(ModelShape):
    """Architecture of a LLaMA-family decoder (RMSNorm, SwiGLU, RoPE, GQA, no biases; untied unless
    ``share_embeddings_and_output_weights``).

    ``rope_scaling`` / ``rope_scaling_factor``: LLaMA-3.1's scaled RoPE (``rope_type: llama3``), as Megatron's
    ``GPTModel`` takes it (``--use-rope-scaling`` / ``--rope-scaling-factor``); its frequency bands are fixed in
    megatron-core (agoq.ref.rope.LLAMA3_ROPE_FIXED, checked by :func:`check_rope_scaling_bands`).
    ``share_embeddings_and_output_weights``: the output layer uses the embedding's weight (LLaMA-3.2-1B / 3B;
    under pipeline parallelism the last stage holds a copy that Megatron keeps equal). ``unpadded_vocab_size``:
    the tokenizer's vocabulary before padding (recorded with checkpoints; None where unknown). The size fields are
    agoq.plan.shape.ModelShape's; ``vocab_size`` is already padded for TP (agoq.data.tokenizer.padded_vocab_size)."""

    seq_length: int
    rotary_base: int = 10000
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0  # Megatron's default; used with rope_scaling only
    share_embeddings_and_output_weights: bool = False
    unpadded_vocab_size: int | None = None

    def __post_init__(self):
        if self.rope_scaling and not self.rope_scaling_factor > 0:
            raise ValueError(f"--rope-scaling-factor {self.rope_scaling_factor} must be > 0")
        if self.unpadded_vocab_size is not None and not 0 < self.unpadded_vocab_size <= self.vocab_size:
            raise ValueError(f"vocabulary {self.unpadded_vocab_size} does not fit the {self.vocab_size} embedding rows")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} must be divisible by --num-attention-heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} must be divisible by "
                f"--num-query-groups {self.num_query_groups}"
            )

    def num_parameters(self) -> int:
        """Total parameters (embedding + layers + final norm + the output layer unless it shares the embedding's
        weight; a tied model's last-stage copy under pipeline parallelism is the same parameter, counted once)."""
        tables = 1 if self.share_embeddings_and_output_weights else 2
        return self.num_layers * self.layer_params() + tables * self.vocab_size * self.hidden_size + self.hidden_size


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per rank (None = no interleaving)

    def check(self, shape: LlamaShape, world_size: int) -> None:
        """Raise ValueError naming the flag when the layout cannot run."""
        model_parallel = self.tp * self.pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {self.tp} x "
                f"--pipeline-model-parallel-size {self.pp}; launch a multiple of {model_parallel} processes"
            )
        chunks = self.pp * (self.vpp or 1)
        if shape.num_layers % chunks:
            raise ValueError(
                f"--num-layers {shape.num_layers} is not divisible by {chunks} model chunks "
                f"(--pipeline-model-parallel-size {self.pp}"
                + (f" x {self.vpp} virtual stages" if self.vpp else "")
                + "); pick a layer count or layout that divides evenly"
            )
        if self.vpp and self.pp < 2:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        for name, value in (("--num-attention-heads", shape.num_attention_heads),
                            ("--num-query-groups", shape.num_query_groups)):
            if value % self.tp:
                raise ValueError(f"{name} {value} is not divisible by --tensor-model-parallel-size {self.tp}")


def llama_transformer_config(
    shape: LlamaShape, layout: ParallelLayout, *, params_dtype: torch.dtype, use_cpu_initialization: bool,
    recompute_num_layers: int | None = None, selective_recompute: bool = False, cuda_graph_impl: str = "none",
    cuda_graph_warmup_steps: int = 3, rope_fusion: bool = False, sequence_parallel: bool = False,
) -> TransformerConfig:
    """``recompute_num_layers``: Megatron's full activation recompute (granularity "full", method
    "uniform": every group of this many layers saves only its input and reruns its forward in
    backward); None = off. The baseline for equal-memory comparisons. ``selective_recompute``:
    Megatron's selective recompute of core attention (granularity "selective", ``recompute_modules
    ["core_attn"]``; what it saves with SDPA: agoq.plan.storage.megatron_bytes). One of the two at most.
    ``cuda_graph_impl``: Megatron's CUDA graphs ("none", or "local": whole-layer graphs, ``cuda_graph_modules``
    empty, ``cuda_graph_warmup_steps`` eager passes before each capture; agoq.megatron.graphs); with "none" no
    graph field is passed (Megatron's defaults). ``rope_fusion``: Megatron's ``apply_rope_fusion``, its fused-RoPE
    slot filled with agoq's kernel where Transformer Engine does not fill it (agoq.megatron.rope: the same values
    and gradients as the unfused RoPE, 2 launches per query / key instead of ~21), and ``fused_single_qkv_rope``,
    self-attention's QKV split + RoPE as one op (the same values and gradients as the split path).
    ``sequence_parallel``: Megatron's sequence parallelism (TP > 1; agoq's layers only: agoq.megatron.seqpar)."""
    if recompute_num_layers and selective_recompute:
        raise ValueError("--recompute-granularity is full or selective, not both")
    bf16 = params_dtype == torch.bfloat16
    recompute = {}
    if recompute_num_layers:
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=recompute_num_layers)  # fmt: skip
    if selective_recompute:
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if rope_fusion:
        from agoq.megatron.rope import provide_qkv_rope_fusion, provide_rope_fusion

        provide_rope_fusion()
        provide_qkv_rope_fusion()
    graphs = {}
    if cuda_graph_impl != "none":
        graphs = dict(cuda_graph_impl=cuda_graph_impl, cuda_graph_modules=[],
                      cuda_graph_warmup_steps=cuda_graph_warmup_steps)
    return TransformerConfig(
        **recompute,
        **graphs,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=shape.init_method_std,
        bf16=bf16,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        use_cpu_initialization=use_cpu_initialization,
        gradient_accumulation_fusion=False,  # needs APEX/TE fused wgrad kernels
        apply_rope_fusion=rope_fusion,
        fused_single_qkv_rope=qkv_rope_fusable(rope_fusion, shape, layout),
        # CPU runs: p2p has no CUDA stream to synchronize; harmless on GPU (NCCL orders the ops).
        batch_p2p_sync=False,
        **pipeline_p2p_options(layout),
    )


def qkv_rope_fusable(rope_fusion: bool, shape: LlamaShape, layout: ParallelLayout) -> bool:
    """Whether self-attention's QKV split + RoPE runs as one op (``fused_single_qkv_rope``): with the fused RoPE, where
    every tensor-parallel rank holds whole query groups. With fewer groups than ranks Megatron all-gathers a group
    and picks this rank's query heads only on its split path (megatron-core 0.19.2 ``get_query_key_value_tensors``),
    so the unsplit output would carry the other ranks' query heads too: there the split path runs, with agoq's RoPE
    per tensor."""
    return rope_fusion and shape.num_query_groups >= layout.tp


def pipeline_p2p_options(layout: ParallelLayout) -> dict[str, bool]:
    """Megatron-LM's p2p defaults: the interleaved schedule overlaps its sends/receives one by one
    (``overlap_p2p_comm``), 1F1B batches them (``batch_p2p_comm``).

    Not a tuning choice: with PP=2 a rank's previous and next stage are the same peer, and the
    interleaved steady state posts send-prev, recv-prev, send-next, recv-next in one tagless
    ``batch_isend_irecv``. The peer matches them first-in first-out, so activations arrive as
    gradients and gradients as activations (same shape, no error): training diverges silently
    (seen in Megatron-LM's own issue tracker too). Separate forward and backward exchanges
    (overlap mode) keep the pairing right at every PP size; tests/megatron/test_layouts.py compares
    per-parameter gradients of PP=2 x VPP=2 against PP=1.
    """
    interleaved = bool(layout.vpp)
    return {"overlap_p2p_comm": interleaved, "batch_p2p_comm": not interleaved}


def agoq_layer_spec(attention_backend: str, policy=None, schedule=None, compute=None, save_paths=None) -> ModuleSpec:
    """agoq's layer spec: the local GPT layer built from agoq's spec provider (agoq.megatron.specs).

    ``attention_backend``: "sdpa" (agoq's SDPACoreAttention) or "megatron" (DotProductAttention).
    ``policy``: an activation policy (``agoq.policy.PolicySpec`` or a YAML path) or None (no agoq
    activation storage: Megatron's modules). With a policy, the layer, norms, linears and MLP are
    agoq's subclasses (same parameter names, checkpoints unchanged) and the spec's ``params`` carry the model's
    plan (``agoq_plan``: ``agoq.megatron.layer_plan.ModelPlan``: policy, schedule, FP8 settings, byte counter, save
    paths), which resolves each model chunk's layers once, before Megatron builds them: ``build_model_chunks``
    hands Megatron one spec per layer with the layer's resolved row (agoq.megatron.seqpar.block_spec).
    ``schedule`` (``agoq.policy.ScheduleInfo``) is required when the policy uses ``auto``. The plan (byte counter,
    what each layer stores) is ``agoq.megatron.activations.storage_of(spec)``.
    ``compute``: an ``agoq.policy.FP8Spec`` (FP8 linears, Smooth-SwiGLU; agoq.megatron.compute) or None; with it the
    layers are agoq's modules too, policy or not.
    ``save_paths``: an ``agoq.ops.saved_act.SavePaths`` (how the saved-activation code runs on the host;
    the default's fast paths when None); used with a policy, given to every agoq module's constructor.
    """
    from agoq.megatron.specs import AgoqSpecProvider, layer_spec

    if policy is not None:
        from pathlib import Path

        from agoq.policy import PolicySpec, load_policy

        if isinstance(policy, (str, Path)):
            policy = load_policy(policy)
        if not isinstance(policy, PolicySpec):
            raise ValueError(f"policy must be an agoq.policy.PolicySpec or a YAML path, got {type(policy).__name__}")
    if compute is not None and not (compute.fp8_enabled or compute.smooth_swiglu != "off"):
        compute = None
    if policy is None and compute is None:
        return layer_spec(AgoqSpecProvider(attention_backend, agoq_modules=False))
    from agoq.megatron.layer_plan import ModelPlan
    from agoq.ops.saved_act import SavePaths

    plan = ModelPlan(policy, schedule if policy is not None else None, compute, paths=save_paths or SavePaths())
    return layer_spec(AgoqSpecProvider(attention_backend), params={"agoq_plan": plan})


def build_model_chunks(
    shape: LlamaShape, config: TransformerConfig, layer_spec: ModuleSpec, vpp: int | None
) -> list[GPTModel]:
    """One GPTModel per virtual stage of this pipeline rank (Megatron's ``get_model`` layout)."""
    if shape.rope_scaling:
        check_rope_scaling_bands()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunks.append(gpt_chunk(shape, config, layer_spec, stage, pre_process=first, post_process=last))
    return chunks


def gpt_chunk(shape: LlamaShape, config: TransformerConfig, layer_spec: ModuleSpec, vp_stage: int | None, *,
              pre_process: bool, post_process: bool, pg_collection=None) -> GPTModel:
    """One model chunk: Megatron's ``GPTModel`` of ``shape`` with agoq's block spec (agoq.megatron.seqpar.block_spec).
    ``pg_collection``: None for Megatron's process groups (``parallel_state``); agoq.megatron.stage_proxy passes one
    whose pipeline group is a pipeline stage's one-rank stand-in (its layers then resolve their rows on it)."""
    from agoq.megatron.seqpar import block_spec

    pp_group = None if pg_collection is None else pg_collection.pp
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(layer_spec, config, vp_stage, pp_group),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=shape.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=shape.rotary_base,
        rope_scaling=shape.rope_scaling,
        rope_scaling_factor=shape.rope_scaling_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def check_rope_scaling_bands() -> None:
    """agoq's LLaMA-3 RoPE scaling is Megatron's ``RotaryEmbedding(rope_scaling=True)``, whose frequency bands are
    the defaults of its ``_apply_scaling`` (GPTModel passes only the factor). Raise if they are not the ones agoq
    documents and the converter maps (agoq.ref.rope.LLAMA3_ROPE_FIXED): a megatron-core upgrade changed them."""
    import inspect

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from agoq.ref.rope import LLAMA3_ROPE_FIXED

    params = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    found = {name: params[name].default if name in params else None for name in LLAMA3_ROPE_FIXED}
    if any(found[name] is None or float(found[name]) != float(value) for name, value in LLAMA3_ROPE_FIXED.items()):
        raise RuntimeError(f"megatron-core's RotaryEmbedding._apply_scaling defaults are {found}, agoq expects "
                           f"{LLAMA3_ROPE_FIXED} (LLaMA-3.1's); --use-rope-scaling would scale other bands. Use "
                           "megatron-core 0.19.2")


def wrap_ddp(
    chunks: list[GPTModel], config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
    device: torch.device, param_alignment: int | None = None,
) -> list[DistributedDataParallel]:
    """Megatron's get_model wrapping. ``param_alignment`` (elements, with the distributed optimizer):
    every DP shard of every param starts at a multiple of it (agoq.megatron.optim.dist_optimizer)."""
    wrapped = []
    for idx, chunk in enumerate(chunks):
        chunk.to(device)
        if config.bf16 or config.fp16:
            # As Megatron's get_model: casts every parameter (torch RMSNorm gains are created in
            # fp32) and the first stage's input / last stage's output.
            chunk = Float16Module(config, chunk)
        # Megatron's get_model: only the first chunk uses buckets (overlap of later chunks is
        # driven by the interleaved schedule).
        kwargs = {}
        if param_alignment and ddp_config.use_distributed_optimizer:
            kwargs["full_param_layout"] = _aligned_layout(chunk, ddp_config, idx > 0, param_alignment)
        wrapped.append(DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=idx > 0, **kwargs))
    return wrapped


def _aligned_layout(module, ddp_config: DistributedDataParallelConfig, disable_bucketing: bool, align: int):
    from agoq.megatron.optim.dist_optimizer import aligned_full_param_layout, ddp_bucket_size

    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    bucket = ddp_bucket_size(ddp_config, parallel_state.get_data_parallel_world_size(),
                             disable_bucketing=disable_bucketing,
                             pp_rank=parallel_state.get_pipeline_model_parallel_rank())  # fmt: skip
    params = [p for _, p in module.named_parameters() if p.requires_grad]
    return aligned_full_param_layout(params, bucket, dp, ddp_config, align)
