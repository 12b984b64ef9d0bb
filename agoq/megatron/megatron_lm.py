"""agoq inside Megatron-LM's own trainer, ``megatron.training.pretrain`` (shipped in the megatron-core wheel).

The plugin side of the door to Megatron-LM (``python -m agoq.megatron_lm SCRIPT``, agoq/train/
megatron_lm_door.py, and ``scripts/pretrain_gpt_agoq.py`` through it); it takes agoq's typed config only. The flags and
the bridge from Megatron's parsed args (``add_agoq_args``, ``agoq_config_from_megatron_args``, ``gpt_model_options``)
are the trainer side: agoq/train/megatron_lm.py.

* :func:`agoq_gpt_layer_spec` — agoq's layer spec for Megatron's ``GPTModel`` after the trainer's policy / FP8 checks;
  :func:`offer_layer_spec` puts it where Megatron-LM's ``--spec`` finds it (both construction paths read ``--spec``);
* :func:`build_gpt_model` — the body of a model provider (scripts/pretrain_gpt_agoq.py): ``GPTModel`` over that spec;
* :func:`install_for_megatron_training` — ``agoq.megatron.install.install`` plus the runtime patches
  ``megatron.training`` needs (below), returned as one ``Handle`` whose ``undo()`` reverts them.

Seam card
---------
Touches (megatron-core 0.19.2, ``megatron/training/``):
  * ``--spec MODULE NAME`` (``args.spec``; Megatron-LM's flag, read by ``argument_utils.gpt_config_from_args`` into
    ``GPTModelConfig.transformer_layer_spec``, which ``GPTModelBuilder.build_model`` uses as given, and by Megatron-LM's
    ``gpt_builder``) — spec substitution: :func:`offer_layer_spec` (runtime change ``megatron_training.layer_spec``:
    the module attribute the name points to).
  * ``training.pretrain(..., model_provider=)`` and ``get_model``'s provider call
    ``(pre_process, post_process, vp_stage, config, pg_collection)`` — public: :func:`build_gpt_model`.
  * ``training.DDP`` (the module global ``get_model`` wraps chunks with) and
    ``models.dist_utils.DistributedDataParallel`` (``GPTModelBuilder.build_distributed_models`` wraps them with it,
    through ``_ddp_wrap``) — both replaced by one class (patches ``megatron_training.ddp`` and
    ``megatron_training.builder_ddp``) only with ``--agoq-grads FORMAT`` (agoq's 8-bit gradient DDP,
    agoq/megatron/grads/ddp.py) or agoq's optimizer (under ``--use-distributed-optimizer``: Megatron's DDP with the
    quantization-group-aligned buffer layout, agoq/megatron/optim/dist_optimizer.py).
  * ``training.get_megatron_optimizer`` — the module global ``setup_model_and_optimizer`` calls on both paths;
    replaced (patch ``megatron_training.optimizer``) with a function that builds agoq's optimizer
    (``--agoq-optimizer adamw|lion|sgd``, agoq/megatron/optim/optimizer.py) or Megatron's and attaches agoq's
    8-bit gradient reader (agoq/megatron/grads/grad_reader.py) when ``--agoq-grads`` is on.
  * ``training.setup_model_and_optimizer`` — the module global ``pretrain`` calls; wrapped (patch
    ``megatron_training.built_check``, agoq on) to check on every rank what was built (agoq/megatron/built_check.py).
  * ``megatron.core.datasets.utils.compile_helpers`` — replaced (patch ``megatron_training.dataset_helpers``,
    every run, the baseline too) by a function that runs Megatron's own only when the compiled
    ``helpers_cpp`` module does not import: ``initialize_megatron`` runs ``make`` in the package's
    datasets folder, but the 0.19.2 wheel ships the compiled module without its Makefile, so ``make``
    fails and Megatron exits (``sys.exit(1)``) before training (measured on CPU with the wheel).
  * ``training.build_train_valid_test_datasets`` — wrapped (patch ``megatron_training.empty_splits``, every run):
    a split Megatron asks for no sample (``--eval-iters 0``) gets no dataset, so no loader (Megatron's sampler asserts
    "no sample to consume: 0" on an empty dataset; measured on CPU with a provider that returns every split).
Why: ``megatron.training`` offers no config hook for the DDP class, the optimizer factory or a step after the model
  is built (its ``get_model`` / ``_ddp_wrap`` / ``setup_model_and_optimizer`` / ``pretrain`` read module globals), so
  these are runtime patches, recorded with ``agoq.megatron.install.set_module_attr`` (marked, logged, undone by the
  handle). The layer spec goes in through Megatron-LM's own ``--spec`` (no patch of a model builder).
Verified on: megatron-core 0.19.2 (CPU: flags, config, patches and undo, both construction paths and Megatron-LM
  core_r0.19.0's pretrain_gpt.py bit-identical to ``scripts/pretrain_llama.py``; one H100, before the door: the
  reference script's losses equal to ``scripts/pretrain_llama.py``'s, benchmarks/results/megatron_lm.json).
When disabled: ``--agoq-disable`` patches only the dataset helpers and the empty-split fix (no number changes);
  ``scripts/pretrain_gpt_agoq.py`` builds Megatron's local-spec GPT (with agoq's SDPA attention unless
  ``--agoq-attention megatron``), the zero-edit door leaves the script's model as it is.
Guarded by: ``tests/megatron/test_megatron_lm.py``, ``tests/megatron/test_megatron_lm_door.py``,
  ``tests/megatron/test_built_check.py`` (CPU), ``tests/gpu/test_megatron_lm_gpu.py`` (GPU).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from agoq.config import AgoqConfig, flag_for
from agoq.megatron import compat
from agoq.megatron.contract import Symbol

log = logging.getLogger("agoq.megatron_lm")

SEAM_DDP = "megatron_training.ddp"
SEAM_BUILDER_DDP = "megatron_training.builder_ddp"
SEAM_OPTIMIZER = "megatron_training.optimizer"
SEAM_HELPERS = "megatron_training.dataset_helpers"
SEAM_EMPTY_SPLITS = "megatron_training.empty_splits"
SEAM_BUILT_CHECK = "megatron_training.built_check"
SEAM_LAYER_SPEC = "megatron_training.layer_spec"

# The megatron.training symbols this module relies on (agoq.megatron.contract.CONTRACT's rows for megatron.core; this
# table is checked by install_for_megatron_training only, so agoq's own trainer never imports megatron.training)
MEGATRON_TRAINING_CONTRACT: tuple[Symbol, ...] = (
    Symbol("megatron.training.training:pretrain", "the entry (config container first since 0.19)",
           params=("cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func",
                   "model_provider")),
    Symbol("megatron.training.training:DDP", "module global get_model wraps chunks with (agoq's DDP seam)"),
    Symbol("megatron.training.training:get_megatron_optimizer",
           "module global setup_model_and_optimizer calls (agoq's optimizer seam)",
           params=("config", "model_chunks", "config_overrides", "use_gloo_process_groups", "pg_collection",
                   "dump_param_to_param_group_map")),
    Symbol("megatron.training.training:wrap_model_chunks_with_ddp",
           "calls DP(config=, ddp_config=, module=, disable_bucketing=[, full_param_layout=]) with DP = the "
           "module global DDP (agoq's class: isinstance checks in train() / evaluate())",
           params=("model_chunks", "config", "ddp_config", "DP", "bucket_sizes", "disable_bucketing_per_chunk")),
    Symbol("megatron.training.arguments:parse_and_validate_args", "Megatron's flags + extra_args_provider",
           params=("extra_args_provider", "ignore_unknown_args", "args_defaults")),
    Symbol("megatron.training.arguments:parse_args",
                  "the door's first parse (refusals before Megatron's argument dump)",
                  params=("extra_args_provider", "ignore_unknown_args")),
    Symbol("megatron.training.training:setup_model_and_optimizer",
                  "module global pretrain() calls; returns (model chunks, optimizer, scheduler): the built check",
                  params=("model_type", "model_provider_func", "checkpointing_context", "cfg_container",
                          "pg_collection")),
    Symbol("megatron.training.training:build_train_valid_test_datasets",
                  "module global the loader builder calls with the provider and the samples per split",
                  params=("build_train_valid_test_datasets_provider", "train_valid_test_num_samples")),
    Symbol("megatron.training.training:get_train_valid_test_num_samples", "samples per split"),
    Symbol("megatron.training.training:train_step",
                  "module global train() calls once per iteration (--agoq-log-json reads its reduced losses)",
                  params=("forward_step_func", "data_iterator", "model", "optimizer", "iteration")),
    Symbol("megatron.training.training:training_log",
                  "its printed loss: the fp32 sum since the last print over the iterations it advanced; the first "
                  "iteration is printed without a reset (--agoq-log-json's megatron_log_lm_loss mirrors it)",
                  params=("loss_dict", "total_loss_dict", "iteration", "skipped_iter", "is_first_iteration")),
    Symbol("megatron.training.models.dist_utils:DistributedDataParallel",
                  "module global the model builder's _ddp_wrap wraps chunks with (agoq's DDP seam, builder path)"),
    Symbol("megatron.training.models.dist_utils:_ddp_wrap",
                  "calls DP(config=, ddp_config=, module=, disable_bucketing=, pg_collection=[, full_param_layout=]) "
                  "with DP = the module global DistributedDataParallel",
                  params=("model", "ddp_config", "pg_collection")),
    Symbol("megatron.training.argument_utils:gpt_config_from_args",
                  "GPTModelConfig from args; --spec (args.spec) becomes its transformer_layer_spec",
                  params=("args", "config", "model_config_cls")),
    Symbol("megatron.training.models.gpt:GPTModelConfig", "the builder path's model config",
                  fields=("transformer", "transformer_layer_spec", "vocab_size", "seq_length")),
    Symbol("megatron.training.models.gpt:GPTModelBuilder.build_model",
                  "uses a ModuleSpec transformer_layer_spec as given (agoq's, through --spec)",
                  params=("pg_collection", "pre_process", "post_process", "vp_stage")),
    Symbol("megatron.core.transformer.spec_utils:import_module", "--spec MODULE NAME -> vars(MODULE)[NAME]",
                  params=("module_path",)),
    Symbol("megatron.training.argument_utils:core_transformer_config_from_args",
                  "the model's TransformerConfig"),
    Symbol("megatron.training.argument_utils:pretrain_cfg_container_from_args", "pretrain's first argument",
           params=("args", "model_cfg")),
    Symbol("megatron.training.global_vars:get_tokenizer", "vocabulary and end-of-document id for GPTDataset"),
    Symbol("megatron.core.datasets.gpt_dataset:GPTDatasetConfig", "Megatron's data pipeline",
           fields=("random_seed", "sequence_length", "blend", "blend_per_split", "split", "path_to_cache",
                   "mmap_bin_files", "tokenizer", "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
                   "create_attention_mask")),
    Symbol("megatron.core.models.gpt:GPTModel", "model provider",
           params=("config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process",
                   "post_process", "fp16_lm_cross_entropy", "parallel_output",
                   "share_embeddings_and_output_weights", "position_embedding_type", "rotary_percent",
                   "rotary_base", "rope_scaling", "rope_scaling_factor", "vp_stage")),
)


# -- model provider ---------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class GPTModelOptions:
    """What the model provider needs besides Megatron's TransformerConfig
    (agoq.train.megatron_lm.gpt_model_options
    reads them from Megatron's parsed args)."""

    attention: str = "sdpa"
    """Core attention: sdpa (torch scaled_dot_product_attention) or megatron (the local spec's DotProductAttention)."""
    vocab_size: int
    """Padded vocabulary (Megatron's ``padded_vocab_size``)."""
    max_sequence_length: int
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    fp16_lm_cross_entropy: bool = False
    tokens_per_microbatch: int = 0
    """Sequence length x micro-batch size (the FP8 dimension checks)."""


def agoq_gpt_layer_spec(config: AgoqConfig, options: GPTModelOptions, transformer_config, *,
                        num_microbatches: int = 1):
    """agoq's layer spec for Megatron's ``GPTModel`` (Megatron's local spec with agoq's modules and the model's plan:
    policy and FP8 settings, resolved per layer before the build, agoq.megatron.layer_plan; Megatron's local spec
    with agoq's SDPA attention when agoq is disabled), after the checks
    ``scripts/pretrain_llama.py`` makes before training (policy rules that decide no site or cannot take effect; FP8
    dimensions). ``transformer_config``: Megatron's (agoq changes none of its fields); ``num_microbatches`` feeds a
    policy's ``auto`` bits."""
    import torch

    from agoq.megatron import model as mmodel
    from agoq.policy import ScheduleInfo

    tc = transformer_config
    compute = config.fp8 if config.enabled else None
    if compute is not None and compute.fp8_enabled:
        from agoq.megatron.compute import check_compute

        check_compute(compute, torch.device("cuda", torch.cuda.current_device()), num_layers=tc.num_layers,
                      hidden=tc.hidden_size, ffn=tc.ffn_hidden_size, heads=tc.num_attention_heads,
                      groups=tc.num_query_groups or tc.num_attention_heads, tp=tc.tensor_model_parallel_size,
                      tokens_per_microbatch=options.tokens_per_microbatch)
    schedule = ScheduleInfo(pp_size=tc.pipeline_model_parallel_size, vp_size=tc.virtual_pipeline_model_parallel_size,
                            num_microbatches=num_microbatches)
    if config.enabled:
        _check_policy(config.policy.spec, tc.num_layers, schedule)
    if options.rope_scaling:  # --use-rope-scaling: megatron-core's fixed LLaMA-3 bands, as agoq documents them
        mmodel.check_rope_scaling_bands()
    return mmodel.agoq_layer_spec(options.attention, policy=config.policy.spec if config.enabled else None,
                                  schedule=schedule, compute=compute)


def build_gpt_model(config: AgoqConfig, options: GPTModelOptions, transformer_config, *, pre_process: bool,
                    post_process: bool, vp_stage: int | None = None, num_microbatches: int = 1):
    """One GPTModel chunk for ``megatron.training.get_model`` (the body of a model provider) over
    :func:`agoq_gpt_layer_spec`; Megatron's local-spec model with agoq disabled."""
    from megatron.core.models.gpt import GPTModel

    from agoq.megatron.seqpar import block_spec  # under --sequence-parallel: agoq's final norm (its seam card)

    spec = agoq_gpt_layer_spec(config, options, transformer_config, num_microbatches=num_microbatches)
    return GPTModel(
        config=transformer_config, transformer_layer_spec=block_spec(spec, transformer_config, vp_stage),
        vocab_size=options.vocab_size,
        max_sequence_length=options.max_sequence_length, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=options.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=options.share_embeddings_and_output_weights,
        position_embedding_type=options.position_embedding_type, rotary_percent=options.rotary_percent,
        rotary_base=options.rotary_base, rope_scaling=options.rope_scaling,
        rope_scaling_factor=options.rope_scaling_factor, vp_stage=vp_stage,
    )


LAYER_SPEC_SLOT = "MEGATRON_LM_LAYER_SPEC"
"""The name under which :func:`offer_layer_spec` puts agoq's spec in this module, for Megatron-LM's ``--spec``."""


def offer_layer_spec(spec) -> list[str]:
    """Put ``spec`` (agoq's ``ModuleSpec``) where Megatron-LM's ``--spec MODULE NAME`` finds it and return that
    ``[MODULE, NAME]`` for ``args.spec``: both construction paths of megatron.training 0.19 read it
    (``argument_utils.gpt_config_from_args`` puts it in ``GPTModelConfig.transformer_layer_spec``, which
    ``GPTModelBuilder.build_model`` uses; Megatron-LM's ``gpt_builder`` passes it to ``GPTModel``). Recorded as a
    runtime change (patch ``megatron_training.layer_spec``): ``handle.undo()`` removes it."""
    import sys

    from agoq.megatron.install import set_module_attr

    set_module_attr(sys.modules[__name__], LAYER_SPEC_SLOT, spec, seam=SEAM_LAYER_SPEC, allow_absent=True)
    return [__name__, LAYER_SPEC_SLOT]


def _check_policy(spec, num_layers: int, schedule) -> None:
    """The policy checks scripts/pretrain_llama.py makes before training (agoq.policy.check_rules_used, a rule that
    decides no site; agoq.plan.storage.check_requests_take_effect, a role request that never takes effect), on
    Megatron-LM's layout; uneven layer splits are left to Megatron's own layout checks."""
    from agoq.plan.storage import check_requests_on_model
    from agoq.policy import check_rules_used, model_sites

    if num_layers % (schedule.pp_size * (schedule.vp_size or 1)):
        return
    check_rules_used(spec, model_sites(num_layers, schedule))
    check_requests_on_model(spec, num_layers, schedule)


# -- runtime patches --------------------------------------------------------------------------------

def _ddp_class(config: AgoqConfig) -> type:
    """The class put in place of ``megatron.training.training.DDP`` (``get_model`` constructs it; ``train()`` and
    ``evaluate()`` check ``isinstance(chunk, DDP)``, so it is a class, a subclass of Megatron's DDP).

    With ``--agoq-grads FORMAT``: agoq's 8-bit gradient DDP with Megatron's buffer layout (as
    ``scripts/pretrain_llama.py`` builds it). Otherwise, with agoq's optimizer under
    ``--use-distributed-optimizer``: Megatron's DDP with the quantization-group-aligned layout in place of
    the one ``wrap_model_chunks_with_ddp`` computed (agoq/megatron/optim/dist_optimizer.py)."""
    from megatron.core.distributed import DistributedDataParallel

    from agoq.megatron.grads.ddp import AgoqDistributedDataParallel
    from agoq.megatron.optim.optimizer import shard_alignment_for

    grads = config.grads if config.grads.quantized else None
    options = config.optimizer

    class AgoqMegatronTrainingDDP(AgoqDistributedDataParallel if grads is not None else DistributedDataParallel):
        def __init__(self, config, ddp_config, module, disable_bucketing=False, **kwargs):
            if grads is not None:
                # AgoqDistributedDataParallel computes Megatron's default layout itself (the one get_model
                # computed), as in scripts/pretrain_llama.py
                kwargs.pop("full_param_layout", None)
                kwargs["grads"] = grads
            else:
                align = shard_alignment_for(options, ddp_config.use_distributed_optimizer)
                if align:
                    from agoq.megatron.model import _aligned_layout

                    kwargs["full_param_layout"] = _aligned_layout(module, ddp_config, disable_bucketing, align)
            super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing, **kwargs)

    return AgoqMegatronTrainingDDP


@dataclass
class _OptimizerFactory:
    """Stands in for ``megatron.training.training.get_megatron_optimizer`` (same call)."""

    config: AgoqConfig
    original: object

    def __call__(self, config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                 pg_collection=None, dump_param_to_param_group_map=None):
        from agoq.megatron.grads import grad_reader
        from agoq.megatron.optim.optimizer import build_agoq_optimizer

        if self.config.optimizer.agoq:
            # agoq's param groups use Megatron's standard rule (no weight decay for biases and 1-D params):
            # the only override megatron.training passes without --decoupled-lr / muP (refused earlier)
            return build_agoq_optimizer(self.config, config, model_chunks)
        optimizer = self.original(config, model_chunks, config_overrides=config_overrides,
                                  use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
                                  dump_param_to_param_group_map=dump_param_to_param_group_map)
        grad_reader.attach(optimizer, model_chunks)  # 8-bit gradient store: the optimizer reads shards from it
        return optimizer


def _compile_helpers_if_missing(original):
    """Megatron's ``compile_helpers`` only when the compiled ``helpers_cpp`` is not importable (a source checkout
    without a build); the wheel has the module but no Makefile."""

    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()
            return
        log.info("megatron.core.datasets.helpers_cpp is importable (the wheel's build); not running make")

    return compile_helpers


def _drop_unasked_splits(original):
    """``build_train_valid_test_datasets`` whose valid / test datasets are None when Megatron asks them for no sample
    (``--eval-iters 0``): Megatron builds a loader for every dataset it gets, and its sampler asserts ("no sample to
    consume: 0") on a dataset of 0 samples; with None it builds no loader and runs no evaluation, as ``--eval-iters 0``
    asks. The train split and every split asked for samples are returned as built."""

    def build_train_valid_test_datasets(build_train_valid_test_datasets_provider, train_valid_test_num_samples=None):
        from megatron.training.training import get_train_valid_test_num_samples

        wanted = train_valid_test_num_samples
        if wanted is None:
            wanted = get_train_valid_test_num_samples()
        built = original(build_train_valid_test_datasets_provider, wanted)
        return type(built)(None if index > 0 and count == 0 else ds
                           for index, (ds, count) in enumerate(zip(built, wanted, strict=True)))

    return build_train_valid_test_datasets


def _built_check(config: AgoqConfig, original):
    """``setup_model_and_optimizer`` that, once Megatron has built the model, its DDP and the optimizer, checks on every
    rank that they are what ``config`` asks for (agoq.megatron.built_check; all ranks stop together on a mismatch)."""

    @functools.wraps(original)  # Megatron's signature (the contract check reads it)
    def setup_model_and_optimizer(*args, **kwargs):
        import torch
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args

        from agoq.megatron.built_check import Expectation, any_rank_failed, built_summary, check_built
        from agoq.policy import ScheduleInfo

        model, optimizer, scheduler = original(*args, **kwargs)
        margs = get_args()
        schedule = ScheduleInfo(pp_size=margs.pipeline_model_parallel_size,
                                vp_size=margs.virtual_pipeline_model_parallel_size,
                                num_microbatches=get_num_microbatches())
        te = config.enabled and margs.transformer_impl == "transformer_engine"
        if te:  # TE's layers: the policy through saved-tensor scopes (agoq.megatron.te, agoq.megatron.saved_scopes)
            from agoq.megatron.saved_scopes import apply_saved_scopes

            stats, _ = apply_saved_scopes(model, config.policy.spec, schedule)
            if torch.distributed.get_rank() == 0:
                print(f"agoq: {stats.scopes} saved-tensor scopes on Transformer Engine's modules (rank 0)", flush=True)
        expect = Expectation(
            attention=getattr(margs, "agoq_attention", "sdpa"), schedule=schedule, transformer_engine=te,
            how_to_fix="Run the script through agoq's door, python -m agoq.megatron_lm path/to/pretrain_gpt.py "
                       "<flags> (it gives both construction paths of megatron.training agoq's layer spec, DDP and "
                       "optimizer; docs/megatron_lm.md)")
        check_built(config, model, optimizer, expect, rank=torch.distributed.get_rank(), agree=any_rank_failed)
        if torch.distributed.get_rank() == 0:
            print(f"agoq: built as asked on every rank; rank 0: {built_summary(model, optimizer)}", flush=True)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def patches_needed(config: AgoqConfig) -> tuple[str, ...]:
    """The runtime patches of megatron.training that ``config`` needs: the dataset-helper build fix and the empty-split
    fix (``--eval-iters 0``) always, the baseline too (neither changes a number); with agoq on, the check of what was
    built; the DDP (both construction paths) and optimizer seams for 8-bit gradients or agoq's optimizer."""
    always = (SEAM_HELPERS, SEAM_EMPTY_SPLITS)
    if not config.enabled:
        return always
    if config.grads.quantized or config.optimizer.agoq:
        return (*always, SEAM_DDP, SEAM_BUILDER_DDP, SEAM_OPTIMIZER, SEAM_BUILT_CHECK)
    return (*always, SEAM_BUILT_CHECK)


def install_for_megatron_training(config: AgoqConfig):
    """``agoq.megatron.install.install(config)`` (contract check, FP8 weight-cache hook), the checkpoint writers'
    queue (agoq.megatron.ckpt.queue_server), agoq's RoPE in Megatron's
    empty fused-RoPE slot when Megatron-LM's rope fusion is on (agoq.megatron.rope; a Transformer Engine RoPE is
    kept) with agoq on, plus the patches of ``megatron.training`` the config needs (:func:`patches_needed`); returns
    the install ``Handle``: ``handle.undo()`` puts Megatron's objects back (identical objects)."""
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.models.dist_utils as dist_utils
    import megatron.training.training as mtt

    from agoq.megatron.ckpt.save import install_results_queue
    from agoq.megatron.install import install, mark, set_module_attr

    compat.check(MEGATRON_TRAINING_CONTRACT)
    if config.device != "cuda":
        raise ValueError(f"AgoqConfig.device={config.device!r}: megatron.training runs on CUDA only; build the "
                         "config with agoq_config_from_megatron_args")
    handle = install(config)
    # Megatron-LM's saves report their writers' results through agoq's queue server (seam checkpoint.results_queue,
    # undone by the handle), not a spawned copy of the user's script (4.9 s and 739 MiB per rank, measured) that a
    # stop signal sent to the whole job (Slurm's) would kill in the middle of the save it asked for
    install_results_queue()
    if config.enabled and config.rope_fusion == "agoq":  # Megatron-LM's --rope-fusion (its default) without TE
        from agoq.megatron.rope import provide_rope_fusion

        provide_rope_fusion()  # agoq's kernel where TE's is absent (else TransformerConfig refuses the flag)
    ddp_class = None
    patched = []
    for seam in patches_needed(config):
        if seam == SEAM_HELPERS:
            module, name = dataset_utils, "compile_helpers"
            value = mark(_compile_helpers_if_missing(dataset_utils.compile_helpers), seam)
        elif seam == SEAM_EMPTY_SPLITS:
            module, name = mtt, "build_train_valid_test_datasets"
            value = mark(_drop_unasked_splits(mtt.build_train_valid_test_datasets), seam)
        elif seam in (SEAM_DDP, SEAM_BUILDER_DDP):  # one class for both paths: get_model's and the model builder's
            ddp_class = ddp_class or mark(_ddp_class(config), SEAM_DDP)
            module, name, value = (mtt, "DDP", ddp_class) if seam == SEAM_DDP else \
                (dist_utils, "DistributedDataParallel", ddp_class)
        elif seam == SEAM_OPTIMIZER:
            module, name = mtt, "get_megatron_optimizer"
            value = mark(_OptimizerFactory(config, mtt.get_megatron_optimizer), seam)
        else:
            module, name = mtt, "setup_model_and_optimizer"
            value = mark(_built_check(config, mtt.setup_model_and_optimizer), seam)
        if getattr(getattr(module, name), "__agoq_patch__", None):
            raise RuntimeError(f"{module.__name__}.{name} is already patched by agoq; call handle.undo() before "
                               "installing again")
        set_module_attr(module, name, value, seam=seam)
        patched.append(f"{module.__name__}.{name}")
    log.info("agoq in megatron.training: patched %s", patched or "nothing")
    return handle


def describe(config: AgoqConfig) -> str:
    """One line for the log: what agoq does in this run."""
    if not config.enabled:
        return f"agoq: disabled ({flag_for('enabled')}): plain Megatron model, DDP and optimizer"
    opt = config.optimizer
    parts = [f"policy {config.policy.path or 'configs/policy/agoq.yaml (default)'}",
             f"gradients {config.grads.format or 'Megatron float'}"
             + (f" ({config.grads.mode} mode)" if config.grads.quantized else ""),
             f"optimizer {'Megatron' if not opt.agoq else f'agoq {opt.kind} ({opt.moments}, master {opt.master})'}",
             f"fp8 {config.fp8.recipe}"]
    return "agoq: " + " | ".join(parts) + f" | patches: {', '.join(patches_needed(config)) or 'none'}"
