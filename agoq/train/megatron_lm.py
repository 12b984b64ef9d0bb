"""The trainer side of agoq inside Megatron-LM's trainer (``megatron.training.pretrain``): the ``--agoq-*`` flags on
Megatron's parser and the bridge from Megatron's parsed args to agoq's typed config and model options.

Used by ``scripts/pretrain_gpt_agoq.py`` (the ``pretrain_gpt.py``-shaped entry script) and by a user's own
Megatron-LM ``pretrain_gpt.py`` (docs/megatron_lm.md):

* :func:`add_agoq_args` — the ``--agoq-*`` flags, for ``extra_args_provider`` (Megatron's own flags unchanged);
* :func:`agoq_config_from_megatron_args` — the run's frozen ``AgoqConfig`` after checking the combinations agoq
  cannot run (each error names the flag and the fix);
* :func:`gpt_model_options` — what the model provider needs from the args (agoq.megatron.megatron_lm.GPTModelOptions).

The plugin side (agoq/megatron/megatron_lm.py) takes only these typed objects: the model builder and the
registered patches of ``megatron.training``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agoq.cli.agoq_flags import ALL, add_agoq_flags, load_preset
from agoq.cli.flags import DEFAULT_POLICY
from agoq.config import AGOQ_FLAGS, AgoqConfig, flag_for
from agoq.policy import load_policy

ATTENTION_CHOICES = ("sdpa", "megatron")
AGOQ_SPEC = ["agoq.megatron.megatron_lm", "MEGATRON_LM_LAYER_SPEC"]
"""Megatron-LM's --spec naming agoq's layer spec (agoq.megatron.megatron_lm.offer_layer_spec puts it there); a
checkpoint saved through the door records it in its args (--use-checkpoint-args loads it back)."""

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

    The flags that set agoq's config are generated from it (agoq.cli.agoq_flags, as for scripts/pretrain_llama.py),
    every valued one defaulting to None so that the checks below tell a given flag from an absent one; the door adds
    its own two (the attention of agoq's local spec, the JSON loss log). Megatron-LM flags keep their meaning: agoq
    reads ``--recompute-granularity``/``--recompute-num-layers``, ``--grad-reduce-in-bf16``,
    ``--use-distributed-optimizer`` and the optimizer hyperparameters from them."""
    g = add_agoq_flags(parser, unset=ALL, door=True)
    g.add_argument("--agoq-attention", choices=ATTENTION_CHOICES, default="sdpa",
                   help="core attention: sdpa (torch scaled_dot_product_attention, flash/cuDNN) or megatron "
                        f"(the local spec's unfused DotProductAttention); applies with {flag_for('enabled')} too")
    g.add_argument("--agoq-log-json", default=None, metavar="FILE",
                   help="append one JSON line per training iteration: its exact lm loss (Megatron's reduced loss of "
                        "the iteration, repr of the float), the value Megatron's log line prints where it prints one, "
                        "and the CUDA peak bytes so far")
    return parser


AGOQ_SWITCHES = tuple(f.dest for f in AGOQ_FLAGS if f.door and f.field != "enabled")
"""Flags that set an agoq feature (all config flags but --agoq-disable): refused with --agoq-disable."""


def apply_agoq_preset(args: argparse.Namespace) -> None:
    """``--agoq-preset NAME_OR_FILE``: the preset's ``--agoq-*`` values into ``args`` where the flag was not given
    (explicit flags win); a key the door does not take is an error naming the file, the key and the allowed keys.
    Megatron's parser has no --config, so the door expands the preset itself, on every parse it checks."""
    if not getattr(args, "agoq_preset", None):
        return
    try:
        values = load_preset(args.agoq_preset, door=True)
    except ValueError as error:
        raise RefusedFlags(str(error)) from error
    for dest, value in values.items():
        if getattr(args, dest, None) in (None, False):
            setattr(args, dest, value)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args, dest: str) -> bool:
    value = getattr(args, dest, None)
    return value not in (None, False) and not (dest == "agoq_optimizer" and value == "torch")


class MegatronLMRefusal(Exception):
    """A combination agoq cannot run under ``megatron.training``, found before anything is built. The message names
    the flag (in Megatron-LM's spelling, or agoq's ``--agoq-*``) and the fix; the door (``python -m agoq.megatron_lm``,
    agoq/train/megatron_lm_door.py) prints it as one line and exits, without a traceback."""


class RefusedFlags(MegatronLMRefusal, ValueError):
    """Flags that do not combine with agoq (or with each other under agoq)."""


class UnavailableUnderMegatronTraining(MegatronLMRefusal, NotImplementedError):
    """An agoq feature ``megatron.training``'s loop cannot host."""


def check_megatron_args(args: argparse.Namespace) -> None:
    """Raise :class:`RefusedFlags` / :class:`UnavailableUnderMegatronTraining` naming the flag and the fix for
    combinations agoq cannot run under ``megatron.training``. Runs on Megatron's parsed args before its validation
    (the door refuses before Megatron's argument dump) and again after it; with ``--agoq-disable`` only the agoq
    switches given beside it are refused (the plain Megatron run takes any of Megatron's flags, Transformer Engine
    included). With agoq on, ``--transformer-impl local`` gives agoq's layers and ``transformer_engine`` (Megatron-LM's
    default) TE's layers with agoq's saved-activation scopes, gradients and optimizer (agoq.megatron.te)."""
    apply_agoq_preset(args)
    refuse_agoq_trainer_checkpoint(getattr(args, "load", None))
    if args.agoq_disable:
        extra = [_flag(d) for d in AGOQ_SWITCHES if _given(args, d)]
        if extra:
            raise RefusedFlags(f"{flag_for('enabled')} runs the plain Megatron baseline; drop {', '.join(extra)}")
        return
    impl = getattr(args, "transformer_impl", "local")
    if impl not in ("local", "transformer_engine"):
        raise RefusedFlags(f"--transformer-impl {impl}: agoq composes with Megatron's local spec and Transformer "
                           f"Engine's (--transformer-impl local or transformer_engine), or add {flag_for('enabled')}")
    te = impl == "transformer_engine"
    if te:
        for dest, fix in (("agoq_fp8", "use Megatron-LM's --fp8-format hybrid --fp8-recipe delayed (TE's recipes)"),
                          ("agoq_smooth_swiglu", "drop it (agoq's Smooth-SwiGLU runs in agoq's own MLP)")):
            if _given(args, dest):
                raise RefusedFlags(f"{_flag(dest)} with --transformer-impl transformer_engine: TE's modules run the "
                                   f"GEMMs; {fix}, or --transformer-impl local for agoq's layers")
        from agoq.megatron import te as agoq_te

        if not agoq_te.te_available():
            raise RefusedFlags(agoq_te.te_missing_message())
    if args.agoq_gradient_release:
        raise UnavailableUnderMegatronTraining(
            f"{flag_for('optimizer.gradient_release')} steps the optimizer inside backward, which megatron.training's "
            "train_step cannot host; run it with scripts/pretrain_llama.py or drop the flag")
    if not te:
        _check_local_attention(args)
    if getattr(args, "spec", None) is not None and list(args.spec) != AGOQ_SPEC:  # agoq's own (checkpoint args)
        raise RefusedFlags(f"--spec {' '.join(args.spec)}: agoq gives Megatron its own layer spec (through --spec); "
                           f"drop --spec, or {flag_for('enabled')} for your spec without agoq")
    position = "rope" if getattr(args, "use_rotary_position_embeddings", False) else args.position_embedding_type
    for dest, wanted, fix in LLAMA_FLAGS:
        if te and dest == "transformer_impl":
            continue
        value = position if dest == "position_embedding_type" else getattr(args, dest, None)
        if value != wanted:
            raise RefusedFlags(f"agoq's layers are LLaMA's ({fix[2:].split()[0]}: {value!r}); add {fix}, or "
                               f"{flag_for('enabled')} for the plain Megatron model")
    if args.fp16:
        raise RefusedFlags(f"--fp16: agoq runs bf16 (--bf16) or fp32 parameters; use --bf16, or {flag_for('enabled')}")
    modules = list(getattr(args, "recompute_modules", None) or ["core_attn"])
    if not te and args.recompute_granularity == "selective" and modules != ["core_attn"]:
        raise RefusedFlags(f"--recompute-modules {' '.join(modules)}: with agoq's layers, selective recompute covers "
                           "core attention only (its linears, norms and SwiGLU store per the policy); use "
                           "--recompute-modules core_attn, or --recompute-granularity full")
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        raise RefusedFlags("--use-torch-fsdp2 / --use-megatron-fsdp: agoq's gradients and optimizer hook Megatron's "
                           "DistributedDataParallel; drop the FSDP flag (--use-distributed-optimizer shards states)")
    _check_optimizer_flags(args)


def refuse_agoq_trainer_checkpoint(load: str | None) -> None:
    """``--load`` of a checkpoint that agoq's own trainer wrote (scripts/pretrain_llama.py: agoq_progress.json in its
    iter_* folders): megatron.training does not read that layout; refused by name before anything loads."""
    if not load:
        return
    from pathlib import Path

    from agoq.megatron.ckpt.ckpt_files import complete_iterations, is_complete, names

    folder = Path(load)
    held = [folder.name] if is_complete(folder) else ([names(complete_iterations(folder))]
                                                      if complete_iterations(folder) else [])
    if held:
        raise RefusedFlags(f"--load {load}: {held[0]} was written by agoq's own trainer (scripts/pretrain_llama.py: "
                           "agoq_progress.json), whose checkpoint layout megatron.training does not read; resume it "
                           f"with scripts/pretrain_llama.py --load {load} (same model flags), or give this run "
                           "another --load")



def uses_transformer_engine(args: argparse.Namespace) -> bool:
    """--transformer-impl transformer_engine (Megatron-LM's default) with agoq on: TE's layers (agoq.megatron.te)."""
    return not args.agoq_disable and getattr(args, "transformer_impl", "local") == "transformer_engine"


def _check_local_attention(args: argparse.Namespace) -> None:
    """agoq's core attention on the local spec (--agoq-attention): what it cannot run."""
    if args.agoq_attention == "sdpa" and args.attention_dropout:
        raise RefusedFlags(f"--agoq-attention sdpa (agoq's default) runs without attention dropout, got "
                           f"--attention-dropout {args.attention_dropout} (Megatron's default is 0.1); add "
                           "--attention-dropout 0, or --agoq-attention megatron for Megatron's DotProductAttention")
    if args.agoq_attention == "sdpa" and getattr(args, "reset_attention_mask", False):
        raise RefusedFlags("--reset-attention-mask: agoq's SDPA attention is causal over the whole sequence (no "
                           "document-boundary masks); drop --reset-attention-mask, or add --agoq-attention megatron")
    if str(getattr(args, "attention_backend", "")).split(".")[-1] == "local":
        raise RefusedFlags("--attention-backend local: with agoq on, core attention is --agoq-attention (sdpa, or "
                           "megatron for Megatron's local DotProductAttention); drop --attention-backend local")


def take_over_recipe_flags(args: argparse.Namespace, config: AgoqConfig | None = None) -> list[str]:
    """Megatron-LM flags of a LLaMA recipe (on by default in Megatron-LM) that agoq's layers serve otherwise: each one
    is turned off in ``args`` (before Megatron builds its ``TransformerConfig``) and named in one start-up line
    returned here. With ``--agoq-disable`` nothing is changed (empty list).

    * ``--persist-layer-norm`` (Megatron-LM's default; off with ``--no-persist-layer-norm``): apex's persistent
      LayerNorm kernel, which RMSNorm never uses; Megatron's torch RMSNorm (the final norm without Transformer
      Engine or apex) refuses the setting, so it is turned off: the model is the same.
    * ``--gradient-accumulation-fusion`` (default; ``--no-gradient-accumulation-fusion``): APEX's fused wgrad GEMM
      accumulating into ``main_grad``. agoq's linears compute their weight gradients themselves and Megatron's DDP
      adds them to ``main_grad`` (a bf16 weight gradient added to the fp32 ``main_grad``, as Megatron's linears
      without the fusion), so it is turned off.
    """
    if args.agoq_disable:
        return []
    notes = []
    if not args.no_persist_layer_norm:
        args.no_persist_layer_norm = True
        notes.append("--persist-layer-norm (Megatron-LM's default) selects apex's persistent LayerNorm kernel, which "
                     "RMSNorm does not use: turned off (--no-persist-layer-norm), the model is the same")
    te = uses_transformer_engine(args)
    if args.gradient_accumulation_fusion and te:
        grads = (config or agoq_config_from_megatron_args(args)).grads
        if grads.quantized and grads.mode == "store":
            args.gradient_accumulation_fusion = False
            notes.append("--gradient-accumulation-fusion (Megatron-LM's default) turned off: TE would accumulate "
                         "weight gradients into the float main_grad that agoq's 8-bit gradient store replaces (add "
                         f"--no-gradient-accumulation-fusion to drop this line, or {flag_for('grads.mode')} reduce to "
                         "keep it)")
    elif args.gradient_accumulation_fusion:
        args.gradient_accumulation_fusion = False
        notes.append("--gradient-accumulation-fusion (Megatron-LM's default) taken over: agoq's linears compute their "
                     "weight gradients and Megatron's DDP adds them to main_grad (APEX's fused wgrad GEMM is not used; "
                     "add --no-gradient-accumulation-fusion to drop this line)")
    backend = str(getattr(args, "attention_backend", "auto")).split(".")[-1]
    if backend not in ("auto", "local") and not te:
        notes.append(f"--attention-backend {backend} selects a Transformer Engine attention; agoq's core attention is "
                     f"--agoq-attention {args.agoq_attention}"
                     + (" (torch SDPA: flash / cuDNN / memory-efficient kernels)" if args.agoq_attention == "sdpa"
                        else " (Megatron's DotProductAttention)"))
    return notes


def _check_optimizer_flags(args: argparse.Namespace) -> None:
    if args.agoq_optimizer in (None, "torch"):
        for dest in ("agoq_moments", "agoq_master", "agoq_small_numel", "agoq_unfused"):
            if _given(args, dest):
                raise RefusedFlags(f"{_flag(dest)} sets agoq's optimizer, but {flag_for('optimizer.kind')} is torch "
                                   f"(Megatron's optimizer); add {flag_for('optimizer.kind')} adamw (or lion / sgd), "
                                   f"or drop {_flag(dest)}")
        return
    if args.optimizer != "adam":
        raise RefusedFlags(f"--optimizer {args.optimizer} with {flag_for('optimizer.kind')} {args.agoq_optimizer}: "
                           f"agoq's optimizer replaces Megatron's; drop --optimizer (or {flag_for('optimizer.kind')})")
    for dest, why in (("use_precision_aware_optimizer", "agoq keeps its own state formats"),
                      ("optimizer_cpu_offload", "agoq's states live on the GPU"),
                      ("decoupled_lr", "agoq's optimizer has one learning rate per step"),
                      ("use_mup", "agoq's param groups do not take muP's per-group learning rates"),
                      ("apply_wd_to_qk_layernorm", "agoq's param groups exempt every 1-D parameter from weight "
                                                   "decay (Megatron's standard rule)")):
        if getattr(args, dest, None) not in (None, False):
            raise RefusedFlags(f"{_flag(dest)} with {flag_for('optimizer.kind')} {args.agoq_optimizer}: {why}; drop "
                               "one of the two")


def agoq_config_from_megatron_args(args: argparse.Namespace) -> AgoqConfig:
    """The run's ``AgoqConfig`` from Megatron's parsed and validated args (``args`` is changed only by expanding
    ``--agoq-preset``: :func:`apply_agoq_preset`).

    The policy file is loaded once (``--agoq-policy``, default configs/policy/agoq.yaml); the flags of
    :func:`add_agoq_args` and Megatron's ``--recompute-granularity`` / ``--recompute-num-layers`` /
    ``--grad-reduce-in-bf16`` map onto the config as in ``scripts/pretrain_llama.py``."""
    check_megatron_args(args)
    values = dict(vars(args))
    values["agoq_device"] = "cuda"  # megatron.training is CUDA-only (initialize_megatron asserts it)
    # RoPE is Megatron-LM's own flag here (--no-rope-fusion; on by default): with agoq on, the door fills Megatron's
    # empty fused-RoPE slot with agoq's kernel (install_for_megatron_training), so the config follows that flag
    values["rope_fusion"] = "agoq" if getattr(args, "apply_rope_fusion", False) else "off"
    try:
        policy = None if args.agoq_disable else load_policy(Path(args.agoq_policy) if args.agoq_policy
                                                             else DEFAULT_POLICY)
        return AgoqConfig.from_flags(values, policy=policy)
    except ValueError as error:  # a flag value agoq's config refuses (its message names the flag and the fix)
        raise RefusedFlags(str(error)) from error




def gpt_model_options(args: argparse.Namespace):
    """The model provider's options (``agoq.megatron.megatron_lm.GPTModelOptions``) from Megatron's parsed args."""
    from agoq.megatron.megatron_lm import GPTModelOptions

    return GPTModelOptions(
        attention=args.agoq_attention, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        tokens_per_microbatch=args.seq_length * args.micro_batch_size,
    )
