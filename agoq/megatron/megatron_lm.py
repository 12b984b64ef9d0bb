"""agoq inside Megatron-LM's own trainer, ``megatron.training.pretrain`` (shipped in the megatron-core wheel).

What a ``pretrain_gpt.py``-shaped entry script needs (``scripts/pretrain_gpt_agoq.py`` is one):

* :func:`add_agoq_args` — the ``--agoq-*`` flags, for ``extra_args_provider`` (Megatron's own flags unchanged);
* :func:`agoq_config_from_megatron_args` — the run's frozen ``AgoqConfig`` from Megatron's parsed args, after
  checking the combinations agoq cannot run (each error names the flag and the fix);
* :func:`build_gpt_model` — the body of a model provider: Megatron's ``GPTModel`` over agoq's layer spec;
* :func:`install_for_megatron_training` — ``agoq.megatron.install.install`` plus the two runtime patches
  ``megatron.training`` needs (below), returned as one ``Handle`` whose ``undo()`` reverts them.

Seam card
---------
Touches (megatron-core 0.19.2, ``megatron/training/``):
  * ``arguments.parse_and_validate_args(extra_args_provider=)`` — public hook: :func:`add_agoq_args`.
  * ``training.pretrain(..., model_provider=)`` and ``get_model``'s provider call
    ``(pre_process, post_process, vp_stage, config, pg_collection)`` — public: :func:`build_gpt_model`
    (the model's ``TransformerConfig`` is Megatron's own, ``argument_utils.core_transformer_config_from_args``).
  * ``training.DDP`` — the module global ``get_model`` wraps chunks with; replaced (patch
    ``megatron_training.ddp``) only with ``--agoq-grads FORMAT`` (agoq's 8-bit gradient DDP,
    agoq/megatron/ddp.py) or with agoq's optimizer under ``--use-distributed-optimizer`` (Megatron's DDP
    with the quantization-group-aligned buffer layout, agoq/megatron/dist_optimizer.py).
  * ``training.get_megatron_optimizer`` — the module global ``setup_model_and_optimizer`` calls; replaced
    (patch ``megatron_training.optimizer``) with a function that builds agoq's optimizer
    (``--agoq-optimizer adamw|lion|sgd``, agoq/megatron/optimizer.py) or Megatron's and attaches agoq's
    8-bit gradient reader (agoq/megatron/grad_reader.py) when ``--agoq-grads`` is on.
  * ``megatron.core.datasets.utils.compile_helpers`` — replaced (patch ``megatron_training.dataset_helpers``,
    every run, the baseline too) by a function that runs Megatron's own only when the compiled
    ``helpers_cpp`` module does not import: ``initialize_megatron`` runs ``make`` in the package's
    datasets folder, but the 0.19.2 wheel ships the compiled module without its Makefile, so ``make``
    fails and Megatron exits (``sys.exit(1)``) before training (measured on CPU with the wheel).
Why: ``megatron.training`` offers no config hook for the DDP class or the optimizer factory (its
  ``get_model`` / ``setup_model_and_optimizer`` read module globals), so these two are runtime patches,
  recorded with ``agoq.megatron.install.set_module_attr`` (marked, logged, undone by the handle). A
  plain baseline (``--agoq-disable``) or agoq's activation storage alone patches nothing.
Verified on: megatron-core 0.19.2 (CPU: flags, config, patches and undo; one H100: losses equal to
  ``scripts/pretrain_llama.py``'s, benchmarks/results/megatron_lm.json).
When disabled: ``--agoq-disable`` builds Megatron's local-spec GPT (with agoq's SDPA attention unless
  ``--agoq-attention megatron``) and installs nothing but the contract check.
Guarded by: ``tests/megatron/test_megatron_lm.py`` (CPU), ``tests/gpu/test_megatron_lm_gpu.py`` (GPU).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from agoq.config import (
    DEFAULT_MASTER,
    DEFAULT_MOMENTS,
    GRAD_MODES,
    MASTER_CHOICES,
    MOMENT_PRESETS,
    OPTIMIZERS,
    AgoqConfig,
)
from agoq.megatron import compat
from agoq.policy import FP8_RECIPES, SMOOTH_SWIGLU_MODES, load_policy

log = logging.getLogger("agoq.megatron_lm")

DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "configs" / "policy" / "agoq.yaml"
ATTENTION_CHOICES = ("sdpa", "megatron")
SEAM_DDP = "megatron_training.ddp"
SEAM_OPTIMIZER = "megatron_training.optimizer"
SEAM_HELPERS = "megatron_training.dataset_helpers"

# The megatron.training symbols this module relies on (agoq.megatron.compat.CONTRACT's rows for megatron.core; this
# table is checked by install_for_megatron_training only, so agoq's own trainer never imports megatron.training)
MEGATRON_TRAINING_CONTRACT: tuple[compat.Symbol, ...] = (
    compat.Symbol("megatron.training.training:pretrain", "the entry (config container first since 0.19)",
           params=("cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func",
                   "model_provider")),
    compat.Symbol("megatron.training.training:DDP", "module global get_model wraps chunks with (agoq's DDP seam)"),
    compat.Symbol("megatron.training.training:get_megatron_optimizer",
           "module global setup_model_and_optimizer calls (agoq's optimizer seam)",
           params=("config", "model_chunks", "config_overrides", "use_gloo_process_groups", "pg_collection",
                   "dump_param_to_param_group_map")),
    compat.Symbol("megatron.training.training:wrap_model_chunks_with_ddp",
           "calls DP(config=, ddp_config=, module=, disable_bucketing=[, full_param_layout=]) with DP = the "
           "module global DDP (agoq's class: isinstance checks in train() / evaluate())",
           params=("model_chunks", "config", "ddp_config", "DP", "bucket_sizes", "disable_bucketing_per_chunk")),
    compat.Symbol("megatron.training.arguments:parse_and_validate_args", "Megatron's flags + extra_args_provider",
           params=("extra_args_provider", "args_defaults")),
    compat.Symbol("megatron.training.argument_utils:core_transformer_config_from_args",
                  "the model's TransformerConfig"),
    compat.Symbol("megatron.training.argument_utils:pretrain_cfg_container_from_args", "pretrain's first argument",
           params=("args", "model_cfg")),
    compat.Symbol("megatron.training.global_vars:get_tokenizer", "vocabulary and end-of-document id for GPTDataset"),
    compat.Symbol("megatron.core.datasets.gpt_dataset:GPTDatasetConfig", "Megatron's data pipeline",
           fields=("random_seed", "sequence_length", "blend", "blend_per_split", "split", "path_to_cache",
                   "mmap_bin_files", "tokenizer", "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
                   "create_attention_mask")),
    compat.Symbol("megatron.core.models.gpt:GPTModel", "model provider",
           params=("config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process",
                   "post_process", "fp16_lm_cross_entropy", "parallel_output",
                   "share_embeddings_and_output_weights", "position_embedding_type", "rotary_percent",
                   "rotary_base", "rope_scaling", "vp_stage")),
)


# Megatron flags that agoq's layers need with agoq on (dest, wanted value, the flag that gives it). agoq's
# layer spec is the local spec of a LLaMA decoder (RMSNorm, SwiGLU, no biases); dropout-free attention.
LLAMA_FLAGS = (
    ("transformer_impl", "local", "--transformer-impl local"),
    ("normalization", "RMSNorm", "--normalization RMSNorm"),
    ("swiglu", True, "--swiglu"),
    ("add_bias_linear", False, "--disable-bias-linear"),
    ("position_embedding_type", "rope", "--position-embedding-type rope"),
)


# -- flags ------------------------------------------------------------------------------------------

def add_agoq_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--agoq-*`` flags to Megatron's parser (``extra_args_provider``); returns the parser.

    Megatron-LM flags keep their meaning: agoq reads ``--recompute-granularity``/``--recompute-num-layers``,
    ``--grad-reduce-in-bf16``, ``--use-distributed-optimizer`` and the optimizer hyperparameters from them."""
    g = parser.add_argument_group("agoq (activation storage, 8-bit gradients, lean optimizers; docs/megatron_lm.md)")
    g.add_argument("--agoq-disable", action="store_true",
                   help="plain Megatron (the baseline): no agoq layers, gradients or optimizer")
    g.add_argument("--agoq-policy", default=None,
                   help="bit-width policy YAML (default: configs/policy/agoq.yaml); see docs/policy.md")
    g.add_argument("--agoq-attention", choices=ATTENTION_CHOICES, default="sdpa",
                   help="core attention: sdpa (torch scaled_dot_product_attention, flash/cuDNN) or megatron "
                        "(the local spec's unfused DotProductAttention); applies with --agoq-disable too")
    g.add_argument("--agoq-grads", default=None, metavar="FORMAT",
                   help="8-bit gradients in DDP, e.g. int8_b256 (default: the policy's grads entry, else Megatron's "
                        "float gradients)")
    g.add_argument("--agoq-grads-mode", choices=GRAD_MODES, default=None,
                   help="reduce: 8-bit communication, float main_grad; store (default): also 8-bit accumulation")
    g.add_argument("--agoq-grads-error-feedback", action="store_true",
                   help="store mode: keep the requantization error in a bf16 residual (+2 bytes/param)")
    g.add_argument("--agoq-optimizer", choices=OPTIMIZERS, default="torch",
                   help="torch: Megatron's own optimizer (--optimizer); adamw/lion/sgd: agoq's, over quantized "
                        "states (lr, weight decay, betas, eps, clipping from Megatron's flags)")
    g.add_argument("--agoq-moments", default=None,
                   help=f"state formats of agoq's optimizer: preset {sorted(MOMENT_PRESETS)} or '<m fmt>,<v fmt>' "
                        f"(default {DEFAULT_MOMENTS})")
    g.add_argument("--agoq-master", choices=MASTER_CHOICES, default=None,
                   help=f"master weight of agoq's optimizer (default {DEFAULT_MASTER}: bf16 + int8 remainder)")
    g.add_argument("--agoq-unfused", action="store_true", help="reference PyTorch optimizer step, not Triton")
    g.add_argument("--agoq-small-numel", type=int, default=None,
                   help="tensors with ndim < 2 or fewer elements keep fp32 states (default 4096)")
    g.add_argument("--agoq-gradient-release", action="store_true",
                   help="not available under megatron.training (use scripts/pretrain_llama.py)")
    g.add_argument("--agoq-sgd-momentum", type=float, default=None, help="--agoq-optimizer sgd: momentum (0.9)")
    g.add_argument("--agoq-sgd-nesterov", action="store_true", help="--agoq-optimizer sgd: Nesterov momentum")
    g.add_argument("--agoq-lion-beta1", type=float, default=None, help="--agoq-optimizer lion: beta1 (0.9)")
    g.add_argument("--agoq-lion-beta2", type=float, default=None, help="--agoq-optimizer lion: beta2 (0.99)")
    g.add_argument("--agoq-fp8", choices=FP8_RECIPES, default=None,
                   help="FP8 linears (sm_89+ GPU); default: the policy's fp8 section, else off")
    g.add_argument("--agoq-smooth-swiglu", choices=SMOOTH_SWIGLU_MODES, default=None,
                   help="Smooth-SwiGLU (per-token / per-channel); default: the policy's, else off")
    g.add_argument("--agoq-fp8-bf16-first-layers", type=int, default=None, metavar="N",
                   help="keep the first N layers in bf16 under FP8 (default 1)")
    g.add_argument("--agoq-fp8-bf16-last-layers", type=int, default=None, metavar="N",
                   help="keep the last N layers in bf16 under FP8 (default 1)")
    g.add_argument("--agoq-fp8-amax-history-len", type=int, default=None, metavar="N",
                   help="FP8 delayed scaling: amaxes kept per tensor (default 16)")
    return parser


AGOQ_SWITCHES = ("agoq_grads", "agoq_grads_mode", "agoq_grads_error_feedback", "agoq_policy", "agoq_moments",
                 "agoq_master", "agoq_unfused", "agoq_small_numel", "agoq_gradient_release", "agoq_sgd_momentum",
                 "agoq_sgd_nesterov", "agoq_lion_beta1", "agoq_lion_beta2", "agoq_fp8", "agoq_smooth_swiglu",
                 "agoq_fp8_bf16_first_layers", "agoq_fp8_bf16_last_layers", "agoq_fp8_amax_history_len")
"""Flags that set an agoq feature (all but --agoq-disable and --agoq-attention): refused with --agoq-disable."""


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args, dest: str) -> bool:
    value = getattr(args, dest, None)
    return value not in (None, False) and not (dest == "agoq_optimizer" and value == "torch")


# -- config -----------------------------------------------------------------------------------------

def check_megatron_args(args: argparse.Namespace) -> None:
    """Raise ValueError / NotImplementedError naming the flag and the fix for combinations agoq cannot run
    under ``megatron.training`` (Megatron's own validation has run: ``parse_and_validate_args``)."""
    if args.agoq_disable:
        extra = [_flag(d) for d in AGOQ_SWITCHES if _given(args, d)]
        if args.agoq_optimizer != "torch":
            extra.append("--agoq-optimizer")
        if extra:
            raise ValueError(f"--agoq-disable runs the plain Megatron baseline; drop {', '.join(extra)}")
    if getattr(args, "transformer_impl", "local") != "local":
        raise ValueError(f"--transformer-impl {args.transformer_impl}: agoq builds on Megatron's local spec; add "
                         "--transformer-impl local (for Megatron's Transformer Engine baseline run Megatron-LM's "
                         "pretrain_gpt.py)")
    if args.agoq_gradient_release:
        raise NotImplementedError("--agoq-gradient-release steps the optimizer inside backward, which "
                                  "megatron.training's train_step cannot host; run it with scripts/pretrain_llama.py "
                                  "or drop the flag")
    if args.agoq_attention == "sdpa" and args.attention_dropout:
        raise ValueError(f"--agoq-attention sdpa runs without attention dropout, got --attention-dropout "
                         f"{args.attention_dropout}; add --attention-dropout 0 or use --agoq-attention megatron")
    if args.agoq_disable:
        return
    for dest, wanted, fix in LLAMA_FLAGS:
        if getattr(args, dest, None) != wanted:
            raise ValueError(f"agoq's layers are LLaMA's ({fix[2:].split()[0]}: {getattr(args, dest, None)!r}); add "
                             f"{fix}, or --agoq-disable for the plain Megatron model")
    if args.fp16:
        raise ValueError("--fp16: agoq runs bf16 (--bf16) or fp32 parameters; use --bf16, or --agoq-disable")
    if args.recompute_granularity == "selective":
        raise ValueError("--recompute-granularity selective: agoq's layers store activations per the policy and "
                         "support Megatron's full recompute only; use --recompute-granularity full or drop it")
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        raise ValueError("--use-torch-fsdp2 / --use-megatron-fsdp: agoq's gradients and optimizer hook Megatron's "
                         "DistributedDataParallel; drop the FSDP flag (--use-distributed-optimizer shards states)")
    _check_optimizer_flags(args)


def _check_optimizer_flags(args: argparse.Namespace) -> None:
    if args.agoq_optimizer == "torch":
        for dest in ("agoq_moments", "agoq_master", "agoq_small_numel", "agoq_unfused"):
            if _given(args, dest):
                raise ValueError(f"{_flag(dest)} sets agoq's optimizer, but --agoq-optimizer is torch (Megatron's "
                                 f"optimizer); add --agoq-optimizer adamw (or lion / sgd), or drop {_flag(dest)}")
        return
    if args.optimizer != "adam":
        raise ValueError(f"--optimizer {args.optimizer} with --agoq-optimizer {args.agoq_optimizer}: agoq's "
                         "optimizer replaces Megatron's; drop --optimizer (or --agoq-optimizer)")
    for dest, why in (("use_precision_aware_optimizer", "agoq keeps its own state formats"),
                      ("optimizer_cpu_offload", "agoq's states live on the GPU"),
                      ("decoupled_lr", "agoq's optimizer has one learning rate per step"),
                      ("use_layer_wise_distributed_optimizer", "agoq shards through Megatron's distributed "
                                                                "optimizer (--use-distributed-optimizer)")):
        if getattr(args, dest, None) not in (None, False):
            raise ValueError(f"{_flag(dest)} with --agoq-optimizer {args.agoq_optimizer}: {why}; drop one of the two")


def agoq_config_from_megatron_args(args: argparse.Namespace) -> AgoqConfig:
    """The run's ``AgoqConfig`` from Megatron's parsed and validated args (``args`` is not changed).

    The policy file is loaded once (``--agoq-policy``, default configs/policy/agoq.yaml); the flags of
    :func:`add_agoq_args` and Megatron's ``--recompute-granularity`` / ``--recompute-num-layers`` /
    ``--grad-reduce-in-bf16`` map onto the config as in ``scripts/pretrain_llama.py``."""
    check_megatron_args(args)
    values = dict(vars(args))
    values["agoq_device"] = "cuda"  # megatron.training is CUDA-only (initialize_megatron asserts it)
    policy = None if args.agoq_disable else load_policy(Path(args.agoq_policy) if args.agoq_policy
                                                         else DEFAULT_POLICY)
    return AgoqConfig.from_flags(values, policy=policy)


# -- model provider ---------------------------------------------------------------------------------

def build_gpt_model(config: AgoqConfig, args: argparse.Namespace, transformer_config, *, pre_process: bool,
                    post_process: bool, vp_stage: int | None = None, num_microbatches: int = 1):
    """One GPTModel chunk for ``megatron.training.get_model`` (the body of a model provider).

    ``transformer_config``: Megatron's (``core_transformer_config_from_args(args)`` or the one get_model
    passes); agoq changes none of its fields. ``num_microbatches`` feeds a policy's ``auto`` bits."""
    import torch
    from megatron.core.models.gpt import GPTModel

    from agoq.megatron import model as mmodel
    from agoq.policy import ScheduleInfo

    vpp = args.virtual_pipeline_model_parallel_size
    compute = config.fp8 if config.enabled else None
    if compute is not None and compute.fp8_enabled:
        from agoq.megatron.compute import check_compute

        tc = transformer_config
        check_compute(compute, torch.device("cuda", torch.cuda.current_device()), num_layers=tc.num_layers,
                      hidden=tc.hidden_size, ffn=tc.ffn_hidden_size, heads=tc.num_attention_heads,
                      groups=tc.num_query_groups or tc.num_attention_heads, tp=tc.tensor_model_parallel_size,
                      tokens_per_microbatch=args.seq_length * args.micro_batch_size)
    schedule = ScheduleInfo(pp_size=args.pipeline_model_parallel_size, vp_size=vpp,
                            num_microbatches=num_microbatches)
    spec = mmodel.agoq_layer_spec(args.agoq_attention, policy=config.policy.spec if config.enabled else None,
                                  schedule=schedule, compute=compute)
    return GPTModel(
        config=transformer_config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage,
    )


# -- runtime patches --------------------------------------------------------------------------------

def _ddp_class(config: AgoqConfig) -> type:
    """The class put in place of ``megatron.training.training.DDP`` (``get_model`` constructs it; ``train()`` and
    ``evaluate()`` check ``isinstance(chunk, DDP)``, so it is a class, a subclass of Megatron's DDP).

    With ``--agoq-grads FORMAT``: agoq's 8-bit gradient DDP with Megatron's buffer layout (as
    ``scripts/pretrain_llama.py`` builds it). Otherwise, with agoq's optimizer under
    ``--use-distributed-optimizer``: Megatron's DDP with the quantization-group-aligned layout in place of
    the one ``wrap_model_chunks_with_ddp`` computed (agoq/megatron/dist_optimizer.py)."""
    from megatron.core.distributed import DistributedDataParallel

    from agoq.megatron.ddp import AgoqDistributedDataParallel, grad_config
    from agoq.megatron.optimizer import shard_alignment_for

    grad = grad_config(config.grads)
    options = config.optimizer

    class AgoqMegatronTrainingDDP(AgoqDistributedDataParallel if grad is not None else DistributedDataParallel):
        def __init__(self, config, ddp_config, module, disable_bucketing=False, **kwargs):
            if grad is not None:
                # AgoqDistributedDataParallel computes Megatron's default layout itself (the one get_model
                # computed), as in scripts/pretrain_llama.py
                kwargs.pop("full_param_layout", None)
                kwargs["grad"] = grad
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
        from agoq.megatron import grad_reader
        from agoq.megatron.optimizer import build_agoq_optimizer

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


def patches_needed(config: AgoqConfig) -> tuple[str, ...]:
    """The runtime patches of megatron.training that ``config`` needs: the dataset-helper build fix always;
    the DDP and optimizer seams for 8-bit gradients or agoq's optimizer."""
    if config.enabled and (config.grads.quantized or config.optimizer.agoq):
        return (SEAM_HELPERS, SEAM_DDP, SEAM_OPTIMIZER)
    return (SEAM_HELPERS,)


def install_for_megatron_training(config: AgoqConfig):
    """``agoq.megatron.install.install(config)`` (contract check, FP8 weight-cache hook) plus the patches of
    ``megatron.training`` the config needs (:func:`patches_needed`); returns the install ``Handle``:
    ``handle.undo()`` puts Megatron's ``DDP`` and ``get_megatron_optimizer`` back (identical objects)."""
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.training as mtt

    from agoq.megatron.install import install, mark, set_module_attr

    compat.check(MEGATRON_TRAINING_CONTRACT)
    if config.device != "cuda":
        raise ValueError(f"AgoqConfig.device={config.device!r}: megatron.training runs on CUDA only; build the "
                         "config with agoq_config_from_megatron_args")
    handle = install(config)
    patched = []
    for seam in patches_needed(config):
        if seam == SEAM_HELPERS:
            module, name = dataset_utils, "compile_helpers"
            value = mark(_compile_helpers_if_missing(dataset_utils.compile_helpers), seam)
        elif seam == SEAM_DDP:
            module, name, value = mtt, "DDP", mark(_ddp_class(config), seam)
        else:
            module, name = mtt, "get_megatron_optimizer"
            value = mark(_OptimizerFactory(config, mtt.get_megatron_optimizer), seam)
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
        return "agoq: disabled (--agoq-disable): plain Megatron model, DDP and optimizer"
    opt = config.optimizer
    parts = [f"policy {config.policy.path or DEFAULT_POLICY.relative_to(DEFAULT_POLICY.parents[2])}",
             f"gradients {config.grads.format or 'Megatron float'}"
             + (f" ({config.grads.mode} mode)" if config.grads.quantized else ""),
             f"optimizer {'Megatron' if not opt.agoq else f'agoq {opt.kind} ({opt.moments}, master {opt.master})'}",
             f"fp8 {config.fp8.recipe}"]
    return "agoq: " + " | ".join(parts) + f" | patches: {', '.join(patches_needed(config)) or 'none'}"
