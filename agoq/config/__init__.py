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

The package: this module holds AgoqConfig and the flag table (:data:`AGOQ_FLAGS`, the ``--agoq-*`` flags over its
fields, which :meth:`AgoqConfig.from_flags` reads back; messages name a flag with :func:`flag_for`);
``agoq.config.sections`` the section dataclasses; ``agoq.config.values`` each option's allowed values and parsers
(moment presets, gradient formats, refusals).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from agoq.config.sections import (
    ActivationsConfig,
    GradsConfig,
    KernelsConfig,
    OptimizerOptions,
    PolicyConfig,
)
from agoq.config.values import DEVICES, MOMENT_PRESETS, RECOMPUTE_GRANULARITIES, ROPE_FUSIONS, Device, check_choice
from agoq.formats import QuantFormat
from agoq.policy import FP8Spec, PolicySpec


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
        check_choice("AgoqConfig.device", self.device, DEVICES)
        check_choice("AgoqConfig.rope_fusion (--rope-fusion)", self.rope_fusion, ROPE_FUSIONS)
        if self.optimizer.gradient_release and self.grads.format is not None:
            raise ValueError(f"{flag_for('optimizer.gradient_release')} conflicts with {flag_for('grads.format')} "
                             f"{self.grads.format} (8-bit gradients live in a gradient buffer; release keeps none); "
                             "drop one of the two")
        if self.optimizer.gradient_release and self.grads.reduce_in_bf16:
            raise ValueError(f"{flag_for('optimizer.gradient_release')} conflicts with --grad-reduce-in-bf16 (there is "
                             "no gradient buffer to keep in bf16; release's gradients are the params' dtype already); "
                             "drop one of the two")

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


FLAG_OF_FIELD: Mapping[str, str] = MappingProxyType({f.field: f.flag for f in AGOQ_FLAGS})
"""AgoqFlag.field -> its command-line spelling (``grads.format`` -> ``--agoq-grads``), read through :func:`flag_for`."""


def flag_for(field: str) -> str:
    """The command-line spelling of the ``--agoq-*`` flag that sets AgoqConfig ``field`` (an AGOQ_FLAGS field:
    ``section.name`` or a top-level name; ``enabled`` -> ``--agoq-disable``), for the messages that name the flag:
    a renamed flag renames them (tests/unit/test_flag_names.py finds the ones spelled out)."""
    try:
        return FLAG_OF_FIELD[field]
    except KeyError:
        raise KeyError(f"no --agoq-* flag sets the AgoqConfig field {field!r}; the fields with a flag "
                       f"(agoq.config.AGOQ_FLAGS): {', '.join(FLAG_OF_FIELD)}") from None


def _given(value, default):
    return default if value is None else value
