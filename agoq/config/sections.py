"""The sections of AgoqConfig (torchtitan's per-component config, torchao's frozen ``Float8LinearConfig``): each a
frozen dataclass whose fields carry their flag's help as attribute docstrings (agoq.cli.agoq_flags renders them) and
whose ``__post_init__`` refuses what cannot run, naming the flag and the fix. ``fp8`` is ``agoq.policy.FP8Spec``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from agoq.config.values import (
    DEFAULT_MASTER,
    DEFAULT_MOMENTS,
    GRAD_MODES,
    GRAD_TRANSPORTS,
    MASTER_CHOICES,
    OPTIMIZERS,
    GradMode,
    GradTransport,
    MasterKind,
    OptimizerKind,
    check_flag_choice,
    flag_for,
    parse_grads_format,
    parse_moments,
)
from agoq.formats import QuantFormat, parse_format
from agoq.policy import PolicySpec


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """The bit-width policy: its file and the spec loaded from it (once, by the trainer)."""

    path: str | None = None
    """bit-width policy YAML (configs/policy/*.yaml); see docs/policy.md"""

    spec: PolicySpec | None = field(default=None, repr=False)
    """The loaded policy (None with agoq disabled, or where nothing was loaded: the planner)."""


@dataclass(frozen=True, kw_only=True)
class ActivationsConfig:
    """What the layers keep for backward besides the policy's per-role formats."""

    recompute: bool = False
    """--recompute-granularity full: Megatron's full recompute (the recomputed forward stores per the policy)."""

    recompute_num_layers: int = 1
    """--recompute-num-layers: layers per recomputed group."""

    selective_recompute: bool = False
    """--recompute-granularity selective: Megatron's selective recompute of core attention (TransformerConfig
    ``recompute_modules=["core_attn"]``): attention's internals are rebuilt in backward from q, k, v."""

    def __post_init__(self):
        if self.recompute_num_layers < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")
        if self.recompute and self.selective_recompute:
            raise ValueError("--recompute-granularity is full or selective, not both")
        if self.selective_recompute and self.recompute_num_layers != 1:
            raise ValueError(f"--recompute-num-layers {self.recompute_num_layers} applies to --recompute-granularity "
                             "full; selective recompute takes no layer count (drop --recompute-num-layers)")


@dataclass(frozen=True, kw_only=True)
class GradsConfig:
    """Gradients in DDP: Megatron's float buffer (fp32, or bf16) or agoq's 8-bit store / reduction. The one gradient
    config: the trainer, the Megatron-LM door and the DDP wrapper (agoq.megatron.grads.ddp.wrap_ddp_agoq) all take
    it."""

    format: QuantFormat | None = None
    """8-bit gradients in DDP, e.g. int8_b256 (an agoq.formats name: signed, round-to-nearest); fp32 names Megatron's
    float gradients, as does bf16 with --grad-reduce-in-bf16. A policy YAML's default grads: entry gives the same
    choice. Parsed once (a name given here is parsed by :func:`parse_grads_format`); ``as_dict`` writes its name"""

    mode: GradMode = "store"
    """reduce: 8-bit communication, float main_grad; store: also 8-bit main_grad accumulation"""

    error_feedback: bool = False
    """store mode: keep the requantization error in a bf16 residual (+2 bytes/param)"""

    reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16: bf16 main_grad buffer instead of Megatron's fp32 (FlashOptim's 16-bit gradients)."""

    transport: GradTransport = "auto"
    """how the 8-bit reduction moves bytes: nccl (collectives, any link), peer (the reduce kernels read the peers'
    8-bit stores over NVLink; CUDA, one host), auto (peer where it applies, else nccl; the choice and its reason are
    printed at start-up)"""

    @property
    def quantized(self) -> bool:
        """True when agoq's 8-bit gradient path is on (a quantized --agoq-grads format)."""
        return self.format is not None and self.format.quantized

    @property
    def format_name(self) -> str | None:
        """The format's canonical name (None: no --agoq-grads), as checkpoints and reports write it."""
        return None if self.format is None else self.format.name

    def __post_init__(self):
        check_flag_choice("grads.mode", self.mode, GRAD_MODES)
        check_flag_choice("grads.transport", self.transport, GRAD_TRANSPORTS)
        if self.format is not None:
            object.__setattr__(self, "format", parse_grads_format(self.format))
        if self.error_feedback and not self.quantized:
            raise ValueError(f"{flag_for('grads.error_feedback')} needs {flag_for('grads.format')} FORMAT (a quantized "
                             "format)")
        if self.error_feedback and self.mode != "store":
            raise ValueError(f"{flag_for('grads.error_feedback')} needs {flag_for('grads.mode')} store (it corrects "
                             "8-bit accumulation)")
        if self.reduce_in_bf16 and self.quantized:
            raise ValueError(
                f"--grad-reduce-in-bf16 with {flag_for('grads.format')} {self.format}: the 8-bit gradient path is "
                "validated with Megatron's fp32 float buffer only; use one of the two (8-bit grads already store 1 "
                "byte/param)")


@dataclass(frozen=True)
class StateFormats:
    """The optimizer's state formats, parsed once (``OptimizerOptions.states``): the first moment ``m``, the second
    ``v`` (AdamW only; None for Lion / SGD) and the master weights (MASTER_CHOICES)."""

    m: QuantFormat
    v: QuantFormat | None
    master: str

    @property
    def moments(self) -> tuple[QuantFormat, ...]:
        return (self.m,) if self.v is None else (self.m, self.v)

    @property
    def names(self) -> tuple[str, ...]:
        """The moments' canonical names (what the optimizer's param groups and checkpoints carry)."""
        return tuple(f.name for f in self.moments)


@dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
    """The optimizer: Megatron's Adam (``kind="torch"``) or agoq.optim over quantized states. Megatron's own
    hyperparameters (lr, weight decay, Adam betas / eps, clipping) travel in Megatron's OptimizerConfig."""

    kind: OptimizerKind = "torch"
    """torch: Megatron's own Adam; adamw / lion / sgd: agoq.optim over quantized states (lr, weight decay, Adam's
    betas and eps, clipping from Megatron's flags)"""

    moments: str = DEFAULT_MOMENTS
    """state formats of agoq's optimizer (needs --agoq-optimizer adamw / lion / sgd)"""

    master: MasterKind = DEFAULT_MASTER
    """master weight of agoq's optimizer: split24 = bf16 + int8 remainder (FlashOptim), split32 = + int16, fp32 =
    separate copy, none = plain bf16 update"""

    unfused: bool = False
    """use the plain-PyTorch reference step instead of the fused Triton kernel"""

    small_numel: int = 4096
    """tensors with ndim < 2 or fewer elements keep fp32 states and a split32 master"""

    gradient_release: bool = False
    """step each param in its backward hook and free its grad (one stage, no accumulation)"""

    sgd_momentum: float = 0.9
    """--agoq-optimizer sgd: momentum"""

    sgd_nesterov: bool = False
    """--agoq-optimizer sgd: Nesterov momentum"""

    lion_beta1: float = 0.9
    """--agoq-optimizer lion: update interpolation"""

    lion_beta2: float = 0.99
    """--agoq-optimizer lion: momentum decay"""

    def __post_init__(self):
        check_flag_choice("optimizer.kind", self.kind, OPTIMIZERS)
        check_flag_choice("optimizer.master", self.master, MASTER_CHOICES)
        parse_moments(self.moments)
        if self.gradient_release and self.kind == "torch":
            raise ValueError(f"{flag_for('optimizer.gradient_release')} conflicts with {flag_for('optimizer.kind')} "
                             "torch (release steps agoq's optimizer inside backward: use "
                             f"{flag_for('optimizer.kind')} adamw, lion or sgd); drop one of the two")

    @property
    def agoq(self) -> bool:
        return self.kind != "torch"

    @cached_property
    def states(self) -> StateFormats | None:
        """The state formats this optimizer keeps, parsed once (None: Megatron's optimizer, fp32 states)."""
        if not self.agoq:
            return None
        m_fmt, v_fmt = parse_moments(self.moments)
        return StateFormats(parse_format(m_fmt), parse_format(v_fmt) if self.kind == "adamw" else None, self.master)

    @property
    def state_formats(self) -> tuple[str, ...] | None:
        """The moment formats' names: (m, v) for AdamW, (m,) for Lion / SGD, None for Megatron's."""
        return None if self.states is None else self.states.names


@dataclass(frozen=True, kw_only=True)
class KernelsConfig:
    """How agoq's kernels run on the host: choices that change speed (and what a plain FP8 MLP holds), never the
    values; not part of ``as_dict`` (a checkpoint resumes under either). scripts/pretrain_llama.py's trainer fills it
    from its environment (agoq.train.environment: AGOQ_TRITON_FAST_LAUNCH, AGOQ_FP8_SWIGLU_FUSION);
    library code reads it from here, never from the environment."""

    fast_launch: bool = True
    """agoq's direct launches of compiled Triton kernels (agoq.kernels.fastlaunch); False: Triton's own launch path
    (the escape hatch; the same kernels). Applied by ``agoq.megatron.install.install`` (undone by its handle)."""

    fuse_swiglu_fp8: bool = True
    """Plain SwiGLU fused with a plain FP8 fc2 under per-tensor delayed scaling (agoq.ops.smooth_swiglu_fp8.
    swiglu_fp8_fc2, in agoq.megatron.mlp.AgoqMLP; the layers get it as ``SavePaths.fuse_swiglu_fp8``); False:
    Megatron's SwiGLU then the FP8 fc2 (same values, 4 B more per token and FFN channel)."""
