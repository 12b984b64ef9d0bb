"""agoq.formats: name grammar, validation, exact byte accounting, NF4 constants, torch-free import."""

import math
import statistics
import subprocess
import sys

import pytest

from agoq.formats import (
    BF16,
    NF4_CODEBOOK,
    QuantFormat,
    format_names,
    parse_format,
)

CANONICAL_NAMES = [
    "bf16", "fp16", "fp32", "int8_b128", "int4_b64", "int6_b64", "int5_b32", "int3_b256", "int2_b64",
    "nf4_b64", "fp8e4m3_b128", "fp8e5m2_b128", "cint8_b32", "cuint8_b32", "int8_b128_s16",
    "int4_b64_sp2", "int8_b256_sr", "cint8_b32_s32", "cuint8_b32_sp2_sr", "fp8e5m2_b32_sp2",
]  # fmt: skip


@pytest.mark.parametrize("name", CANONICAL_NAMES)
def test_parse_format_name_round_trips(name):
    fmt = parse_format(name)
    assert fmt.name == name
    assert parse_format(fmt.name) == fmt
    assert parse_format(fmt) is fmt


@pytest.mark.parametrize(
    "name, fields",
    [
        ("int4_b64", dict(kind="int", bits=4, block=64, scale="fp32", rounding="nearest")),
        ("cint8_b32", dict(kind="cint", bits=8, block=32, scale="fp16")),  # FlashOptim default
        ("cuint8_b32", dict(kind="cuint", bits=8, block=32, scale="fp16")),
        ("cint8_b32_s32", dict(kind="cint", scale="fp32")),
        ("fp8e5m2_b128", dict(kind="fp8", variant="e5m2", bits=8, scale="fp32")),
        ("INT8_B128_SR_S16", dict(kind="int", scale="fp16", rounding="stochastic")),  # any suffix order
        ("bf16", dict(kind="none", bits=16, variant="bf16")),
    ],
)
def test_parse_format_fields(name, fields):
    fmt = parse_format(name)
    for key, value in fields.items():
        assert getattr(fmt, key) == value, key


@pytest.mark.parametrize(
    "name", ["int8", "int7_b64", "int8_b48", "int8_b512", "nf3_b64", "int8_b64_s16_sp2", "int8_b64_sr_sr",
             "int8_b64_x", "fp8e4m3_b64_sr", "nf4_b64_sr", "", "b64"]
)  # fmt: skip
def test_parse_format_rejects_with_grammar(name):
    with pytest.raises(ValueError, match="int4_b64|use one of|not implemented"):
        parse_format(name)


def test_parse_format_rejects_non_string():
    with pytest.raises(ValueError, match="string"):
        parse_format(8)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kind="int4", bits=4, block=64, scale="fp32"), "kind"),
        (dict(kind="int", bits=7, block=64, scale="fp32"), "bits"),
        (dict(kind="int", bits=8, block=100, scale="fp32"), "block"),
        (dict(kind="int", bits=8, block=64, scale="bf16"), "scale"),
        (dict(kind="int", bits=8, block=64, scale="fp32", rounding="up"), "rounding"),
        (dict(kind="fp8", bits=8, block=64, scale="fp32", variant="e3m4"), "variant"),
        (dict(kind="none", bits=8, variant="bf16"), "bits"),
    ],
)
def test_quant_format_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"QuantFormat\.{field}=.*use one of"):
        QuantFormat(**kwargs)


def test_format_names_mentions_every_kind():
    text = format_names()
    for head in ("int8", "int6", "nf4", "fp8e4m3", "fp8e5m2", "cint8", "cuint8", "bf16", "_sp2", "_sr"):
        assert head in text


@pytest.mark.parametrize(
    "name, per_element",
    [
        ("bf16", 2.0),
        ("fp32", 4.0),
        ("int8_b128", 1 + 4 / 128),
        ("int4_b64", 0.5 + 4 / 64),  # AGoQ nf4: 4.5 bit/element (algorithms.md §3.2)
        ("nf4_b64", 0.5 + 4 / 64),
        ("int6_b64", 0.75 + 4 / 64),
        ("int5_b64_sp2", 5 / 8 + 1 / 64),
        ("cint8_b32", 1 + 2 / 32),  # FlashOptim m: 1.0625 B/param (algorithms.md §4)
        ("int8_b256", 1 + 4 / 256),  # AGoQ gradients: 1 + 4/256 (algorithms.md §3.3)
    ],
)
def test_bytes_per_element_asymptotic(name, per_element):
    assert parse_format(name).bytes_per_element() == pytest.approx(per_element, rel=0, abs=1e-12)


@pytest.mark.parametrize("name", ["int4_b64", "int6_b32", "int3_b256", "fp8e4m3_b128_sp2", "cint8_b32"])
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1000, 4096 * 11008])
def test_storage_bytes_counts_padding_and_scales(name, numel):
    fmt = parse_format(name)
    blocks = math.ceil(numel / fmt.block)
    expected = blocks * fmt.block * fmt.bits // 8 + blocks * {"fp32": 4, "fp16": 2, "pow2": 1}[fmt.scale]
    assert fmt.storage_bytes(numel) == expected
    assert fmt.bytes_per_element(numel) == expected / numel


def test_storage_bytes_edge_cases():
    assert parse_format("int4_b64").storage_bytes(0) == 0
    assert BF16.storage_bytes(3) == 6
    with pytest.raises(ValueError):
        parse_format("int4_b64").bytes_per_element(0)
    with pytest.raises(ValueError):
        parse_format("int4_b64").storage_bytes(-1)


@pytest.mark.parametrize(
    "bits, planes", [(8, (8,)), (6, (4, 2)), (5, (4, 1)), (4, (4,)), (3, (2, 1)), (2, (2,))]
)
def test_planes_cover_bits(bits, planes):
    assert parse_format(f"int{bits}_b64").planes == planes
    assert sum(planes) == bits


def test_nf4_codebook_matches_normal_quantiles():
    """Re-derive QLoRA's NF4 (arXiv 2305.14314, bitsandbytes create_normal_map, offset 0.9677083)
    from the stdlib normal quantile function; the stored constants are float32-printed, so 1e-6."""
    offset, ppf = 0.9677083, statistics.NormalDist().inv_cdf

    def linspace(a, b, n):
        return [a + (b - a) * i / (n - 1) for i in range(n)]

    positive = [ppf(p) for p in linspace(offset, 0.5, 9)[:-1]]
    negative = [-ppf(p) for p in linspace(offset, 0.5, 8)[:-1]]
    values = sorted(positive + [0.0] + negative)
    top = max(values)
    assert [v / top for v in values] == pytest.approx(list(NF4_CODEBOOK), abs=1e-6)


def test_formats_imports_without_torch(repo_root):
    code = (
        "import sys; sys.modules['torch'] = None; import agoq.formats as f; print(f.parse_format('int4_b64'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "int4_b64"
