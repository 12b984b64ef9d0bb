"""AgoqConfig: the run-time options of agoq, one frozen dataclass of frozen sections (the single source of truth).

Built once by a trainer (``agoq.train.args`` for ``scripts/pretrain_llama.py``; ``python -m agoq.plan``
for the planner) with :meth:`AgoqConfig.from_flags` from the ``--agoq-*`` flag values (a config file's keys
and the command line, already merged), validated here once, and passed to everything below the trainer:
library code reads this object (or one of its sections), never an argparse Namespace or the environment.
Errors name the flag (or config-file key: the flag's snake_case name) and the fix.

Sections (torchtitan's per-component config, torchao's frozen ``Float8LinearConfig``):

* ``policy``      the bit-width policy file and its loaded ``PolicySpec`` (loaded once)
* ``activations`` what the layers keep for backward besides the policy's formats (Megatron's full recompute)
* ``grads``       gradient format, mode, error feedback, bf16 buffer
* ``optimizer``   optimizer kind, state formats, master weights and their hyperparameters
* ``fp8``         FP8 linears and Smooth-SwiGLU (``agoq.policy.FP8Spec``: flags over the policy's ``fp8:``)
* ``kernels``     how agoq's kernels run on the host (direct Triton launches, the plain SwiGLU + FP8 fc2 fusion):
                  speed and memory, never values; not saved with checkpoints
* top level       ``enabled`` (False: plain Megatron), ``device``, ``triton_interpret`` (runtime options)

``as_dict()`` is what every checkpoint saves (``agoq.megatron.ckpt.resume``); ``from_dict`` reads it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, get_args

from agoq.formats import QuantFormat, parse_format
from agoq.policy import FP8Spec, PolicySpec

Device = Literal["auto", "cpu", "cuda"]
DEVICES = get_args(Device)
ROPE_FUSIONS = ("auto", "agoq", "off")  # --rope-fusion (AgoqConfig.rope_fusion)
OptimizerKind = Literal["torch", "adamw", "lion", "sgd"]
OPTIMIZERS = get_args(OptimizerKind)
# agoq.optim.base.MASTER_CHOICES, spelled out: this module imports no torch (tests/unit/test_args.py checks)
MasterKind = Literal["none", "fp32", "split24", "split32"]
MASTER_CHOICES = get_args(MasterKind)
DEFAULT_MOMENTS = "flash"
DEFAULT_MASTER = "split24"
# name -> (m format, v format); v is ignored by Lion / SGD
MOMENT_PRESETS = {
    "flash": ("cint8_b32", "cuint8_b32"),  # FlashOptim companded int8 / uint8, fp16 scales per 32
    "fp8": ("fp8e4m3_b128", "fp8e5m2_b128"),  # Fishman et al. 2025: m E4M3, v E5M2 (block-scaled)
    "4bit": ("nf4_b32", "cuint8_b32"),  # NF4 m, companded uint8 v (4-bit v diverges, docs/numerics.md)
    "bf16": ("bf16", "bf16"),
    "fp32": ("fp32", "fp32"),
}
# --recompute-granularity: Megatron's TransformerConfig.recompute_granularity values (megatron-core 0.19.2)
RECOMPUTE_GRANULARITIES = ("full", "selective")
GradMode = Literal["reduce", "store"]
GRAD_MODES = get_args(GradMode)  # the 8-bit gradient modes (agoq.megatron.grads.ddp imports them)
# How the 8-bit reduction moves bytes (agoq.megatron.grads.grad_transport): NCCL collectives (any link), NVLink
# peer memory (CUDA symmetric memory, the ranks of one host), or auto (peer where it applies, else nccl; the
# choice and its reason are printed at start-up).
GradTransport = Literal["auto", "nccl", "peer"]
GRAD_TRANSPORTS = get_args(GradTransport)
FLOAT_GRADS = ("fp32", "bf16", "fp16")  # --agoq-grads values that mean Megatron's float gradients


def torch_optimizer_state_refusal(flag: str, value) -> str:
    """Why a state-format flag (--agoq-moments / --agoq-master) cannot run with --agoq-optimizer torch, and the fix:
    the one message of the trainer's flags (agoq.train.args) and ``python -m agoq.plan``."""
    return (f"{flag} {value} sets a state format of agoq's optimizer, but --agoq-optimizer is torch (Megatron's Adam, "
            f"fp32 states); add --agoq-optimizer adamw (or lion / sgd), or drop {flag}")


def float_grads_mismatch(fmt: str | None, *, bf16_buffer: bool, fp32_params: bool = False) -> str | None:
    """A float gradient name (FLOAT_GRADS: agoq's 8-bit gradients off) must be the buffer the run keeps: fp32
    (Megatron's default, and with --fp32 parameters), or bf16 with --grad-reduce-in-bf16. None when ``fmt`` is not a
    float name or is the kept one; else the refusal after its source ("names Megatron's float gradients in ...,
    but this run keeps them in ...: fix"), for the trainer's checks and ``python -m agoq.plan`` alike."""
    if fmt not in FLOAT_GRADS:
        return None
    kept = "bf16" if bf16_buffer else "fp32"
    if fmt == kept:
        return None
    if fmt == "fp16":
        fix = ("this trainer keeps fp32 gradients, or bf16 ones with --grad-reduce-in-bf16 (it builds no fp16 "
               "parameters); write fp32, or bf16 with --grad-reduce-in-bf16")
    elif fmt == "bf16" and fp32_params:
        fix = "--fp32 parameters keep fp32 gradients; write fp32, or drop --fp32 and add --grad-reduce-in-bf16"
    elif fmt == "bf16":
        fix = ("Megatron keeps fp32 gradients unless --grad-reduce-in-bf16 is given; add --grad-reduce-in-bf16 for a "
               "bf16 gradient buffer, or write fp32")
    else:
        fix = "--grad-reduce-in-bf16 keeps them in bf16; write bf16, or drop --grad-reduce-in-bf16"
    return f"names Megatron's float gradients in {fmt}, but this run keeps them in {kept}: {fix}"


def parse_moments(text: str) -> tuple[str, str]:
    """A preset name or "<m format>,<v format>" (agoq.formats names, round-to-nearest: agoq's optimizer rounds its
    states to nearest; a typo used to pass the command line and stop the run once torch and the model had loaded)."""
    if text in MOMENT_PRESETS:
        return MOMENT_PRESETS[text]
    parts = [t.strip() for t in text.split(",")]
    if len(parts) != 2:
        raise ValueError(f"--agoq-moments {text!r}: use a preset {sorted(MOMENT_PRESETS)} or '<m fmt>,<v fmt>'")
    for which, name in zip(("m", "v"), parts, strict=True):
        try:
            rounding = parse_format(name).rounding
        except ValueError as exc:
            raise ValueError(f"--agoq-moments {text!r}: the {which} format: {exc}") from None
        if rounding == "stochastic":
            raise ValueError(f"--agoq-moments {text!r}: the {which} format {name!r} rounds stochastically, which "
                             "agoq's optimizer does not support; drop the _sr suffix")
    return parts[0], parts[1]


def _choose(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} {value!r}: choose one of {list(allowed)}")


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


class GradsFormatError(ValueError):
    """--agoq-grads (or a policy's default.grads) names no gradient format. The message lists every float name
    (FLOAT_GRADS, as the Megatron-LM path takes them); scripts/pretrain_llama.py's args layer, which takes fewer,
    words its own with :meth:`allowing`."""

    QUANTIZED = "a signed quantized format with round-to-nearest, e.g. int8_b256 or int4_b128"

    def __init__(self, head: str):
        self.head = head  # '--agoq-grads NAME: what is wrong. Allowed: '
        super().__init__(self.allowing(f"{', '.join(FLOAT_GRADS)} (Megatron's float gradients)"))

    def allowing(self, floats: str) -> str:
        """The message with ``floats``: the float names the caller takes, after the quantized formats."""
        return f"{self.head}{self.QUANTIZED}, or {floats}"


def parse_grads_format(value: str | QuantFormat) -> QuantFormat:
    """The gradient format of ``--agoq-grads`` (or a policy's ``default.grads``), parsed and checked once: a float
    name (FLOAT_GRADS: Megatron's float gradients) or a signed round-to-nearest quantized format."""
    if isinstance(value, str) and value in FLOAT_GRADS:
        return parse_format(value)
    try:
        fmt = parse_format(value)
    except ValueError as exc:
        raise GradsFormatError(f"--agoq-grads {value}: {exc}. Allowed: ") from None
    if not fmt.quantized:
        if fmt.name in FLOAT_GRADS:
            return fmt
        raise GradsFormatError(f"--agoq-grads {fmt}: unquantized; allowed: ")
    if not fmt.signed or fmt.rounding == "stochastic":
        raise GradsFormatError(f"--agoq-grads {fmt}: "
                               f"{'unsigned' if not fmt.signed else 'stochastic rounding'}; allowed: ")
    return fmt


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
        _choose("--agoq-grads-mode", self.mode, GRAD_MODES)
        _choose("--agoq-grad-transport", self.transport, GRAD_TRANSPORTS)
        if self.format is not None:
            object.__setattr__(self, "format", parse_grads_format(self.format))
        if self.error_feedback and not self.quantized:
            raise ValueError("--agoq-grads-error-feedback needs --agoq-grads FORMAT (a quantized format)")
        if self.error_feedback and self.mode != "store":
            raise ValueError("--agoq-grads-error-feedback needs --agoq-grads-mode store (it corrects 8-bit "
                             "accumulation)")
        if self.reduce_in_bf16 and self.quantized:
            raise ValueError(
                f"--grad-reduce-in-bf16 with --agoq-grads {self.format}: the 8-bit gradient path is validated with "
                "Megatron's fp32 float buffer only; use one of the two (8-bit grads already store 1 byte/param)")


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
        _choose("--agoq-optimizer", self.kind, OPTIMIZERS)
        _choose("--agoq-master", self.master, MASTER_CHOICES)
        parse_moments(self.moments)
        if self.gradient_release and self.kind == "torch":
            raise ValueError("--agoq-gradient-release conflicts with --agoq-optimizer torch (release steps agoq's "
                             "optimizer inside backward: use --agoq-optimizer adamw, lion or sgd); drop one of the two")

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


@dataclass(frozen=True, kw_only=True)
class AgoqConfig:
    enabled: bool = True
    """False runs plain Megatron (the baseline, --agoq-disable): no agoq seam is installed."""

    device: Device = "auto"
    """auto: GPU when CUDA is available, else CPU mode (gloo, shims; correctness only)"""

    triton_interpret: bool = False
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1, read by the trainer): fused kernels run on the CPU."""

    rope_fusion: str = "auto"
    """RoPE (--rope-fusion): auto: agoq's fused RoPE (agoq.megatron.rope: Megatron's values and gradients bit for
    bit, 2 launches per query / key instead of ~21) where agoq is enabled and the run is on CUDA; agoq: always (with
    --agoq-disable too: Megatron plus agoq's RoPE only, the host-cost benchmarks' reference; on CPU the reference
    op); off: Megatron's unfused RoPE. A Transformer Engine RoPE, when installed, is kept (agoq.megatron.rope; its
    values are TE's, not bit for bit Megatron's unfused ones)."""

    policy: PolicyConfig = PolicyConfig()
    activations: ActivationsConfig = ActivationsConfig()
    grads: GradsConfig = GradsConfig()
    optimizer: OptimizerOptions = OptimizerOptions()
    fp8: FP8Spec = FP8Spec()
    kernels: KernelsConfig = KernelsConfig()

    def __post_init__(self):
        _choose("AgoqConfig.device", self.device, DEVICES)
        _choose("AgoqConfig.rope_fusion (--rope-fusion)", self.rope_fusion, ROPE_FUSIONS)
        if self.optimizer.gradient_release and self.grads.format is not None:
            raise ValueError(f"--agoq-gradient-release conflicts with --agoq-grads {self.grads.format} (8-bit "
                             "gradients live in a gradient buffer; release keeps none); drop one of the two")
        if self.optimizer.gradient_release and self.grads.reduce_in_bf16:
            raise ValueError("--agoq-gradient-release conflicts with --grad-reduce-in-bf16 (there is no gradient "
                             "buffer to keep in bf16; release's gradients are the params' dtype already); drop one "
                             "of the two")

    def rope_fused(self, on_cuda: bool) -> bool:
        """Whether the run uses agoq's fused RoPE (``rope_fusion`` resolved for the run's device)."""
        if self.rope_fusion == "auto":
            return self.enabled and on_cuda
        return self.rope_fusion == "agoq"

    # -- one way to build it: flag values (config file + command line) -----------------------------

    @classmethod
    def from_flags(cls, values: Mapping[str, Any], *, policy: PolicySpec | None = None,
                   triton_interpret: bool = False, kernels: KernelsConfig | None = None) -> AgoqConfig:
        """The config of the flag ``values`` (flag destinations, e.g. ``{"agoq_optimizer": "adamw"}``; a missing
        or None key takes the field's default, the same for the trainer, the Megatron-LM door and the planner).
        Every ``--agoq-*`` value goes through AGOQ_FLAGS (one declaration of each flag); Megatron's own flags that
        agoq reads (MEGATRON_FLAGS) are mapped here. ``policy``: the loaded policy of ``agoq_policy`` (its ``fp8:``
        section and ``default: {grads: ...}`` apply under the flags); None: no policy section applies (the
        planner compares several). ``kernels``: the trainer's KernelsConfig (None: the defaults)."""
        get = values.get
        if get("recompute_granularity") not in (None, *RECOMPUTE_GRANULARITIES):
            raise ValueError(f"--recompute-granularity {get('recompute_granularity')!r}: choose one of "
                             f"{list(RECOMPUTE_GRANULARITIES)}")
        given: dict[str, dict[str, Any]] = {"": {}, **{name: {} for name in (*SECTIONS, "policy")}}
        for flag in AGOQ_FLAGS:
            value = get(flag.dest)
            if flag.invert:
                value = None if value is None else not value
            elif value is None or (value is False and flag.switch):
                continue  # not given: the field's default (a switch is off unless given)
            if value is not None:
                given[flag.section][flag.name] = value
        top, enabled = given[""], given[""].get("enabled", True)
        fp8, grads = FP8Spec(), given["grads"]
        if enabled:
            base = policy.fp8 if policy is not None and policy.fp8 is not None else FP8Spec()
            try:
                fp8 = replace(base, **given["fp8"])
            except ValueError as exc:
                raise ValueError(f"{exc} (flags {', '.join(f.flag for f in AGOQ_FLAGS if f.section == 'fp8')})"
                                 ) from exc
            if "format" not in grads and policy is not None:  # --agoq-grads wins over the policy's default grads
                grads = {**grads, "format": policy.default_name("grads")}
        return cls(
            **top, triton_interpret=triton_interpret, rope_fusion=get("rope_fusion") or "auto",
            policy=PolicyConfig(**given["policy"], spec=policy if enabled else None),
            activations=ActivationsConfig(recompute=get("recompute_granularity") == "full",
                                          recompute_num_layers=_given(get("recompute_num_layers"), 1),
                                          selective_recompute=get("recompute_granularity") == "selective"),
            grads=GradsConfig(**grads, reduce_in_bf16=bool(get("grad_reduce_in_bf16", False))),
            optimizer=OptimizerOptions(**given["optimizer"]),
            fp8=fp8, kernels=kernels or KernelsConfig(),
        )  # fmt: skip

    # -- saved with every checkpoint ---------------------------------------------------------------

    def as_dict(self) -> dict:
        """Plain JSON values, section by section (the policy as its path; its resolved table is saved apart)."""
        out = {"enabled": self.enabled, "device": self.device, "triton_interpret": self.triton_interpret,
               "rope_fusion": self.rope_fusion, "policy": {"path": self.policy.path}}
        for name in SECTIONS:
            out[name] = {f.name: _plain(getattr(getattr(self, name), f.name))
                         for f in dataclasses.fields(getattr(self, name))}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AgoqConfig:
        """The config ``as_dict`` wrote (the policy spec is not restored: load it from ``policy.path``)."""
        return cls(enabled=data["enabled"], device=data["device"], triton_interpret=data["triton_interpret"],
                   rope_fusion=data.get("rope_fusion", "auto"),  # records before 2026-11-27 lack it
                   policy=PolicyConfig(path=data["policy"]["path"]),
                   **{name: _SECTION_TYPES[name](**data[name]) for name in SECTIONS})


SECTIONS = ("activations", "grads", "optimizer", "fp8")  # the sections as_dict writes field by field
_SECTION_TYPES = {"activations": ActivationsConfig, "grads": GradsConfig, "optimizer": OptimizerOptions,
                  "fp8": FP8Spec}


def _plain(value):
    """A config value as JSON: a parsed format as its canonical name (``GradsConfig.format``)."""
    return value.name if isinstance(value, QuantFormat) else value


@dataclass(frozen=True)
class AgoqFlag:
    """One ``--agoq-*`` flag: its name and the AgoqConfig field it sets. Its type, choices, default and help come
    from the field (annotation, ``Literal`` choices, default, attribute docstring); agoq.cli.agoq_flags renders it
    for the trainer, the Megatron-LM door and the planner, and :meth:`AgoqConfig.from_flags` reads it back."""

    flag: str
    field: str
    """``section.name`` (a section of AgoqConfig, or ``policy``) or a top-level field's name."""
    invert: bool = False
    """A switch that sets a bool field to False (``--agoq-disable``: ``enabled=False``)."""
    help: str | None = None
    """The help where the field's docstring does not read as one (an inverted switch)."""
    values: str | None = None
    """What the value may be, in words, where no choices list it (``--agoq-moments``' presets)."""
    default: str | None = None
    """The default in words where it is not the field's (the policy's section applies under the flag)."""
    metavar: str | None = None
    door: bool = True
    """Offered by the Megatron-LM door (``--agoq-device``: megatron.training is CUDA-only)."""
    door_note: str | None = None
    """Added to the help in the door (a flag megatron.training cannot host)."""

    @property
    def section(self) -> str:
        return self.field.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.field.rpartition(".")[2]

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def owner(self) -> type:
        """The dataclass that declares the field (AgoqConfig, or the section's)."""
        return AgoqConfig if not self.section else {**_SECTION_TYPES, "policy": PolicyConfig}[self.section]

    @property
    def switch(self) -> bool:
        """A store-true flag: inverted, or a bool field."""
        return self.invert or isinstance({f.name: f.default for f in dataclasses.fields(self.owner)}[self.name], bool)


_FP8_DEFAULT = "the policy's fp8 section, else {}"
AGOQ_FLAGS: tuple[AgoqFlag, ...] = (
    AgoqFlag("--agoq-policy", "policy.path", default="configs/policy/agoq.yaml"),
    AgoqFlag("--agoq-disable", "enabled", invert=True, help="run plain Megatron (the baseline): no agoq layers, "
             "gradients or optimizer"),
    AgoqFlag("--agoq-device", "device", door=False),
    AgoqFlag("--agoq-grads", "grads.format", metavar="FORMAT",
             default="the policy's default grads entry, else off: Megatron's float gradients"),
    AgoqFlag("--agoq-grads-mode", "grads.mode"),
    AgoqFlag("--agoq-grads-error-feedback", "grads.error_feedback"),
    AgoqFlag("--agoq-grad-transport", "grads.transport"),
    AgoqFlag("--agoq-optimizer", "optimizer.kind"),
    AgoqFlag("--agoq-moments", "optimizer.moments",
             values=f"a preset {sorted(MOMENT_PRESETS)} or '<m fmt>,<v fmt>'"),
    AgoqFlag("--agoq-master", "optimizer.master"),
    AgoqFlag("--agoq-unfused", "optimizer.unfused"),
    AgoqFlag("--agoq-small-numel", "optimizer.small_numel"),
    AgoqFlag("--agoq-gradient-release", "optimizer.gradient_release",
             door_note="not available under megatron.training: scripts/pretrain_llama.py only"),
    AgoqFlag("--agoq-sgd-momentum", "optimizer.sgd_momentum"),
    AgoqFlag("--agoq-sgd-nesterov", "optimizer.sgd_nesterov"),
    AgoqFlag("--agoq-lion-beta1", "optimizer.lion_beta1"),
    AgoqFlag("--agoq-lion-beta2", "optimizer.lion_beta2"),
    AgoqFlag("--agoq-fp8", "fp8.recipe", default=_FP8_DEFAULT.format("off")),
    AgoqFlag("--agoq-smooth-swiglu", "fp8.smooth_swiglu", default=_FP8_DEFAULT.format("off")),
    AgoqFlag("--agoq-fp8-bf16-first-layers", "fp8.bf16_first_layers", metavar="N",
             default=_FP8_DEFAULT.format(FP8Spec.bf16_first_layers)),
    AgoqFlag("--agoq-fp8-bf16-last-layers", "fp8.bf16_last_layers", metavar="N",
             default=_FP8_DEFAULT.format(FP8Spec.bf16_last_layers)),
    AgoqFlag("--agoq-fp8-amax-history-len", "fp8.amax_history_len", metavar="N",
             default=_FP8_DEFAULT.format(FP8Spec.amax_history_len)),
)
"""Every ``--agoq-*`` flag that sets AgoqConfig, once (the door's own ``--agoq-attention`` / ``--agoq-log-json``
set no config field). tests/unit/test_cli_frozen.py pins the parsers' flags and proves each is declared once."""


def _given(value, default):
    return default if value is None else value
