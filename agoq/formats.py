"""Declarative quantization formats: pure data, no torch (the torch-free policy package imports this).

A :class:`QuantFormat` says *what* a tensor is stored as; the math lives in :mod:`agoq.ref.quant`
(reference) and :mod:`agoq.kernels.quant` (Triton). Every format quantizes the **flattened** tensor
in blocks of ``block`` consecutive elements (the tail block is zero-padded) with one scale per block.

Name grammar (usable in YAML)::

    bf16 | fp16 | fp32                          no quantization (16 / 32 bits)
    <kind><bits>_b<block>[_s32|_s16|_sp2][_sr]  quantized

    kind+bits  int2 int3 int4 int5 int6 int8    signed symmetric integer, codes in [-qmax, qmax],
                                                qmax = 2**(bits-1) - 1; 3/5/6-bit codes are packed
                                                exactly (bit planes), so int6 costs 6 bits/element
               nf4                              NormalFloat-4 codebook (QLoRA, arXiv 2305.14314)
               fp8e4m3 fp8e5m2                  FP8 codes with a per-block scale to the format max
               cint8                            FlashOptim companded signed INT8 (softsign), for m
               cuint8                           FlashOptim companded UINT8 (sqrt), for v (>= 0)
    _b<block>  32 | 64 | 128 | 256              elements per scale
    _s32       fp32 scales (default, except cint8/cuint8)
    _s16       fp16 scales (default for cint8/cuint8, as FlashOptim stores them)
    _sp2       power-of-two scales stored as one biased exponent byte
    _sr        seeded stochastic rounding (int, cint, cuint only)

Examples: ``int8_b128``, ``int4_b64``, ``int6_b64_sp2``, ``nf4_b64``, ``fp8e5m2_b128``,
``cint8_b32`` (= ``cint8_b32_s16``), ``cuint8_b32``, ``int8_b256_sr``.

Storage (exact, see :meth:`QuantFormat.storage_bytes`): the codes of every block, padding
included, take ``block * bits / 8`` bytes (an integer for every allowed block), plus one scale of
4 (fp32), 2 (fp16) or 1 (pow2) bytes per block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("none", "int", "nf", "fp8", "cint", "cuint")
SCALES = ("fp32", "fp16", "pow2")
ROUNDINGS = ("nearest", "stochastic")
BLOCKS = (32, 64, 128, 256)
INT_BITS = (2, 3, 4, 5, 6, 8)
FP8_VARIANTS = ("e4m3", "e5m2")
UNQUANTIZED_VARIANTS = {"bf16": 16, "fp16": 16, "fp32": 32}

SCALE_BYTES = {"fp32": 4, "fp16": 2, "pow2": 1}

# Largest finite magnitudes of the OCP FP8 formats as implemented by torch.float8_e4m3fn /
# torch.float8_e5m2 and H100 (Gaudi2's IEEE-style E4M3 stops at 240; arXiv 2409.12517).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

# NF4 codebook, QLoRA (Dettmers et al., arXiv 2305.14314, Appendix E / bitsandbytes): normalised
# quantiles of N(0, 1), 8 positive and 7 negative levels plus an exact zero. The values are
# re-derived from the normal quantile function in tests/unit/test_formats.py.
NF4_CODEBOOK = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

_DEFAULT_SCALE = {"int": "fp32", "nf": "fp32", "fp8": "fp32", "cint": "fp16", "cuint": "fp16"}
_SCALE_SUFFIX = {"fp32": "_s32", "fp16": "_s16", "pow2": "_sp2"}
_SUFFIX_SCALE = {v: k for k, v in _SCALE_SUFFIX.items()}
_STOCHASTIC_KINDS = ("int", "cint", "cuint")
_NAME_RE = re.compile(r"^(?P<head>[a-z0-9]+?)_b(?P<block>\d+)(?P<rest>(_[a-z0-9]+)*)$")
_HEADS = {
    **{f"int{b}": ("int", b, "") for b in INT_BITS},
    "nf4": ("nf", 4, ""),
    "fp8e4m3": ("fp8", 8, "e4m3"),
    "fp8e5m2": ("fp8", 8, "e5m2"),
    "cint8": ("cint", 8, ""),
    "cuint8": ("cuint", 8, ""),
}


def format_names() -> str:
    """The name grammar in one line, for error messages."""
    return (
        "bf16 | fp16 | fp32 | <kind>_b<block>[_s32|_s16|_sp2][_sr] with kind in "
        f"{sorted(_HEADS)} and block in {list(BLOCKS)} (e.g. int4_b64, cint8_b32, fp8e4m3_b128_sp2)"
    )


def _require(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"QuantFormat.{field}={value!r} is not allowed; use one of {list(allowed)}")


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    """One storage format (a spec: pure data, hashable, comparable).

    kind: "none" (unquantized), "int" (symmetric integer), "nf" (NF4 codebook), "fp8",
        "cint" (FlashOptim softsign-companded int8), "cuint" (FlashOptim sqrt-companded uint8).
    bits: code width in bits (16/32 for "none").
    block: elements per scale (ignored, 0, for "none").
    scale: scale storage, "fp32" | "fp16" | "pow2" ("" for "none").
    rounding: "nearest" (round half away from zero / nearest codebook entry) or "stochastic".
    variant: "e4m3" / "e5m2" for fp8; "bf16" / "fp16" / "fp32" for "none"; "" otherwise.
    """

    kind: str
    bits: int
    block: int = 0
    scale: str = ""
    rounding: str = "nearest"
    variant: str = ""

    def __post_init__(self) -> None:
        _require("kind", self.kind, KINDS)
        _require("rounding", self.rounding, ROUNDINGS)
        if self.kind == "none":
            _require("variant", self.variant, tuple(UNQUANTIZED_VARIANTS))
            _require("bits", self.bits, (UNQUANTIZED_VARIANTS[self.variant],))
            _require("block", self.block, (0,))
            _require("scale", self.scale, ("",))
            _require("rounding", self.rounding, ("nearest",))
            return
        _require("block", self.block, BLOCKS)
        _require("scale", self.scale, SCALES)
        allowed_bits = {"int": INT_BITS, "nf": (4,), "fp8": (8,), "cint": (8,), "cuint": (8,)}
        _require("bits", self.bits, allowed_bits[self.kind])
        _require("variant", self.variant, FP8_VARIANTS if self.kind == "fp8" else ("",))
        if self.rounding == "stochastic" and self.kind not in _STOCHASTIC_KINDS:
            raise ValueError(
                f"QuantFormat.rounding='stochastic' is not implemented for kind={self.kind!r}; "
                f"use rounding='nearest' or a kind in {list(_STOCHASTIC_KINDS)}"
            )

    @property
    def quantized(self) -> bool:
        return self.kind != "none"

    @property
    def name(self) -> str:
        """Canonical short name; ``parse_format(f.name) == f``."""
        if self.kind == "none":
            return self.variant
        head = {"int": f"int{self.bits}", "nf": "nf4", "fp8": f"fp8{self.variant}"}.get(
            self.kind, f"{self.kind}{self.bits}"
        )
        name = f"{head}_b{self.block}"
        if self.scale != _DEFAULT_SCALE[self.kind]:
            name += _SCALE_SUFFIX[self.scale]
        if self.rounding == "stochastic":
            name += "_sr"
        return name

    def __str__(self) -> str:
        return self.name

    @property
    def signed(self) -> bool:
        return self.kind != "cuint"

    @property
    def qmax(self) -> float:
        """Largest code magnitude the block absmax is mapped to (scale = absmax / qmax).

        int: 2**(bits-1) - 1; fp8: the format's largest finite value; nf, cint, cuint: 1 (values are
        normalised to [-1, 1] / [0, 1] before the codebook or companding, as in QLoRA / FlashOptim).
        """
        if self.kind == "int":
            return float(2 ** (self.bits - 1) - 1)
        if self.kind == "fp8":
            return FP8_MAX[self.variant]
        if self.kind == "none":
            raise ValueError(f"format {self.name!r} is unquantized and has no qmax")
        return 1.0

    @property
    def planes(self) -> tuple[int, ...]:
        """Bit-plane widths of the packed codes, low bits first (see ``pack layout`` below).

        Codes of ``bits`` bits are split into planes of 8, 4, 2 or 1 bits; each plane packs
        ``8 // width`` consecutive codes per byte, first code in the lowest bits. Within a block the
        planes are stored one after another, so a block's codes take exactly block * bits / 8 bytes
        and blocks stay self-contained (any run of whole blocks can be sliced out of ``codes``).
        Example: int6 -> (4, 2): block/2 bytes of low nibbles, then block/4 bytes of high 2 bits.
        """
        if self.bits == 8:
            return (8,)
        return tuple(w for w in (4, 2, 1) if self.bits & w)

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES[self.scale] if self.quantized else 0

    def num_blocks(self, numel: int) -> int:
        _check_numel(numel)
        return -(-numel // self.block) if self.quantized else 0

    def code_bytes(self, numel: int) -> int:
        """Bytes of the packed codes, tail block padding included."""
        if not self.quantized:
            return numel * self.bits // 8
        return self.num_blocks(numel) * self.block * self.bits // 8

    def storage_bytes(self, numel: int) -> int:
        """Exact bytes to store ``numel`` elements: codes (padded to whole blocks) + scales."""
        return self.code_bytes(numel) + self.num_blocks(numel) * self.scale_bytes

    def bytes_per_element(self, numel: int | None = None) -> float:
        """Exact bytes per element including scales; asymptotic (no tail padding) if numel is None."""
        if numel is None:
            if not self.quantized:
                return self.bits / 8
            return self.bits / 8 + self.scale_bytes / self.block
        if numel < 1:
            raise ValueError(f"bytes_per_element(numel={numel}) needs numel >= 1 (or None)")
        return self.storage_bytes(numel) / numel


def _check_numel(numel: int) -> None:
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")


def uses_bytes_kernel(fmt: QuantFormat) -> bool:
    """One whole byte per code, rounded to nearest (fp8, int8 nearest): the formats agoq's byte-code kernels
    take (the quantize / reduce fast path of agoq.kernels.quant and agoq.kernels.comm, the peer transports)."""
    return fmt.kind == "fp8" or (fmt.kind == "int" and fmt.bits == 8 and fmt.rounding == "nearest")


def parse_format(name: str | QuantFormat) -> QuantFormat:
    """Parse a short name (see module docstring); a QuantFormat is returned unchanged."""
    if isinstance(name, QuantFormat):
        return name
    if not isinstance(name, str):
        raise ValueError(f"format name must be a string, got {type(name).__name__}; {format_names()}")
    text = name.strip().lower()
    if text in UNQUANTIZED_VARIANTS:
        return QuantFormat(kind="none", bits=UNQUANTIZED_VARIANTS[text], variant=text)
    match = _NAME_RE.match(text)
    if match is None or match["head"] not in _HEADS:
        raise ValueError(f"unknown format name {name!r}; expected {format_names()}")
    kind, bits, variant = _HEADS[match["head"]]
    scale, rounding = _DEFAULT_SCALE[kind], "nearest"
    seen = set()
    for suffix in re.findall(r"_[a-z0-9]+", match["rest"]):
        if suffix in seen:
            raise ValueError(f"format name {name!r} repeats {suffix!r}; expected {format_names()}")
        seen.add(suffix)
        if suffix in _SUFFIX_SCALE and not seen & (set(_SUFFIX_SCALE) - {suffix}):
            scale = _SUFFIX_SCALE[suffix]
        elif suffix == "_sr":
            rounding = "stochastic"
        else:
            raise ValueError(f"format name {name!r}: bad suffix {suffix!r}; expected {format_names()}")
    try:
        return QuantFormat(
            kind=kind, bits=bits, block=int(match["block"]), scale=scale, rounding=rounding, variant=variant
        )
    except ValueError as err:
        raise ValueError(f"format name {name!r}: {err}") from None


BF16 = parse_format("bf16")
FP16 = parse_format("fp16")
FP32 = parse_format("fp32")
