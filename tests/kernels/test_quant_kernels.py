"""agoq.kernels.quant vs agoq.ref.quant: identical codes and scales, identical dequantized values.

CPU: ``TRITON_INTERPRET=1 python -m pytest tests/kernels -m "not gpu"`` (own process; small sizes).
GPU: ``python -m pytest tests/kernels`` (adds the Llama-sized shapes and fp8 quantize).

Interpreter limits found on Triton 3.8 (documented in docs/numerics.md):
- fp32 -> fp8 casts do not round ties to even, so fp8 *quantize* is GPU-only (marked ``gpu``);
  fp8 dequantize still runs in the interpreter.
- fp32 -> bf16 casts truncate instead of rounding to nearest even, so in interpreter mode bf16
  outputs may differ from the reference by one bf16 ulp; fp32/fp16 outputs must match exactly.
"""

import os

import pytest
import torch

from agoq.formats import NF4_CODEBOOK, parse_format
from agoq.ref.quant import ref_dequantize, ref_quantize
from agoq.testing.numerics import make_test_data

# The interpreter evaluates NaN/Inf blocks with numpy, which warns; the values are what is tested.
pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
FP8_GPU = pytest.mark.gpu(reason="interpreter fp8 cast does not round ties to even (Triton 3.8)")

NON_FP8 = [
    "int8_b128", "int6_b64", "int5_b32", "int4_b64", "int3_b256", "int2_b64", "nf4_b64", "cint8_b32",
    "cuint8_b32", "int8_b256_sp2", "int4_b32_s16", "nf4_b256_s16", "int6_b32_sp2", "int8_b128_sr",
    "int4_b64_sr", "cint8_b32_sr", "cuint8_b32_sr",
]  # fmt: skip
FP8 = ["fp8e4m3_b128", "fp8e5m2_b128", "fp8e4m3_b32_sp2", "fp8e5m2_b64_s16"]
FORMATS = NON_FP8 + [pytest.param(n, marks=FP8_GPU) for n in FP8]
SMALL_SHAPES = [(1,), (0,), (3, 256), (7, 33)]  # one element, empty, whole blocks, ragged tail
# fp16 / fp32 inputs take the same kernel path after the load: checked on a representative subset
# (one per code path: plain int, bit planes, NF4 table, companded) to keep the interpreter run short.
OTHER_DTYPE_FORMATS = ["int8_b128", "int6_b64", "nf4_b64", "cint8_b32", "int4_b64_sr"]
GPU_SHAPES = [(4096, 11008), (3, 1_000_003)]


def _quant():
    from agoq.kernels.quant import dequantize, quantize  # imported late: TRITON_INTERPRET is read at import

    return quantize, dequantize


def _data(fmt, shape, dtype, dist="gaussian", seed=0):
    numel = int(torch.Size(shape).numel())
    x = make_test_data("heavy_tailed" if dist == "heavy_tailed" else "gaussian", numel, seed=seed)
    if dist == "zero_block" and numel:
        x[: min(numel, fmt.block)] = 0.0
    if dist == "constant_block" and numel:
        x[: min(numel, fmt.block)] = -1.375
    if fmt.kind == "cuint":
        x = x.abs()
    return x.reshape(shape).to(dtype=dtype, device=DEVICE)


def _assert_same_quant(q, r):
    assert q.fmt == r.fmt and q.shape == r.shape and q.dtype == r.dtype
    assert q.codes.dtype == r.codes.dtype and q.scales.dtype == r.scales.dtype
    assert torch.equal(q.codes, r.codes), "codes differ"
    torch.testing.assert_close(q.scales, r.scales, rtol=0, atol=0, equal_nan=True)  # exact, NaN==NaN


def _assert_same_values(y, expected):
    assert y.shape == expected.shape and y.dtype == expected.dtype
    if INTERPRET and y.dtype == torch.bfloat16:
        # interpreter truncates fp32 -> bf16 (module docstring): allow one bf16 ulp, 2**-7 relative
        torch.testing.assert_close(y.float(), expected.float(), rtol=2.0**-7, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)


def _check(x, name, seed=None):
    quantize, dequantize = _quant()
    fmt = parse_format(name)
    q = quantize(x, fmt, seed=seed)
    r = ref_quantize(x, fmt, seed=seed)
    _assert_same_quant(q, r)
    for out_dtype in (None, torch.float32):
        _assert_same_values(dequantize(q, out_dtype), ref_dequantize(r, out_dtype))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_kernel_matches_ref_small(name, shape):
    _check(_data(parse_format(name), shape, torch.bfloat16), name, seed=17)


@pytest.mark.parametrize("name", OTHER_DTYPE_FORMATS + [pytest.param("fp8e4m3_b128", marks=FP8_GPU)])
@pytest.mark.parametrize("shape", [(3, 256), (1000,)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_matches_ref_other_dtypes(name, shape, dtype):
    _check(_data(parse_format(name), shape, dtype), name, seed=17)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dist", ["gaussian", "heavy_tailed", "zero_block", "constant_block"])
def test_kernel_matches_ref_distributions(name, dist):
    _check(_data(parse_format(name), (5, 300), torch.bfloat16, dist, seed=4), name, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NON_FP8 + FP8)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_kernel_matches_ref_llama_sizes(name, shape):
    _check(_data(parse_format(name), shape, torch.bfloat16, "heavy_tailed", seed=5), name, seed=99)


@pytest.mark.parametrize("name", NON_FP8)
def test_kernel_dequantizes_ref_codes(name):
    """Dequantize alone, on codes from the reference (covers fp8 decode in the interpreter too)."""
    _, dequantize = _quant()
    for fmt_name in (name, *FP8):
        fmt = parse_format(fmt_name)
        r = ref_quantize(_data(fmt, (9, 70), torch.float32, seed=8), fmt, seed=1)
        _assert_same_values(dequantize(r), ref_dequantize(r))


@pytest.mark.parametrize("name", ["int8_b32", "int4_b64_sp2", "nf4_b64", "cint8_b32", "cuint8_b32",
                                  pytest.param("fp8e4m3_b32", marks=FP8_GPU)])  # fmt: skip
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_kernel_non_finite_block_becomes_nan(name, bad):
    quantize, dequantize = _quant()
    fmt = parse_format(name)
    x = _data(fmt, (4 * fmt.block + 3,), torch.bfloat16, seed=2)
    x[fmt.block + 5] = bad
    y = dequantize(quantize(x, fmt))
    assert bool(torch.isnan(y[fmt.block : 2 * fmt.block]).all())
    assert bool(torch.isfinite(y[: fmt.block]).all()) and bool(torch.isfinite(y[2 * fmt.block :]).all())
    _check(x, name)


def test_kernel_scale_overflow_and_negative_second_moment_are_nan():
    quantize, dequantize = _quant()
    big = torch.full((64,), 1e9, device=DEVICE)  # fp16 scale 1e9/127 overflows
    assert bool(torch.isnan(dequantize(quantize(big, "int8_b32_s16"))).all())
    v = torch.rand(64, device=DEVICE)
    v[40] = -1.0
    y = dequantize(quantize(v, "cuint8_b32"))
    assert bool(torch.isnan(y[32:]).all()) and bool(torch.isfinite(y[:32]).all())


def test_kernel_ties_match_ref():
    x = torch.zeros(64, device=DEVICE)
    x[0] = 127.0  # scale 1: p == x
    x[1:9] = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, 126.5])
    _check(x, "int8_b32")
    _check(x, "int8_b32_sp2")
    cb = torch.tensor(NF4_CODEBOOK)
    mids = ((cb[1:].double() + cb[:-1].double()) / 2).float()
    y = torch.zeros(32, device=DEVICE)
    y[0] = 1.0
    y[1:16] = mids.to(DEVICE)
    _check(y, "nf4_b32")


@pytest.mark.parametrize("seed", [0, 1, 2**31 + 7, 2**40 + 3, -5])
def test_kernel_stochastic_rounding_matches_ref_for_any_seed(seed):
    x = _data(parse_format("int4_b64"), (3, 333), torch.float32, seed=6)
    _check(x, "int4_b64_sr", seed=seed)
    _check(x, "cint8_b32_sr", seed=seed)


@pytest.mark.parametrize("name", ["int6_b64", "int5_b32", "int3_b256", "nf4_b64", "int8_b256_sr", "cint8_b32_sr",
                                  "int4_b128_sp2", "int2_b64"])  # fmt: skip
@pytest.mark.parametrize("config", [(2048, 4, 1), (4096, 4, 2), (1024, 2, 4), (8192, 8, 4)])
def test_kernel_codes_do_not_depend_on_launch_shape(name, config):
    """Every launch shape (rows per program, warps, tile parts) gives the reference's codes, with a
    non-finite block and a ragged tail in the tensor (bench_quant.py --variants relies on this)."""
    from agoq.kernels._launch import QuantConfig
    from agoq.kernels.quant import quantize_with_config

    fmt = parse_format(name)
    x = _data(fmt, (3 * 1024 + 77,), torch.bfloat16, "heavy_tailed", seed=11)
    x[fmt.block + 3] = float("nan")
    q = quantize_with_config(x, fmt, QuantConfig(*config), seed=21)
    _assert_same_quant(q, ref_quantize(x, fmt, seed=21))


def test_launch_config_rejects_bad_split():
    from agoq.kernels._launch import QuantConfig

    with pytest.raises(ValueError, match="split"):
        QuantConfig(4096, 4, 3)


def test_kernel_argument_errors_match_ref():
    quantize, _ = _quant()
    with pytest.raises(ValueError, match="seed"):
        quantize(torch.ones(4, device=DEVICE), "int8_b32_sr")
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        quantize(torch.ones(4, dtype=torch.float64, device=DEVICE), "int8_b32")


def test_kernel_non_contiguous_input():
    x = _data(parse_format("int4_b64"), (64, 48), torch.bfloat16, seed=9).t()
    _check(x, "int4_b64")


def _tiny_blocks(block: int, absmaxes: list[float], seed: int) -> torch.Tensor:
    """One block per absmax: a random fill in [-absmax, absmax] whose extreme element (position and sign
    drawn) is exactly +-absmax; absmax 0 is an all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, a in enumerate(absmaxes):
        row = (torch.rand(block, generator=gen) * 2 - 1) * a
        row[int(torch.randint(block, (1,), generator=gen))] = a if i % 2 else -a
        rows.append(row)
    return torch.cat(rows).to(DEVICE)


# fp16 block scales at and below the fp16 normal range (2**-14 ~ 6.1e-5): subnormal scales (spacing
# 2**-24 ~ 6e-8) round up to 1.5x away from absmax, below 2**-25 they round to 0 (block -> zeros)
TINY_ABSMAX = [0.0, 2.0**-26, 2.0**-25, 1.4 * 2.0**-24, 1.49 * 2.0**-24, 2.0**-24, 1.3e-7, 2.4e-7, 4e-7,
               7e-7, 1e-6, 3.3e-6, 1e-5, 6.1e-5, 1.0]  # fmt: skip


@pytest.mark.parametrize("name", ["nf4_b32_s16", "nf4_b64_s16", "int4_b32_s16", "cint8_b32", "int8_b32_s16"])
def test_kernel_tiny_fp16_scales_match_ref_and_keep_signs(name):
    """Issue 21: a subnormal fp16 scale below absmax gave p < -1.0625, which the kernel's NF4 bucket
    clamp sent to the top code (+1): the sign of the block's extreme element flipped. Zeros, absmax
    below the smallest fp16 scale, subnormal and normal scales; the extreme element of either sign."""
    quantize, dequantize = _quant()
    fmt = parse_format(name)
    for seed in (0, 1):
        x = _tiny_blocks(fmt.block, TINY_ABSMAX, seed)
        _check(x, name)
        y = dequantize(quantize(x, fmt), torch.float32)
        assert bool((y * x >= 0).all()), "a dequantized value has the opposite sign of its input"


@pytest.mark.parametrize("name", ["cuint8_b32", "cuint8_b32_s32", "cuint8_b64_sp2", "cuint8_b32_sr"])
def test_kernel_cuint_codes_equal_ref_near_code_boundaries(name):
    """Issue 21: the reference's sqrt is now correctly rounded (sqrt_rn, as the kernel's), so codes and
    scales agree exactly also where a 1-ulp sqrt error moves a code (agoq.testing's boundary inputs),
    with each block's scale 1 and with scales that are themselves such square roots, plus random moments."""
    from agoq.testing.numerics import cuint_boundary_inputs

    fmt = parse_format(name)
    gen = torch.Generator().manual_seed(5)
    rand = torch.rand(2048, generator=gen) ** 4 * torch.logspace(-30, 3, 2048).float()
    x = torch.cat([cuint_boundary_inputs(fmt.block), cuint_boundary_inputs(lead_one=False), rand])
    _check(x.to(DEVICE), name, seed=7)


def _near_max(fmt, dtype, blocks=4, seed=0):
    """Blocks of values up to the dtype's largest finite value, +-max itself in every block (cuint: >= 0)."""
    mx = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(blocks * fmt.block, generator=gen, dtype=torch.float64) * 2 - 1) * mx
    x[:: fmt.block // 2] = mx
    x[1 :: fmt.block // 2] = -mx
    return (x.abs() if fmt.kind == "cuint" else x).to(dtype).to(DEVICE)


@pytest.mark.parametrize("name,dtype", [
    ("int8_b32_s16", torch.float16), ("int4_b64_sp2", torch.float32), ("int4_b64_sp2", torch.float16),
    ("int8_b32_sp2", torch.bfloat16), ("int3_b32_sp2", torch.float32), ("int6_b64_sp2", torch.bfloat16),
    ("nf4_b64_sp2", torch.float16), ("cuint8_b32_sp2", torch.bfloat16), ("int8_b32", torch.float32),
    ("fp8e5m2_b32_s16", torch.float16), ("fp8e4m3_b32_sp2", torch.float32),
])  # fmt: skip
def test_kernel_near_dtype_max_saturates_like_ref(name, dtype):
    """Issue 21: finite inputs at the dtype's maximum dequantized to Inf (fp16 65504 with int8_b32_s16:
    127 * 516 = 65532; fp32 3e38 with int4_b64_sp2: 4 * 2**126). Dequantize now saturates to +-max, in
    the reference and the kernel alike; a non-finite block still dequantizes to NaN."""
    quantize, dequantize = _quant()
    fmt = parse_format(name)
    mx = torch.finfo(dtype).max
    x = _near_max(fmt, dtype)
    x[fmt.block + 3] = float("inf")  # block 1 is non-finite: NaN, not saturated
    r = ref_quantize(x, fmt)
    if fmt.kind == "fp8" and INTERPRET:  # fp8 quantize is GPU-only in the interpreter: dequantize ref codes
        _assert_same_values(dequantize(r), ref_dequantize(r))
        q = r
    else:
        _check(x, name)
        q = quantize(x, fmt)
    y = dequantize(q)
    nan_block = torch.zeros_like(y, dtype=torch.bool)
    nan_block[fmt.block : 2 * fmt.block] = True
    assert bool(torch.isnan(y[nan_block]).all()) and not bool(torch.isinf(y).any())
    assert bool((y[~nan_block].abs() <= mx).all())
    ends = (x.abs() == mx) & ~nan_block
    assert bool((y[ends] == x[ends]).all()), "+-max must dequantize to +-max"
    _assert_same_values(dequantize(q, torch.float32), ref_dequantize(q, torch.float32))


def test_nf4_bucket_table_matches_searchsorted():
    """The kernel's NF4 bucket table (code = below[b] + (p > thr[b]), b = trunc(16 clamp(p, -1, 1) + 16)
    clamped to 31, fp32 arithmetic as on GPU) equals searchsorted over the midpoints: every fp32 within 4096 ulps
    of each bucket edge and each midpoint (where rounding of 16 p + 16 could misplace p), plus 2**20
    uniform points. An exhaustive run over all fp32 in [-1.01, 1.01] is recorded in quant.md."""
    from agoq.kernels._launch import nf4_lut_cpu, nf4_lut_split, nf4_midpoints_f32

    thr, below = nf4_lut_split(nf4_lut_cpu())
    mids = nf4_midpoints_f32()
    anchors = torch.cat([torch.arange(33, dtype=torch.float32) / 16.0 - 1.0, mids, torch.tensor([1.01])])
    ulps = torch.arange(-4096, 4097, dtype=torch.int32)
    bits = anchors.view(torch.int32)[:, None] + ulps[None, :]
    near = torch.cat([bits.view(torch.float32), (-bits.abs()).view(torch.float32)], 0).reshape(-1)
    gen = torch.Generator().manual_seed(0)
    # p beyond [-1, 1] (fp16 scales round below absmax: |p| < 1.5) is clamped first, as in the kernel
    p = torch.cat([near, torch.rand(1 << 20, generator=gen) * 3.0 - 1.5, torch.tensor([-1.4999, -1.0625, 1.4999])])
    p = p[(p >= -1.5) & (p <= 1.5)]
    b = torch.clamp((p.clamp(-1.0, 1.0) * 16.0 + 16.0).to(torch.int32), 0, 31).long()
    code = below[b] + (p > thr[b]).to(torch.int32)
    assert torch.equal(code, torch.searchsorted(mids, p).to(torch.int32))
