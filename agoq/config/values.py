"""The allowed values of agoq's options and their parsers: the choices of each ``Literal`` field, the optimizer's
moment presets, the gradient formats (:func:`parse_grads_format`) and the refusals that the trainer's flags and
``python -m agoq.plan`` share. The config's sections (agoq.config.sections) check their fields with these.
No torch: tests/unit/test_boundaries.py imports this package with torch blocked."""

from __future__ import annotations

from typing import Literal, get_args

from agoq.formats import QuantFormat, parse_format

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
    return (f"{flag} {value} sets a state format of agoq's optimizer, but {flag_for('optimizer.kind')} is torch "
            f"(Megatron's Adam, fp32 states); add {flag_for('optimizer.kind')} adamw (or lion / sgd), or drop {flag}")


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
        raise ValueError(f"{flag_for('optimizer.moments')} {text!r}: use a preset {sorted(MOMENT_PRESETS)} or "
                         "'<m fmt>,<v fmt>'")
    for which, name in zip(("m", "v"), parts, strict=True):
        try:
            rounding = parse_format(name).rounding
        except ValueError as exc:
            raise ValueError(f"{flag_for('optimizer.moments')} {text!r}: the {which} format: {exc}") from None
        if rounding == "stochastic":
            raise ValueError(f"{flag_for('optimizer.moments')} {text!r}: the {which} format {name!r} rounds "
                             "stochastically, which agoq's optimizer does not support; drop the _sr suffix")
    return parts[0], parts[1]



def check_choice(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} {value!r}: choose one of {list(allowed)}")


def check_flag_choice(field: str, value, allowed) -> None:
    """check_choice of an AgoqConfig field that an ``--agoq-*`` flag sets: the message names the flag."""
    if value not in allowed:
        check_choice(flag_for(field), value, allowed)


def flag_for(field: str) -> str:
    """:func:`agoq.config.flag_for` (the ``--agoq-*`` flag of an AgoqConfig field) for this module and the sections,
    looked up when a message is built: agoq.config declares its flag table over them (and builds default sections
    while it imports)."""
    from agoq.config import flag_for as declared

    return declared(field)


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
        raise GradsFormatError(f"{flag_for('grads.format')} {value}: {exc}. Allowed: ") from None
    if not fmt.quantized:
        if fmt.name in FLOAT_GRADS:
            return fmt
        raise GradsFormatError(f"{flag_for('grads.format')} {fmt}: unquantized; allowed: ")
    if not fmt.signed or fmt.rounding == "stochastic":
        raise GradsFormatError(f"{flag_for('grads.format')} {fmt}: "
                               f"{'unsigned' if not fmt.signed else 'stochastic rounding'}; allowed: ")
    return fmt
