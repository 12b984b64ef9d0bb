"""The contract table: every megatron-core symbol agoq touches, and what agoq relies on about each.

Data only: :class:`Symbol` (one row: a symbol's path, why agoq uses it, the parameters / dataclass fields /
attributes it must have) and :data:`CONTRACT` (the rows for megatron-core). The checks that read a table against
the installed megatron-core (the supported version, ``contract_problems``, ``check``) live in
``agoq/megatron/compat.py``. The split is data from code: the table grows by a row with every new seam agoq opens,
while the checks are a small fixed piece of code that also reads other tables (the megatron.training rows of
``agoq.megatron.megatron_lm``).

Add a row here whenever agoq code starts to use a new Megatron symbol, parameter or field.
Verified on: megatron-core 0.19.2 (``agoq.megatron.compat.SUPPORTED_MCORE_VERSIONS``).
Guarded by: ``tests/megatron/test_contract.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Symbol:
    """A Megatron symbol agoq uses, and what agoq relies on about it.

    ``params`` must all be parameters of the callable (or of the class's ``__init__``);
    ``fields`` must all be dataclass fields; ``attrs`` must all be attributes.
    """

    path: str  # "module.path:Qualified.name"
    why: str
    params: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()


_TC_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func",
    "add_bias_linear", "hidden_dropout", "attention_dropout", "bf16", "params_dtype", "pipeline_dtype",
    "use_cpu_initialization", "init_method_std", "gradient_accumulation_fusion", "batch_p2p_sync",
    "batch_p2p_comm", "overlap_p2p_comm",
    "no_sync_func", "grad_sync_func", "finalize_model_grads_func", "deallocate_pipeline_outputs",
    "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size",
    "tensor_model_parallel_size", "sequence_parallel", "context_parallel_size", "softmax_type",
    "window_size", "apply_query_key_layer_scaling", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_modules", "apply_rope_fusion", "rotary_interleaved",
    "fused_single_qkv_rope",
)

CONTRACT: tuple[Symbol, ...] = (
    Symbol("megatron.core.parallel_state:initialize_model_parallel", "process groups",
           params=("tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "virtual_pipeline_model_parallel_size")),
    Symbol("megatron.core.parallel_state:destroy_model_parallel", "tear-down between runs"),
    Symbol("megatron.core.parallel_state:is_pipeline_first_stage", "per-chunk pre_process",
           params=("ignore_virtual", "vp_stage")),
    Symbol("megatron.core.parallel_state:is_pipeline_last_stage", "per-chunk post_process",
           params=("ignore_virtual", "vp_stage")),
    Symbol("megatron.core.parallel_state:get_pipeline_model_parallel_rank", "stage of this rank"),
    Symbol("megatron.core.parallel_state:get_pipeline_model_parallel_group",
           "the pipeline group a chunk's layer rows are resolved on (agoq.megatron.seqpar.block_spec; the layers' "
           "default pg_collection.pp)"),
    Symbol("megatron.core.parallel_state:get_data_parallel_rank", "data sharding",
           params=("with_context_parallel",)),
    Symbol("megatron.core.parallel_state:get_data_parallel_group", "loss averaging",
           params=("with_context_parallel",)),
    Symbol("megatron.core.tensor_parallel.random:_get_cuda_rng_state",
           "CPU mode replaces it (CheckpointFunction: full and selective recompute)", params=("device", "clone")),
    Symbol("megatron.core.tensor_parallel.random:_set_cuda_rng_state", "CPU mode replaces it (no-op)",
           params=("new_state", "device")),
    Symbol("megatron.core.transformer.attention:Attention._checkpointed_attention_forward",
           "--recompute-granularity selective: core attention under CheckpointFunction (agoq.plan.storage)",
           params=("query", "key", "value", "attention_mask")),
    Symbol("megatron.core.tensor_parallel:model_parallel_cuda_manual_seed",
           "seeding; CPU runs pass inference_rng_tracker=True (no CUDA RNG state); CUDA graphs "
           "use_cudagraphable_rng=True (CudaGraphManager's requirement without Transformer Engine)",
           params=("seed", "inference_rng_tracker", "use_cudagraphable_rng", "force_reset_rng")),
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig", "LLaMA config",
           fields=_TC_FIELDS),
    # agoq's fused RoPE (agoq/megatron/rope.py, its seam card): the slot TE fills, and the dispatch that calls it
    # as (t, freqs, interleaved=config.rotary_interleaved) for bshd inputs when config.apply_rope_fusion
    Symbol("megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb",
           "the fused-RoPE slot (None without Transformer Engine) agoq.megatron.rope fills"),
    Symbol("megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb_thd",
           "the packed-sequence slot: agoq.megatron.rope puts a refusal naming the fix there (no thd kernel)"),
    # the QKV split + RoPE slot (agoq.megatron.rope, second seam): a module global TE defines (undefined without it)
    # and its flag; Attention.forward calls it as (mixed_qkv, q_freqs, k_freqs, qkv_split_arg_list) for
    # self-attention under config.fused_single_qkv_rope, from get_query_key_value_tensors(split_qkv=False)
    Symbol("megatron.core.transformer.attention:HAVE_FUSED_QKV_ROPE",
           "the QKV split + RoPE slot's flag (False without Transformer Engine) agoq.megatron.rope sets"),
    Symbol("megatron.core.transformer.attention:Attention.get_query_key_value_tensors",
           "fused_single_qkv_rope: the unsplit QKV output and its split sizes [P D, D, D]",
           params=("hidden_states", "key_value_states", "output_gate", "split_qkv")),
    Symbol("megatron.core.models.common.embeddings.rope_utils:apply_rotary_pos_emb",
           "RoPE dispatch: the fused slot under apply_rope_fusion, mscale 1, no cu_seqlens",
           params=("t", "freqs", "config", "cu_seqlens", "mscale")),
    # the one seam to Megatron's modules (agoq/megatron/specs.py): agoq's provider builds the local layer's slots
    Symbol("megatron.core.models.backends:LocalSpecProvider",
           "AgoqSpecProvider subclasses it (a BackendSpecProvider): the one place naming agoq's module classes",
           attrs=("column_parallel_linear", "row_parallel_linear", "fuse_layernorm_and_linear",
                  "column_parallel_layer_norm_linear", "layer_norm", "core_attention", "grouped_mlp_modules",
                  "activation_func")),
    Symbol("megatron.core.models.backends:BackendSpecProvider", "the provider protocol AgoqSpecProvider implements",
           attrs=("column_parallel_linear", "row_parallel_linear", "fuse_layernorm_and_linear",
                  "column_parallel_layer_norm_linear", "layer_norm", "core_attention")),
    Symbol("megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_submodules",
           "the local layer whose slots, bda functions and key map agoq's specs.layer_submodules mirrors "
           "(tests/megatron/test_specs.py compares them)", params=("normalization",)),
    Symbol("megatron.core.transformer.attention:SelfAttention", "the self-attention module of agoq's layer spec",
           params=("config", "submodules", "layer_number", "attn_mask_type")),
    Symbol("megatron.core.fusions.fused_bias_dropout:get_bias_dropout_add", "self_attn_bda / mlp_bda of the spec"),
    Symbol("megatron.core.transformer.enums:AttnMaskType", "causal mask of the spec's self-attention",
           attrs=("causal",)),
    Symbol("megatron.core.transformer.identity_op:IdentityOp", "q_layernorm / k_layernorm (no QK norm)"),
    Symbol("megatron.core.transformer.attention:SelfAttentionSubmodules",
           "spec substitution of core attention", fields=("linear_qkv", "core_attention", "linear_proj")),
    Symbol("megatron.core.transformer.dot_product_attention:DotProductAttention",
           "SDPACoreAttention mirrors its constructor and forward",
           params=("config", "layer_number", "attn_mask_type", "attention_type", "attention_dropout",
                   "softmax_scale", "cp_comm_type", "pg_collection")),
    Symbol("megatron.core.models.gpt:GPTModel", "one model chunk per (pp rank, vp stage)",
           params=("config", "transformer_layer_spec", "vocab_size", "max_sequence_length",
                   "pre_process", "post_process", "share_embeddings_and_output_weights",
                   "position_embedding_type", "rotary_base", "rope_scaling", "rope_scaling_factor", "pg_collection",
                   "vp_stage")),
    # LLaMA-3 scaled RoPE (--use-rope-scaling): GPTModel passes the factor; the bands are _apply_scaling's defaults
    # (agoq.megatron.model.check_rope_scaling_bands compares them with agoq.ref.rope.LLAMA3_ROPE_FIXED)
    Symbol("megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding._apply_scaling",
           "LLaMA-3 frequency bands (defaults read by check_rope_scaling_bands)",
           params=("freqs", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    Symbol("megatron.core.distributed:DistributedDataParallel", "grad buffers and reduction",
           params=("config", "ddp_config", "module", "disable_bucketing")),
    Symbol("megatron.core.distributed:DistributedDataParallelConfig", "DDP options",
           fields=("grad_reduce_in_fp32", "overlap_grad_reduce", "use_distributed_optimizer",
                   "check_for_nan_in_grad", "bucket_size")),
    # --overlap-param-gather (agoq/train/pretrain.py ddp_config, training.ParamGather / configure_grad_hooks):
    # Megatron's DDP forward pre-hooks all-gather the updated params in the next forward; the trainer forces the
    # gather (disable with param_sync=True) before saves, evaluation and at the end, and re-enables the hooks
    Symbol("megatron.core.distributed:DistributedDataParallelConfig", "--overlap-param-gather",
           fields=("overlap_param_gather", "align_param_gather", "use_distributed_optimizer", "overlap_grad_reduce")),
    Symbol("megatron.core.distributed:DistributedDataParallel",
           "--overlap-param-gather: pre-hooks toggled around saves / evaluation / the end; start_param_sync is "
           "the interleaved schedule's param_sync_func (align_param_gather)",
           attrs=("enable_forward_pre_hook", "disable_forward_pre_hook", "start_param_sync")),
    Symbol("megatron.core.distributed:DistributedDataParallel.disable_forward_pre_hook",
           "called with param_sync=True: the forced all-gather of the updated params", params=("param_sync",)),
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "param_sync_func: per-chunk start_param_sync for the interleaved schedule (align_param_gather)",
           fields=("param_sync_func",)),
    Symbol("megatron.core.distributed:finalize_model_grads", "end-of-step grad sync hook"),
    Symbol("megatron.core.optimizer:get_megatron_optimizer", "Megatron's optimizer factory",
           params=("config", "model_chunks")),
    Symbol("megatron.core.optimizer:OptimizerConfig", "optimizer options",
           fields=("optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                   "clip_grad", "bf16", "params_dtype", "use_distributed_optimizer")),
    Symbol("megatron.core.optimizer_param_scheduler:OptimizerParamScheduler",
           "LR schedule; on resume ckpt/load.py sets its two mode attributes (named as these parameters) "
           "before load_state_dict",
           params=("optimizer", "init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                   "lr_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style",
                   "use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler"),
           attrs=("state_dict", "load_state_dict", "step")),
    Symbol("megatron.core.pipeline_parallel:get_forward_backward_func", "schedule selection"),
    Symbol("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
           "1F1B keyword arguments; the stage proxy (agoq.megatron.stage_proxy) passes its own pipeline neighbours "
           "(p2p_communicator) and process groups (pg_collection)",
           params=("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                   "micro_batch_size", "forward_only", "p2p_communicator", "pg_collection")),
    Symbol("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator",
           "what 1F1B asks of its p2p_communicator (agoq.megatron.stage_proxy.FirstStageNeighbours answers it)",
           attrs=("is_pp_first_stage", "is_pp_last_stage", "total_stages", "current_stage", "recv_forward",
                  "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
                  "send_backward_recv_forward")),
    Symbol("megatron.core.dist_checkpointing:save", "checkpoint save",
           params=("sharded_state_dict", "checkpoint_dir")),
    Symbol("megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
           "pre-created from agoq's queue server (ckpt/queue_server.py): a save survives SIGTERM, and no spawned "
           "copy of the training script serves it"),
    Symbol("megatron.core.dist_checkpointing:load", "checkpoint load",
           params=("sharded_state_dict", "checkpoint_dir")),
    # 8-bit gradients (agoq/megatron/grads/ddp.py): subclass + bucket-group class swap (private API).
    Symbol("megatron.core.distributed:DistributedDataParallel", "subclassed for 8-bit grads",
           params=("config", "ddp_config", "module", "disable_bucketing", "pg_collection"),
           attrs=("_make_backward_post_hook", "zero_grad_buffer", "scale_gradients", "finish_grad_sync", "no_sync")),
    Symbol("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup", "class swap -> AgoqBucketGroup",
           params=("buckets", "ddp_config", "collective_group", "collective_group_size"),
           attrs=("start_grad_sync", "finish_grad_sync", "check_grads", "register_grad_ready", "reset")),
    Symbol("megatron.core.distributed.param_and_grad_buffer:shard_buffer", "distopt owned shard view",
           params=("buffer", "data_parallel_world_size")),
    Symbol("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucket", "bucket fields read",
           params=("params", "param_data", "grad_data", "offset", "numel_unpadded", "gradient_scaling_factor",
                   "bucket_id", "param_index_map", "params_with_extra_main_grads")),
    Symbol("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer",
           "store mode: grad_data allocated on meta by deferred_grad_buffer.GradBufferOnMeta during __init__ "
           "(torch.zeros(..., requires_grad=False), param_data first under the distributed optimizer: checked "
           "after construction); grad_data / bucket.grad_data / main_grad re-pointed by DeferredGradBuffer",
           params=("ddp_config", "param_dtype", "grad_dtype", "params_with_names", "nccl_ub"),
           attrs=("scale_gradients", "reset")),
    Symbol("megatron.core.distributed:DistributedDataParallelConfig", "ddp fields read by agoq",
           fields=("use_distributed_optimizer", "overlap_grad_reduce", "average_in_collective",
                   "check_for_nan_in_grad", "check_for_large_grads", "num_distributed_optimizer_instances",
                   "grad_reduce_in_fp32")),
    Symbol("megatron.core.transformer.module:Float16Module", "bf16 wrap (as Megatron's get_model)",
           params=("config", "module")),
    # activation storage (agoq/megatron/layers.py, sites.py): spec substitution + _forward_impl overrides.
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayer",
           "AgoqTransformerLayer subclass (spec.module, agoq/megatron/transformer_layer.py); global 1-based "
           "layer_number, pp group; submodules built in __init__ from the per-layer spec copy agoq passes",
           params=("config", "submodules", "layer_number", "pg_collection", "vp_stage", "is_mtp_layer",
                   "add_layer_offset")),
    Symbol("megatron.core.transformer.transformer_layer:get_transformer_layer_offset",
           "ModelPlan.stage: the chunk's first global layer, once per chunk, before the build (each layer checks "
           "TransformerLayer.layer_number against its row after)", params=("config", "vp_stage", "pp_rank")),
    Symbol("megatron.core.process_groups_config:ProcessGroupCollection.use_mpu_process_groups",
           "AgoqTransformerLayer's pg_collection default, as TransformerLayer's"),
    Symbol("megatron.core.transformer.spec_utils:ModuleSpec",
           "per-layer constructor arguments of agoq's modules (params passed to __init__ by build_module)",
           fields=("module", "params", "submodules")),
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayerSubmodules",
           "agoq norms and MLP substituted in the spec",
           fields=("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")),
    Symbol("megatron.core.tensor_parallel.layers:ColumnParallelLinear._forward_impl",
           "AgoqColumnParallelLinear overrides it to store a quantized input", params=("input", "weight")),
    Symbol("megatron.core.tensor_parallel.layers:RowParallelLinear._forward_impl",
           "AgoqRowParallelLinear overrides it to store a quantized input", params=("input", "weight")),
    Symbol("megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication",
           "saves (input, weight) for backward; agoq swaps saved tensor 0 of its autograd node "
           "(LinearWithGradAccumulationAndAsyncCommunicationBackward, checked per call: node name, input identity)",
           attrs=("forward", "backward")),
    Symbol("megatron.core.transformer.mlp:MLP.forward", "AgoqMLP re-implements it for SwiGLU recompute, "
           "Smooth-SwiGLU and plain SwiGLU fused with an FP8 fc2 (its unfused glu: silu(x_glu) * (x_linear + "
           "glu_linear_offset), what the fused kernel reproduces)", params=("hidden_states", "per_token_scale")),
    Symbol("megatron.core.transformer.mlp:MLP.as_mlp_submodule",
           "AgoqMLP builder in the layer spec; AgoqMLP.as_mlp_submodule re-implements its body (plus agoq's "
           "keywords) and passes these on to MLP.__init__",
           params=("submodules", "config", "pg_collection", "is_mtp_layer", "is_expert", "input_size",
                   "ffn_hidden_size", "name")),
    Symbol("megatron.core.transformer.mlp:MLPSubmodules", "fc1 / fc2 substitution",
           fields=("linear_fc1", "linear_fc2", "activation_func")),
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "AgoqMLP / AgoqRMSNorm support checks; recompute settings",
           fields=("glu_linear_offset", "activation_func_clamp_value", "use_te_activation_func",
                   "layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm",
                   "recompute_method", "recompute_num_layers")),
    # FP8 linears and Smooth-SwiGLU (agoq/megatron/layers.py, compute.py): the same spec seams, plus these.
    Symbol("megatron.core.tensor_parallel.layers:linear_with_grad_accumulation_and_async_allreduce",
           "the keyword arguments ColumnParallelLinear/RowParallelLinear pass to _forward_impl, read by the FP8 path",
           params=("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
                   "grad_output_buffer", "wgrad_deferral_limit", "tp_group", "gtp_remat_size")),
    Symbol("megatron.core.tensor_parallel.layers:RowParallelLinear.forward",
           "fused Smooth-SwiGLU + FP8 fc2 (agoq.ops.smooth_swiglu_fp8): AgoqMLP calls linear_fc2 with the fc1 output "
           "[.., 2F]; forward hands its input (input_is_parallel) to _forward_impl without a width check, then "
           "all-reduces over TP and adds the bias (megatron-core 0.19.2)", params=("input_",)),
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "AgoqTransformerLayer refuses Megatron's norm recompute and MLP chunking under a recomputing policy "
           "(agoq.megatron.transformer_layer.check_megatron_recompute)",
           fields=("recompute_granularity", "recompute_modules", "mlp_chunks_for_training")),
    # the norm + linear node (agoq.ops.norm_linear): QKV / fc1 decide at construction whether they take it
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "the norm + linear node is built only where Megatron's linear runs none of what it does not implement "
           "(_AgoqLinearMixin._takes_norm_feed)",
           fields=("gradient_accumulation_fusion", "sequence_parallel", "defer_embedding_wgrad_compute")),
    Symbol("megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward",
           "the norm + linear node (and, for a QKV / fc1 storing its own input, the quantized-input node) takes QKV / "
           "fc1's _forward_impl call (allreduce_dgrad: the dgrad all-reduce it "
           "runs itself, over tp_group); instance attributes set in __init__ and read at construction, absent ones "
           "taken as off: gtp_remat_size, explicit_expert_comm, disable_grad_reduce", params=("input_", "weight")),
    # the SwiGLU + fc2 node (agoq.ops.swiglu_linear) and the quantized-input linear node (agoq.ops.quant_linear)
    Symbol("megatron.core.tensor_parallel.layers:RowParallelLinear.forward",
           "the SwiGLU + linear node and the quantized-input node take fc2's / the out-projection's _forward_impl "
           "call (bias=None, allreduce_dgrad=False, sequence_parallel=False); forward then all-reduces the output over "
           "TP (reduce-scatters under sequence parallelism) and adds the bias", params=("input_",)),
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "the SwiGLU + linear node and the quantized-input node are built only where Megatron's linear runs none of "
           "what they do not implement (_AgoqLinearMixin._takes_swiglu_feed / _quantized_input_node)",
           fields=("gradient_accumulation_fusion", "sequence_parallel", "defer_embedding_wgrad_compute")),
    Symbol("megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication",
           "agoq.ops.linear_math reproduces its backward (no gradient-accumulation fusion): grad_input = grad_output "
           "@ W, the async dgrad all-reduce (or, under sequence parallelism, the re-gather of the saved sharded input "
           "and the reduce-scatter of grad_input) waited for after the wgrad GEMM on 2-D contiguous operands, the "
           "bias gradient as a sum over tokens; bit-identity tested on CPU, TP=2 (with sequence parallelism too), CUDA",
           attrs=("forward", "backward")),
    Symbol("megatron.core.tensor_parallel.layers:LinearWithFrozenWeight",
           "agoq.ops.linear_math.frozen_linear_backward reproduces its backward (dgrad through a 2-D view, a "
           "synchronous all-reduce, no weight or bias gradient)", attrs=("forward", "backward")),
    # sequence parallelism on agoq's spec (agoq/megatron/seqpar.py, its seam card)
    Symbol("megatron.core.transformer.transformer_block:TransformerBlockSubmodules",
           "GPTModel gets the block's submodules, one layer spec per layer with its resolved row (agoq.megatron."
           "layer_plan); under sequence parallelism agoq's RMSNorm is the final norm (Megatron's WrappedTorchNorm "
           "refuses sequence parallelism)", fields=("layer_specs", "layer_norm")),
    Symbol("megatron.core.transformer.transformer_block:LayerNormImpl",
           "the final norm of the block's submodules without sequence parallelism (Megatron's _get_block_submodules "
           "picks it for a layer spec)"),
    Symbol("megatron.core.transformer.transformer_block:get_num_layers_to_build",
           "the layer count of a chunk's block submodules (as Megatron's _get_block_submodules counts it)",
           params=("config", "vp_stage", "pp_rank")),
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayerSubmodules",
           "checkpoint keys: the norms saved under TE's fused norm + linear names, as Megatron's local spec does",
           fields=("sharded_state_dict_keys_map", "self_attn_bda", "mlp_bda")),
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayer.sharded_state_dict",
           "applies the spec's sharded_state_dict_keys_map (apply_prefix_mapping) to the layer's checkpoint keys",
           params=("prefix", "sharded_offsets", "metadata")),
    Symbol("megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads",
           "all-reduces over TP the gradients of parameters with sequence_parallel=True under sequence parallelism "
           "(AgoqRMSNorm marks its weight so)", params=("model", "config")),
    Symbol("megatron.core.tensor_parallel.layers:RowParallelLinear.forward",
           "under sequence parallelism the output is reduce-scattered along the sequence after _forward_impl "
           "(per-token Smooth-SwiGLU then multiplies by this rank's shard of its scale: AgoqMLP)", params=("input_",)),
    Symbol("megatron.core.tensor_parallel.mappings:copy_to_tensor_model_parallel_region",
           "FP8 column-parallel linear: identity forward, TP all-reduce of dgrad", params=("input_", "group")),
    Symbol("megatron.core.transformer.mlp:MLP.__init__",
           "AgoqMLP reads self.tp_group (per-token Smooth-SwiGLU scale all-reduce) set from this parameter",
           params=("config", "submodules", "tp_group", "is_expert", "input_size", "ffn_hidden_size", "name")),
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "plain SwiGLU fused with an FP8 fc2 (AgoqMLP.plain_fusion_problems): only where MLP.forward runs its "
           "unfused glu (no bias_activation_fusion: the compiled bias_swiglu rounds differently)",
           fields=("bias_activation_fusion", "activation_func", "gated_linear_unit", "activation_func_clamp_value",
                   "glu_linear_offset", "use_te_activation_func")),
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "Smooth-SwiGLU / FP8 support checks, first/last bf16 layers",
           fields=("num_layers", "glu_linear_offset", "sequence_parallel", "gated_linear_unit",
                   "gradient_accumulation_fusion", "use_te_activation_func")),
    # CUDA graphs (agoq/megatron/graphs.py): the trainer's flags, the per-feature refusals, the FP8 graph mode
    Symbol("megatron.core.transformer.transformer_config:TransformerConfig",
           "CUDA graphs: --cuda-graph-impl local, whole-layer graphs, warm-up passes (agoq.megatron.model); agoq's "
           "features refused or allowed per graph implementation (agoq.megatron.graphs)",
           fields=("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_warmup_steps", "pipeline_model_parallel_size")),
    Symbol("megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.forward",
           "lru_cache'd: one rotary table shared by every micro-batch; under local graphs at PP > 1 the trainer clears "
           "it before each micro-batch (agoq.megatron.graphs.rope_per_microbatch: Megatron's shared graph-input "
           "buffer is released only once every runner using it is captured)", attrs=("cache_clear",)),
    Symbol("megatron.core.transformer.cuda_graphs:CudaGraphManager",
           "agoq.megatron.graphs.captured_graphs reads each manager's cudagraph_runners and their fwd_graph / "
           "bwd_graph (the trainer's report after iteration 1)", params=("config",), attrs=("get_cudagraph_runner",)),
    Symbol("megatron.core.transformer.cuda_graphs:is_graph_warmup",
           "agoq.megatron.graphs.graph_phase: Megatron's eager warm-up passes before a capture (FP8 state records "
           "nothing there; the weight cache prepares its graph state)"),
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayer.forward",
           "AgoqTransformerLayer.forward sets its FP8 linears' graph phase, then calls it (*args, **kwargs); "
           "Megatron's CudaGraphManager runs it through nn.Module.__call__ in record, warm-up and capture",
           params=("hidden_states", "attention_mask")),
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayer.create_mcore_cudagraph_manager",
           "with cuda_graph_impl='local' a TransformerLayer builds its CudaGraphManager in __init__: agoq's "
           "feature check runs before (AgoqTransformerLayer), tests stub it on the CPU", params=("config",)),
    Symbol("megatron.core.utils:get_pg_rank", "pipeline rank of a layer (agoq.megatron.sites)"),
    # agoq optimizers under the distributed optimizer (agoq/megatron/optim/dist_optimizer.py, its seam card):
    # DistributedOptimizer subclassed in precision-aware mode, checkpoint methods replaced, aligned layout.
    Symbol("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
           "AgoqDistributedOptimizer: bf16 shards + .decoupled_grad (precision-aware mode); own checkpoints",
           params=("optimizer", "config", "grad_scaler", "init_state_fn", "model_chunks", "per_model_buffers",
                   "data_parallel_group", "data_parallel_group_gloo", "data_parallel_group_idx",
                   "distributed_optimizer_instance_id"),
           attrs=("_get_model_param_range_map", "_copy_model_grads_to_main_grads", "_copy_main_params_to_model_params",
                  "step_with_ready_grads", "sharded_state_dict", "load_state_dict", "zero_grad")),
    # 8-bit gradient store under the distributed optimizer (agoq/megatron/grads/grad_reader.py, its seam card): the
    # reduced shard stays 8-bit; Megatron's optimizer is class-swapped to read it, agoq's reads it per shard.
    Symbol("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
           "class swap -> ShardGradsDistributedOptimizer (fp32 shard .grad from the 8-bit store); reads the "
           "instance attributes model_float16_groups / shard_fp32_from_float16_groups / model_fp32_groups / "
           "shard_fp32_groups / grad_scaler (tests/megatron/test_ddp_agoq.py)",
           attrs=("_copy_model_grads_to_main_grads", "_get_model_param_range_map", "clip_grad_norm")),
    Symbol("megatron.core.optimizer.optimizer:ChainedOptimizer", "its distributed optimizers get readers",
           params=("chained_optimizers",)),
    Symbol("megatron.core.optimizer.optimizer:_get_param_grad_norm_group", "grad-norm groups (MTP) refused"),
    Symbol("megatron.core.optimizer:OptimizerConfig", "precision-aware mode switched on after construction",
           fields=("use_precision_aware_optimizer", "bf16", "use_distributed_optimizer")),
    Symbol("megatron.core.process_groups_config:ProcessGroupCollection.setup_process_groups_for_optimizer",
           "the distributed optimizer's process groups", params=("pg_collection", "model_chunks",
                                                                "use_gloo_process_groups")),
    Symbol("megatron.core.distributed:DistributedDataParallel", "aligned buffer layout for agoq's shards",
           params=("full_param_layout",)),
    Symbol("megatron.core.distributed.param_and_grad_buffer:group_params_for_buffers", "buffer grouping",
           params=("params", "grad_reduce_in_fp32")),
    Symbol("megatron.core.optimizer.param_layout:PerBufferParamLayout", "aligned layout per buffer",
           fields=("param_index_map", "bucket_indices", "per_bucket_numel_unpadded", "param_indices",
                   "num_optimizer_shards")),
    Symbol("megatron.core.optimizer.param_layout:FullParamLayout", "aligned layout", fields=("layouts",)),
    Symbol("megatron.core.optimizer.param_layout:bucket_end_divisor", "Megatron's bucket padding rule",
           params=("data_parallel_world_size", "pad_for_high_nccl_busbw")),
    Symbol("megatron.core.optimizer.param_layout:pad_to_divisor", "padding helper", params=("value", "divisor")),
    Symbol("megatron.core.distributed:DistributedDataParallelConfig", "aligned layout inputs",
           fields=("pad_buckets_for_high_nccl_busbw", "num_distributed_optimizer_instances", "use_megatron_fsdp",
                   "bucket_size")),
    Symbol("megatron.core.dist_checkpointing.mapping:ShardedTensor",
           "irregular 1-D pieces (axis_fragmentations=None) of DP-sharded agoq states",
           fields=("key", "data", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations",
                   "replica_id")),
    Symbol("megatron.core.dist_checkpointing:load_common_state_dict", "saved data-parallel size before a load",
           params=("checkpoint_dir",)),
    Symbol("megatron.core.utils:get_pg_size", "pipeline size of a layer (agoq.megatron.sites)"),
    # gradient release (agoq/megatron/optim/release.py, its seam card): a buffer-less data-parallel wrapper, a
    # no-op finalize hook and an FP32Optimizer subclass whose step() steps nothing.
    Symbol("megatron.core.distributed.data_parallel_base:_BaseDataParallel",
           "ReleaseDataParallel subclass: the chunk interface the schedules / StepRunner / checkpoints call",
           params=("config", "module"),
           attrs=("no_sync", "start_grad_sync", "finish_grad_sync", "zero_grad_buffer", "scale_gradients",
                  "broadcast_params", "state_dict", "load_state_dict")),
    Symbol("megatron.core.utils:get_model_config", "schedules find .config through the .module chain",
           params=("model",)),
    Symbol("megatron.core.distributed:finalize_model_grads", "finalize_release_grads mirrors its signature",
           params=("model", "num_tokens", "pg_collection", "force_all_reduce")),
    Symbol("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
           "one micro-batch: no_sync() is entered around no backward, finalize_model_grads_func once",
           params=("forward_step_func", "data_iterator", "model", "num_microbatches", "forward_only")),
    Symbol("megatron.core.optimizer.optimizer:FP32Optimizer",
           "AgoqMegatronOptimizer / AgoqReleaseOptimizer base; step() returns (success, grad_norm, num_zeros)",
           params=("optimizer", "config", "init_state_fn"),
           attrs=("step", "zero_grad", "prepare_grads", "step_with_ready_grads", "sharded_state_dict",
                  "load_state_dict", "param_groups")),
    # agoq on modules it did not build (agoq/megatron/saved_scopes.py, agoq/megatron/te.py): TE's or the local spec
    Symbol("megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_with_transformer_engine_spec",
           "the TE layer spec Megatron-LM builds for --transformer-impl transformer_engine (agoq.megatron.te)",
           params=("num_experts", "moe_grouped_gemm", "qk_layernorm")),
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayer",
           "saved-tensor scopes find a layer's modules by these submodule names and its global index by layer_number "
           "(agoq.megatron.saved_scopes)", params=("layer_number", "vp_stage")),
    Symbol("megatron.core.transformer.transformer_layer:TransformerLayerSubmodules",
           "the submodule names the saved-tensor scopes look up (agoq.megatron.saved_scopes._SCOPES)",
           fields=("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")),
    Symbol("megatron.core.transformer.attention:SelfAttentionSubmodules",
           "linear_qkv / linear_proj: the attention's saved-tensor scopes (agoq.megatron.saved_scopes)",
           fields=("linear_qkv", "core_attention", "linear_proj")),
    Symbol("megatron.core.transformer.mlp:MLPSubmodules",
           "linear_fc1 / linear_fc2: the MLP's saved-tensor scopes (agoq.megatron.saved_scopes)",
           fields=("linear_fc1", "linear_fc2")),
)
