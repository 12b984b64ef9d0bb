"""Policy data model: roles, sites, rules and the loaded policy, as frozen dataclasses.

Pure data: imports no torch, triton or megatron (tests/unit/test_policy_boundary.py proves it).
The YAML file shape is documented in docs/policy.md; ``agoq.policy.load`` builds these objects.

Vocabulary
- *site*: one saved activation of one layer on one pipeline stage (``Site``).
- *role*: which activation of the layer it is (closed set ``ROLES`` below).
- *rule*: ``when`` (a ``Match``) -> ``set`` (a format name or ``auto``), first match wins.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from agoq.formats import QuantFormat

# ---------------------------------------------------------------------------------------------
# Roles: every tensor a LLaMA layer (and the embedding / head around it) saves for backward.
# Provenance: arXiv 2605.00539 (AGoQ's code keeps the pre-norm input and recomputes the norm;
# keeps the fc1 output and recomputes SwiGLU; FlashAttention's q/k/v/out are not compressed).
# One place, one line each; docs/policy.md renders the same table.
# ---------------------------------------------------------------------------------------------
ROLES: dict[str, str] = {
    "embedding.output": "word-embedding output entering layer 0 (first stage, no layer index)",
    "norm.input": "input of the attention and MLP pre-norms (residual stream); the norm is recomputed",
    "attn.qkv_input": "normalized input of the QKV projection (only when the norm is not recomputed)",
    "attn.q": "query tensor saved by scaled-dot-product attention",
    "attn.k": "key tensor saved by scaled-dot-product attention",
    "attn.v": "value tensor saved by scaled-dot-product attention",
    "attn.out": "attention output (context) saved by scaled-dot-product attention for its backward",
    "attn.proj_input": "input of the attention output projection (the context tensor)",
    "mlp.fc1_input": "normalized input of fc1 (only when the norm is not recomputed)",
    "mlp.swiglu_input": "fc1 output = SwiGLU input (2 x FFN wide); SwiGLU is recomputed in backward",
    "mlp.fc2_input": "SwiGLU output = fc2 input (only when SwiGLU is not recomputed)",
    "head.input": "input of the final norm / LM-head projection (last stage, no layer index)",
    "loss.logits": "logits saved by the cross-entropy loss (last stage, no layer index)",
}

#: Roles that belong to no transformer layer: their sites carry ``layer_idx=None``.
LAYERLESS_ROLES: frozenset[str] = frozenset({"embedding.output", "head.input", "loss.logits"})

#: Keyword in ``set.activations`` / ``default.activations`` that selects the stage-aware ladder.
AUTO = "auto"

#: Tensor kinds a policy assigns a format to; only ``activations`` is resolved per site, ``grads`` is the
#: default of ``--agoq-grads`` (scripts/pretrain_llama.py).
DEFAULT_KEYS: tuple[str, ...] = ("activations", "grads")
#: Keys a policy once documented that agoq never reads: the loader names where the setting lives.
RETIRED_DEFAULT_KEYS: dict[str, str] = {
    "optim_states": "optimizer state formats are not read from a policy; set them with --agoq-moments / "
                    "--agoq-master (docs/numerics.md) and remove the key",
}

#: Rounding rules of the auto ladder (see stages.pick_rung and docs/policy.md "The auto rule").
AUTO_ROUNDINGS: tuple[str, ...] = ("nearest", "up", "down")

PpStage = int | Literal["first", "last"]

# ---------------------------------------------------------------------------------------------
# The `fp8:` section: FP8 linears and Smooth-SwiGLU (FP8 paper, arXiv 2409.12517; docs/numerics.md).
# ---------------------------------------------------------------------------------------------
#: off: bf16 linears; current / delayed: per-tensor scaling from this tensor's amax / from the amax
#: history; rowwise: per-row scales (current). Transformer Engine's FP8 is Megatron-LM's own (--transformer-impl
#: transformer_engine with --fp8-format, docs/megatron_lm.md), not a recipe of agoq's linears.
FP8RecipeName = Literal["off", "current", "delayed", "rowwise"]
FP8_RECIPES: tuple[str, ...] = get_args(FP8RecipeName)
#: What a policy's ``fp8.recipe`` may say (the same recipes; kept as a name for the policy loader).
POLICY_FP8_RECIPES: tuple[str, ...] = FP8_RECIPES
#: per-token: the authors' code (one scale per token); per-channel: the paper's text (one per FFN unit).
SmoothSwigluMode = Literal["off", "per-channel", "per-token"]
SMOOTH_SWIGLU_MODES: tuple[str, ...] = get_args(SmoothSwigluMode)
#: Delayed scaling's history length; equal to agoq.ops.fp8_scaling.DEFAULT_AMAX_HISTORY_LEN (a unit
#: test keeps them equal; this package imports no torch). Transformer Engine defaults to 1024.
FP8_DEFAULT_AMAX_HISTORY_LEN = 16


@dataclasses.dataclass(frozen=True)
class FP8Spec:
    """FP8 compute settings (the policy's ``fp8:`` section, or the ``--agoq-fp8*`` flags).

    The first ``bf16_first_layers`` and last ``bf16_last_layers`` transformer layers (global
    indices) keep bf16 linears, as does the LM head (always: it is Megatron's output layer, never an
    agoq linear), following the FP8 paper's code, which excludes the LM head. Smooth-SwiGLU applies
    to every layer's MLP (a function-preserving rescale; it changes what the FP8 cast of fc2's input sees).
    """

    recipe: FP8RecipeName = "off"
    """FP8 linears (E4M3 forward, E5M2 backward; needs an sm_89+ GPU): current / delayed per-tensor scaling,
    rowwise (per-row current scaling), off."""

    smooth_swiglu: SmoothSwigluMode = "off"
    """Smooth-SwiGLU (FP8 paper): rescale the SwiGLU output per token (authors' code) or per FFN channel (paper text)
    before fc2; function-preserving, runs anywhere."""

    bf16_first_layers: int = 1
    """keep the first N transformer layers in bf16"""

    bf16_last_layers: int = 1
    """keep the last N transformer layers in bf16 (the LM head is always bf16)"""

    amax_history_len: int = FP8_DEFAULT_AMAX_HISTORY_LEN
    """delayed scaling: amaxes kept per tensor"""

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r}: use one of {list(FP8_RECIPES)}")
        if self.smooth_swiglu not in SMOOTH_SWIGLU_MODES:
            raise ValueError(f"smooth_swiglu {self.smooth_swiglu!r}: use one of {list(SMOOTH_SWIGLU_MODES)}")
        for name in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"fp8 {name}={value!r}: use an integer >= 0")
        n = self.amax_history_len
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"fp8 amax_history_len={n!r}: use an integer >= 1")

    @property
    def fp8_enabled(self) -> bool:
        return self.recipe != "off"

    def uses_fp8(self, layer_idx: int, num_layers: int) -> bool:
        """True when global layer ``layer_idx`` of ``num_layers`` runs its linears in FP8."""
        return self.fp8_enabled and self.bf16_first_layers <= layer_idx < num_layers - self.bf16_last_layers


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an activation is saved.

    ``layer_idx`` is the global 0-based layer index (``TransformerLayer.layer_number - 1``), or
    None for the layerless roles. ``vp_stage``/``vp_size`` are None without virtual pipelining.
    """

    layer_idx: int | None
    pp_rank: int
    pp_size: int
    vp_stage: int | None
    vp_size: int | None
    role: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Site.role {self.role!r} is not a role; allowed: {sorted(ROLES)}")
        if (self.layer_idx is None) != (self.role in LAYERLESS_ROLES):
            want = "None" if self.role in LAYERLESS_ROLES else "a global 0-based layer index"
            raise ValueError(f"Site.layer_idx for role {self.role!r} must be {want}; got {self.layer_idx!r}")
        if self.layer_idx is not None and self.layer_idx < 0:
            raise ValueError(f"Site.layer_idx must be >= 0 (global, 0-based); got {self.layer_idx}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"Site.pp_rank must be in [0, pp_size={self.pp_size}); got {self.pp_rank}")
        if (self.vp_stage is None) != (self.vp_size is None):
            raise ValueError(
                f"Site.vp_stage and Site.vp_size are both None (no virtual pipeline) or both set; "
                f"got vp_stage={self.vp_stage!r}, vp_size={self.vp_size!r}"
            )
        if self.vp_size is not None and not 0 <= self.vp_stage < self.vp_size:
            raise ValueError(f"Site.vp_stage must be in [0, vp_size={self.vp_size}); got {self.vp_stage}")


@dataclasses.dataclass(frozen=True)
class Match:
    """The ``when`` of a rule. A None field matches everything on that key.

    ``layers`` is the set of global 0-based layer indices; ``pp_stage`` an int or first/last;
    ``vp_stage`` an int (a site without virtual pipelining has the single chunk 0);
    ``roles`` a set of role names.
    """

    layers: frozenset[int] | None = None
    pp_stage: PpStage | None = None
    vp_stage: int | None = None
    roles: frozenset[str] | None = None

    def matches(self, site: Site) -> bool:
        if self.layers is not None and (site.layer_idx is None or site.layer_idx not in self.layers):
            return False
        if self.pp_stage is not None and _stage_index(self.pp_stage, site.pp_size) != site.pp_rank:
            return False
        site_vp_stage = 0 if site.vp_stage is None else site.vp_stage
        if self.vp_stage is not None and self.vp_stage != site_vp_stage:
            return False
        return self.roles is None or site.role in self.roles

    def covers(self, other: Match) -> bool:
        """True when every site ``other`` can match is also matched by ``self`` (for any pp_size)."""
        if self.layers is not None and (other.layers is None or not other.layers <= self.layers):
            return False
        if self.pp_stage is not None and not _same_stage(self.pp_stage, other.pp_stage):
            return False
        if self.vp_stage is not None and self.vp_stage != other.vp_stage:
            return False
        return self.roles is None or (other.roles is not None and other.roles <= self.roles)


def _stage_index(stage: PpStage, pp_size: int) -> int:
    if stage == "first":
        return 0
    if stage == "last":
        return pp_size - 1
    return stage


def _same_stage(a: PpStage, b: PpStage | None) -> bool:
    """Stages equal for every pp_size ("first" is 0; "last" equals only "last")."""
    if b is None:
        return False
    return (0 if a == "first" else a) == (0 if b == "first" else b)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One ``{when, set}`` entry; ``index`` is its position in ``rules`` (for messages and tables)."""

    index: int
    when: Match
    activations: str  # a format name known to the policy, or AUTO


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """Stage-aware allocation: the busiest stage gets ``base``, others climb ``ladder``.

    ``ladder`` is ordered by strictly increasing nominal bits, each above ``base``'s bits.
    ``rounding`` picks a rung for a non-integer bit target (stages.pick_rung).
    """

    base: str
    ladder: tuple[str, ...]
    rounding: str = "nearest"


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A validated policy file. Build it with ``agoq.policy.load_policy``.

    ``formats`` holds every format the policy can produce (declared ones and built-in names it
    refers to), keyed by the name used in the file. ``default`` maps DEFAULT_KEYS present in the
    file to a format name (``activations`` is always present; it may be AUTO).
    """

    source: str
    version: int
    formats: tuple[tuple[str, QuantFormat], ...]
    default: tuple[tuple[str, str], ...]
    rules: tuple[Rule, ...]
    auto: AutoSpec | None = None
    fp8: FP8Spec | None = None  # the `fp8:` section; None when the file has none

    def format(self, name: str) -> QuantFormat:
        for key, fmt in self.formats:
            if key == name:
                return fmt
        raise ValueError(
            f"{self.source}: format {name!r} is not part of this policy; "
            f"known: {[k for k, _ in self.formats]}"
        )

    def default_name(self, key: str) -> str | None:
        """The default format name for ``key`` in DEFAULT_KEYS, or None if the file leaves it unset."""
        if key not in DEFAULT_KEYS:
            raise ValueError(f"default key {key!r} is not one of {list(DEFAULT_KEYS)}")
        return dict(self.default).get(key)
