"""agoq.kernels.comm vs agoq.ref.comm: identical codes, scales and values for the three per-chunk ops of the
8-bit reduction (quantize_rows, reduce_rows, dequantize_rows), over formats, input dtypes, row
geometries (ragged rows, padding past the tensor, chunk offsets, packed [codes | scales] views) and
adversarial blocks (all zero, NaN, Inf, 1e4x outlier).

CPU: ``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_comm_kernels.py``; GPU: without it.
Interpreter limits (docs in tests/kernels/test_quant_kernels.py): fp8 quantization is GPU-only; a bf16
output may differ by one bf16 ulp (the interpreter truncates fp32 -> bf16).
"""

import os

import pytest
import torch

from agoq.formats import parse_format
from agoq.ref.comm import ref_dequantize_rows, ref_quantize_rows, ref_reduce_rows
from agoq.ref.quant import QuantizedTensor, ref_dequantize, ref_quantize

pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
FP8_QUANT_GPU = pytest.mark.gpu(reason="interpreter fp8 cast does not round ties to even (Triton 3.8)")

INT_FORMATS = ["int8_b256", "int8_b128_s16", "int8_b64_sp2", "int8_b32"]
FP8_FORMATS = ["fp8e4m3_b128", "fp8e5m2_b64_s16"]
# (world, row_stride, row_numel, numel, col0, nb): aligned, ragged row, padding past the tensor, chunk offset
GEOMETRIES = [(2, 1024, 1024, 2048, 0, 4), (3, 1000, 1000, 2999, 0, 4), (2, 700, 700, 1400, 256, 2),
              (1, 300, 300, 300, 0, 2), (4, 513, 513, 2000, 0, 3)]  # fmt: skip


def _ops():
    from agoq.kernels.comm import dequantize_rows, quantize_rows, reduce_rows  # TRITON_INTERPRET read at import

    return quantize_rows, reduce_rows, dequantize_rows


def _sdt(fmt):
    return {"fp32": torch.float32, "fp16": torch.float16, "pow2": torch.uint8}[fmt.scale]


def _packed(world, nb, fmt, fill=0):
    """[codes | scales] packed rows (as agoq.comm.reduce sends them) and their 2-D views."""
    cb = nb * fmt.block
    buf = torch.full((world, cb + nb * fmt.scale_bytes), fill, dtype=torch.uint8, device=DEVICE)
    return buf, buf[:, :cb], buf[:, cb:].view(_sdt(fmt))


def _data(numel, seed, dtype=torch.float32, case="gauss"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    if case == "adversarial" and numel > 600:
        x[:256] = 0.0
        x[300] = 1e4 * x[301]
        x[555] = float("nan")
        x[-5] = float("inf")
    return x.to(dtype).to(DEVICE)


def _same_values(a, b):
    """Equal float tensors: same NaN positions (NaN payloads may differ between GPU and CPU), identical
    bits elsewhere (bf16 in the interpreter: within one ulp, see the module docstring)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    a, b = a[~nan], b[~nan]
    if a.dtype == torch.bfloat16 and INTERPRET:
        return bool(((a.view(torch.int16).int() - b.view(torch.int16).int()).abs() <= 1).all())
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _codes_of_nonfinite_blocks_zeroed(buf, nb, fmt):
    """A packed [codes | scales] buffer with the codes of NaN-scale (non-finite) blocks set to 0. Their codes
    are unspecified: the NaN scale alone decides the values (NaN), and casting NaN to an integer code differs
    between devices (the reference run on a GPU and on the CPU give different bytes there)."""
    out = buf.clone()
    cb = nb * fmt.code_bytes(fmt.block)
    scales = out[:, cb: cb + nb * fmt.scale_bytes].view(_sdt(fmt))
    if scales.is_floating_point():
        bad = torch.isnan(scales).repeat_interleave(fmt.code_bytes(fmt.block), dim=1)
        out[:, :cb][bad] = 0
        scales.masked_fill_(torch.isnan(scales), float("nan"))  # one NaN payload
    return out


def _params(formats):
    return [pytest.param(f, marks=FP8_QUANT_GPU) if f.startswith("fp8") else f for f in formats]


@pytest.mark.parametrize("name", _params(INT_FORMATS + FP8_FORMATS))
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype, case", [(torch.float32, "gauss"), (torch.bfloat16, "gauss"),
                                         (torch.float32, "adversarial")])
def test_quantize_rows_matches_reference(name, geometry, dtype, case):
    fmt = parse_format(name)
    world, row_stride, row_numel, numel, col0, nb = geometry
    src = _data(numel, 1, dtype, case)
    kw = dict(row_stride=row_stride, row_numel=row_numel, col0=col0)
    ref_buf, rc, rs = _packed(world, nb, fmt, fill=7)
    got_buf, gc, gs = _packed(world, nb, fmt, fill=7)
    ref_quantize_rows(src, rc, rs, fmt, **kw)
    _ops()[0](src, gc, gs, fmt, **kw)
    for scales in (rs, gs):  # NaN scales (non-finite blocks): payload bits differ between torch and Triton casts
        if scales.is_floating_point():
            scales.masked_fill_(torch.isnan(scales), float("nan"))
    assert torch.equal(ref_buf, got_buf)


def _random_rows(world, nb, fmt, seed, case):
    """Codes/scales rows holding a quantized random chunk per row (built with the reference)."""
    buf, c, s = _packed(world, nb, fmt)
    x = _data(world * nb * fmt.block, seed, torch.float32, case)
    ref_quantize_rows(x, c, s, fmt, row_stride=nb * fmt.block, row_numel=nb * fmt.block, col0=0)
    return buf, c, s


@pytest.mark.parametrize("name", INT_FORMATS + FP8_FORMATS)
@pytest.mark.parametrize("world, nb", [(1, 3), (2, 4), (3, 2), (4, 5)])
@pytest.mark.parametrize("average, post_scale", [(False, 1.0), (True, 1.0), (False, 0.125), (True, 0.3)])
@pytest.mark.parametrize("case", ["gauss", "adversarial"])
def test_reduce_rows_to_float_matches_reference(name, world, nb, average, post_scale, case):
    fmt = parse_format(name)
    _, c, s = _random_rows(world, nb, fmt, 11 + world, case)
    valid = nb * fmt.block - 17
    for out_dtype in (torch.float32, torch.bfloat16):
        ref = torch.full((nb * fmt.block,), 3.0, dtype=out_dtype, device=DEVICE)
        got = ref.clone()
        ref_reduce_rows(c, s, fmt, average=average, post_scale=post_scale, out=ref, out_numel=valid)
        _ops()[1](c, s, fmt, average=average, post_scale=post_scale, out=got, out_numel=valid)
        assert _same_values(got, ref), out_dtype
        assert torch.equal(got[valid:], ref[valid:])  # past out_numel: untouched


@pytest.mark.parametrize("name", _params(INT_FORMATS + FP8_FORMATS))
@pytest.mark.parametrize("world, nb", [(1, 3), (2, 4), (3, 2), (4, 5)])
@pytest.mark.parametrize("average, post_scale", [(False, 1.0), (True, 0.5)])
@pytest.mark.parametrize("case", ["gauss", "adversarial"])
def test_reduce_rows_requantized_matches_reference(name, world, nb, average, post_scale, case):
    fmt = parse_format(name)
    _, c, s = _random_rows(world, nb, fmt, 21 + world, case)
    ref_buf, rcode, rscale = _packed(1, nb, fmt, fill=9)
    got_buf, gcode, gscale = _packed(1, nb, fmt, fill=9)
    ref_reduce_rows(c, s, fmt, average=average, post_scale=post_scale, codes_out=rcode, scales_out=rscale)
    _ops()[1](c, s, fmt, average=average, post_scale=post_scale, codes_out=gcode, scales_out=gscale)
    assert torch.equal(_codes_of_nonfinite_blocks_zeroed(ref_buf, nb, fmt),
                       _codes_of_nonfinite_blocks_zeroed(got_buf, nb, fmt))


@pytest.mark.parametrize("name", INT_FORMATS + FP8_FORMATS)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_rows_matches_reference(name, geometry, dst_dtype):
    fmt = parse_format(name)
    world, row_stride, row_numel, numel, col0, nb = geometry
    _, c, s = _random_rows(world, nb, fmt, 31, "adversarial")
    ref = torch.full((numel,), -2.0, dtype=dst_dtype, device=DEVICE)
    got = ref.clone()
    kw = dict(row_stride=row_stride, row_numel=row_numel, col0=col0)
    ref_dequantize_rows(c, s, ref, fmt, **kw)
    _ops()[2](c, s, got, fmt, **kw)
    assert _same_values(got, ref)
    assert int((ref != -2.0).sum()) > 0  # something was written


def test_reference_row_geometry_is_the_documented_one():
    """ref_quantize_rows reads src[p*row_stride + col0 + j] (zeros past row_numel / numel): check against a
    direct construction, so the reference itself is pinned to its docstring."""
    fmt = parse_format("int8_b32")
    world, row_stride, row_numel, numel, col0, nb = 3, 50, 45, 140, 32, 1
    src = torch.arange(1, numel + 1, dtype=torch.float32)
    _, c, s = _packed(world, nb, fmt)
    ref_quantize_rows(src.to(DEVICE), c, s, fmt, row_stride=row_stride, row_numel=row_numel, col0=col0)
    dst = torch.zeros(world, nb * fmt.block)
    for p in range(world):
        for j in range(nb * fmt.block):
            col, idx = col0 + j, p * row_stride + col0 + j
            dst[p, j] = src[idx] if col < row_numel and idx < numel else 0.0
    for p in range(world):
        q = QuantizedTensor(c[p].cpu().contiguous(), s[p].cpu().contiguous(), fmt, torch.Size((fmt.block,)),
                            torch.float32)
        assert torch.equal(ref_dequantize(q), ref_dequantize(ref_quantize(dst[p], fmt)))


def test_rejects_multi_byte_plane_formats():
    fmt = parse_format("int4_b64")
    _, c, s = _packed(2, 1, parse_format("int8_b64"))
    with pytest.raises(ValueError, match="one-byte formats"):
        _ops()[0](torch.zeros(128, device=DEVICE), c, s, fmt, row_stride=64, row_numel=64, col0=0)


@pytest.mark.parametrize("name", _params(INT_FORMATS + FP8_FORMATS))
@pytest.mark.parametrize("n, nb", [(256 * 3, 3), (700, 3), (1, 1)])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("case", ["gauss", "adversarial"])
def test_accumulate_matches_reference(name, n, nb, grad_dtype, feedback, case):
    from agoq.kernels.comm import accumulate_
    from agoq.ref.comm import ref_accumulate_

    fmt = parse_format(name)
    nb = max(nb, -(-n // fmt.block))
    start = ref_quantize(_data(nb * fmt.block, 41), fmt)
    ref_c, ref_s = start.codes.clone().to(DEVICE), start.scales.clone().to(DEVICE)
    got_c, got_s = ref_c.clone(), ref_s.clone()
    ref_r = (_data(nb * fmt.block, 42) * 1e-3).to(torch.bfloat16) if feedback else None
    got_r = ref_r.clone() if feedback else None
    for step in range(2):  # twice: the second call reads what the first wrote
        if feedback and INTERPRET:  # the interpreter's bf16 residual may be 1 ulp off: restart from the ref's
            got_r.copy_(ref_r)
        g = _data(n, 43 + step, grad_dtype, case)
        ref_accumulate_(ref_c, ref_s, g, fmt, ref_r)
        accumulate_(got_c, got_s, g, fmt, got_r)
        assert torch.equal(got_c, ref_c)
        assert _same_values(got_s, ref_s) if got_s.is_floating_point() else torch.equal(got_s, ref_s)
        if feedback:
            assert _same_values(got_r, ref_r)


# -- rows in separate allocations (agoq.comm.symm: the peers' symmetric memory) --------------------------

def _separate_rows(c, s):
    """Each row of the packed views copied into its own allocation (as W peers' buffers are)."""
    return [c[p].clone() for p in range(c.shape[0])], [s[p].clone() for p in range(s.shape[0])]


@pytest.mark.parametrize("name", _params(INT_FORMATS + ["fp8e4m3_b128"]))
@pytest.mark.parametrize("world, nb", [(1, 3), (2, 4), (3, 2), (4, 5)])
@pytest.mark.parametrize("average, post_scale", [(False, 1.0), (True, 0.5)])
def test_reduce_peer_rows_match_reference_and_strided_kernel(name, world, nb, average, post_scale):
    """Requantized and float outputs from rows in W allocations: identical to the reference of the same
    signature and to the strided kernel on the packed rows (the all-reduce's results do not depend on
    the transport)."""
    from agoq.kernels.comm import peer_tables, reduce_peer_rows
    from agoq.ref.comm import ref_reduce_peer_rows

    fmt = parse_format(name)
    _, c, s = _random_rows(world, nb, fmt, 41 + world, "adversarial")
    code_rows, scale_rows = _separate_rows(c, s)
    tables = peer_tables(code_rows, scale_rows)
    assert tables.codes_aligned  # separate allocations: 16-byte aligned (the ALIGNED kernels)
    bufs = [_packed(1, nb, fmt, fill=9) for _ in range(3)]
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=average, post_scale=post_scale,
                         codes_out=bufs[0][1], scales_out=bufs[0][2])
    reduce_peer_rows(code_rows, scale_rows, fmt, average=average, post_scale=post_scale,
                     codes_out=bufs[1][1], scales_out=bufs[1][2], tables=tables)
    _ops()[1](c, s, fmt, average=average, post_scale=post_scale, codes_out=bufs[2][1], scales_out=bufs[2][2])
    assert torch.equal(bufs[1][0], bufs[2][0])  # peer rows = packed rows, whatever the device
    ref_buf, got_buf = (_codes_of_nonfinite_blocks_zeroed(b[0], nb, fmt) for b in bufs[:2])
    assert torch.equal(ref_buf, got_buf)  # = the reference (as test_reduce_rows_requantized_matches_reference)
    valid = nb * fmt.block - 17
    ref = torch.full((nb * fmt.block,), 3.0, device=DEVICE)
    got = ref.clone()
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=average, post_scale=post_scale, out=ref,
                         out_numel=valid)
    reduce_peer_rows(code_rows, scale_rows, fmt, average=average, post_scale=post_scale, out=got, out_numel=valid)
    assert _same_values(got, ref) and torch.equal(got[valid:], ref[valid:])


@pytest.mark.parametrize("name", ["int8_b256", "int8_b64_sp2", "fp8e5m2_b64_s16"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_dequantize_peer_rows_match_reference(name, geometry):
    from agoq.kernels.comm import dequantize_peer_rows
    from agoq.ref.comm import ref_dequantize_peer_rows

    fmt = parse_format(name)
    world, row_stride, row_numel, numel, col0, nb = geometry
    _, c, s = _random_rows(world, nb, fmt, 51, "adversarial")
    code_rows, scale_rows = _separate_rows(c, s)
    ref = torch.full((numel,), -2.0, device=DEVICE)
    got = ref.clone()
    kw = dict(row_stride=row_stride, row_numel=row_numel, col0=col0)
    ref_dequantize_peer_rows(code_rows, scale_rows, ref, fmt, **kw)
    dequantize_peer_rows(code_rows, scale_rows, got, fmt, **kw)
    assert _same_values(got, ref) and int((ref != -2.0).sum()) > 0


def test_peer_rows_are_checked():
    from agoq.kernels.comm import reduce_peer_rows, row_address_table

    fmt = parse_format("int8_b256")
    _, c, s = _random_rows(2, 2, fmt, 3, "gauss")
    code_rows, scale_rows = _separate_rows(c, s)
    with pytest.raises(ValueError, match="one codes and one scales row per rank"):
        reduce_peer_rows(code_rows, scale_rows[:1], fmt, average=False, post_scale=1.0, out=torch.empty(512))
    with pytest.raises(ValueError, match="2 contiguous blocks"):
        reduce_peer_rows([code_rows[0], code_rows[1][:256]], scale_rows, fmt, average=False, post_scale=1.0,
                         out=torch.empty(512))
    with pytest.raises(TypeError, match="peer_tables"):  # bare address tables carry no alignment check
        reduce_peer_rows(code_rows, scale_rows, fmt, average=False, post_scale=1.0, out=torch.empty(512),
                         tables=(row_address_table(code_rows), row_address_table(scale_rows)))


class _LaunchSpy:
    """Forwards to a FastKernel launcher and keeps the arguments of each launch."""

    def __init__(self, launcher):
        self.launcher, self.args = launcher, []

    def __call__(self, grid, *args):
        self.args.append(args)
        self.launcher(grid, *args)


@pytest.mark.parametrize("name", ["int8_b256", "int8_b32", "int8_b64_sp2"])
@pytest.mark.parametrize("offset", [0, 8, 1])
def test_peer_kernels_aligned_flag_follows_the_row_addresses(name, offset, monkeypatch):
    """peer_tables sets codes_aligned only when every codes row starts at a multiple of PEER_ROW_ALIGN_BYTES (here
    the last row of three is moved ``offset`` bytes into its allocation); the reduce and dequantize launches carry
    it as ALIGNED (their last argument: 16-byte vector loads of the codes, tests/kernels/test_xcompile.py) and give
    the reference's results either way."""
    from agoq.kernels import comm as k
    from agoq.ref.comm import ref_dequantize_peer_rows, ref_reduce_peer_rows

    fmt = parse_format(name)
    world, nb = 3, 4
    _, c, s = _random_rows(world, nb, fmt, 71, "adversarial")
    code_rows, scale_rows = _separate_rows(c, s)
    last = torch.zeros(code_rows[-1].numel() + offset, dtype=code_rows[-1].dtype, device=DEVICE)[offset:]
    code_rows[-1] = last.copy_(code_rows[-1])
    assert [r.data_ptr() % k.PEER_ROW_ALIGN_BYTES for r in code_rows] == [0, 0, offset]  # allocations: 16-aligned
    tables = k.peer_tables(code_rows, scale_rows)
    assert tables.codes_aligned is (offset == 0)
    quant, reduce, dequant = k._KERNELS[k.PEER_NUM_WARPS]
    spies = _LaunchSpy(reduce), _LaunchSpy(dequant)
    monkeypatch.setitem(k._KERNELS, k.PEER_NUM_WARPS, (quant, *spies))

    ref_buf, got_buf = _packed(1, nb, fmt, fill=9), _packed(1, nb, fmt, fill=9)
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=0.5, codes_out=ref_buf[1],
                         scales_out=ref_buf[2])  # fmt: skip
    k.reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=0.5, codes_out=got_buf[1],
                       scales_out=got_buf[2], tables=tables)  # fmt: skip
    assert torch.equal(*(_codes_of_nonfinite_blocks_zeroed(b[0], nb, fmt) for b in (ref_buf, got_buf)))
    n = nb * fmt.block
    ref, got = torch.full((n,), 3.0, device=DEVICE), torch.full((n,), 3.0, device=DEVICE)
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=False, post_scale=1.0, out=ref, out_numel=n - 5)
    k.reduce_peer_rows(code_rows, scale_rows, fmt, average=False, post_scale=1.0, out=got, out_numel=n - 5)
    assert _same_values(got, ref)
    ref, got = torch.full((world * n,), -2.0, device=DEVICE), torch.full((world * n,), -2.0, device=DEVICE)
    kw = dict(row_stride=n, row_numel=n, col0=0)
    ref_dequantize_peer_rows(code_rows, scale_rows, ref, fmt, **kw)
    k.dequantize_peer_rows(code_rows, scale_rows, got, fmt, tables=tables, **kw)
    assert _same_values(got, ref)
    # every launch (prebuilt tables and tables built per call alike) carried the flag the rows allow
    assert [a[-1] for a in spies[0].args] == [offset == 0] * 2 and [a[-1] for a in spies[1].args] == [offset == 0]


@pytest.mark.parametrize("name", ["int8_b256", "int8_b128_s16", "int8_b64_sp2"])
@pytest.mark.parametrize("world, nb, cut", [(2, 3, 100), (3, 2, 0), (4, 2, 300)])
def test_reduce_peer_rows_several_output_rows(name, world, nb, cut):
    """One launch, W output rows (the one-shot all-reduce): row q sums row q of every peer and is written at
    q * stride, nothing at or past out_total (the all-reduce's tail padding); equal to W single-row reductions
    and to the reference of the same signature."""
    from agoq.kernels.comm import reduce_peer_rows
    from agoq.ref.comm import ref_reduce_peer_rows

    fmt = parse_format(name)
    stride = nb * fmt.block
    peers = [_random_rows(world, nb, fmt, 60 + p, "adversarial")[1:] for p in range(world)]  # peer p: [W rows]
    code_rows = [peers[p][0][q].clone() for q in range(world) for p in range(world)]
    scale_rows = [peers[p][1][q].clone() for q in range(world) for p in range(world)]
    total = world * stride - cut
    kw = dict(average=False, post_scale=0.25, out_numel=stride, out_rows=world, out_row_stride=stride, out_total=total)
    ref = torch.full((world * stride,), 5.0, device=DEVICE)
    got, single = ref.clone(), ref.clone()
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, out=ref, **kw)
    reduce_peer_rows(code_rows, scale_rows, fmt, out=got, **kw)
    for q in range(world):
        n = max(0, min(stride, total - q * stride))
        reduce_peer_rows(code_rows[q * world: (q + 1) * world], scale_rows[q * world: (q + 1) * world], fmt,
                         average=False, post_scale=0.25, out=single[q * stride:], out_numel=n)
    assert _same_values(got, ref) and _same_values(got, single)
    assert bool((got[total:] == 5.0).all())


# -- push: the requantized sum written into every output row (agoq.comm.symm_store's all-reduce) --------------

def _push_rows(world, nb, fmt, seed, case):
    """W separate (codes, scales) rows of nb blocks, quantized with the reference from: random values ("gauss"),
    all zeros ("zeros"), or random values with a zero block, a 1e4x outlier, a NaN and an Inf in three different
    blocks of three different rows ("specials": every non-finite block stays non-finite in the sum)."""
    n = nb * fmt.block
    x = torch.zeros(world * n) if case == "zeros" else _data(world * n, seed).cpu()
    if case == "specials":
        x[:fmt.block] = 0.0  # row 0, block 0: zero
        x[n // 2] = 1e4 * (1.0 + abs(float(x[n // 2])))  # row 0: an outlier
        x[(world - 1) * n + n - 3] = float("nan")  # the last row's last block
        x[min(1, world - 1) * n + (nb // 2) * fmt.block + 1] = float("inf")  # row 1 (or 0), a middle block
    _, c, s = _packed(world, nb, fmt)
    ref_quantize_rows(x.to(DEVICE), c, s, fmt, row_stride=n, row_numel=n, col0=0)
    return _separate_rows(c, s)


def _row_bytes(code_row, scale_row, fmt):
    """One (codes, scales) row as comparable bytes: codes of non-finite (NaN-scale) blocks zeroed and one NaN
    payload (see _codes_of_nonfinite_blocks_zeroed)."""
    return _codes_of_nonfinite_blocks_zeroed(torch.cat([code_row.view(torch.uint8), scale_row.view(torch.uint8)])
                                             [None], scale_row.numel(), fmt)  # fmt: skip


PUSH_SHAPES = [(2, 1), (2, 17), (3, 5), (4, 33)]  # (W, blocks): odd counts, a tail program, W = 2, 3, 4


@pytest.mark.parametrize("name", _params(["int8_b256", "int8_b32", "int8_b128_s16", "int8_b64_sp2",
                                          "fp8e4m3_b128"]))
@pytest.mark.parametrize("world, nb", PUSH_SHAPES)
@pytest.mark.parametrize("average, post_scale", [(False, 1.0), (True, 0.5)])
@pytest.mark.parametrize("case", ["gauss", "zeros", "specials"])
def test_reduce_peer_rows_push_writes_every_row(name, world, nb, average, post_scale, case):
    """Push mode (codes_out_rows / scales_out_rows): the requantized sum in every one of W separate output rows,
    each equal to the reference of the same signature and to the one-row requantized kernel; then in place
    (outputs = inputs, the same tables: the store all-reduce), every input row holds that same result."""
    from agoq.kernels.comm import peer_tables, reduce_peer_rows
    from agoq.ref.comm import ref_reduce_peer_rows

    fmt = parse_format(name)
    code_rows, scale_rows = _push_rows(world, nb, fmt, 81 + world + nb, case)
    kw = dict(average=average, post_scale=post_scale)
    one = _packed(1, nb, fmt, fill=9)
    reduce_peer_rows(code_rows, scale_rows, fmt, codes_out=one[1], scales_out=one[2], **kw)
    expect = _codes_of_nonfinite_blocks_zeroed(one[0], nb, fmt)
    outs = {impl: ([torch.full_like(c, 9) for c in code_rows], [torch.full_like(s, 9) for s in scale_rows])
            for impl in ("ref", "kernel")}
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, codes_out_rows=outs["ref"][0], scales_out_rows=outs["ref"][1],
                         **kw)  # fmt: skip
    reduce_peer_rows(code_rows, scale_rows, fmt, codes_out_rows=outs["kernel"][0], scales_out_rows=outs["kernel"][1],
                     **kw)  # fmt: skip
    for impl, (cs, ss) in outs.items():
        for q in range(world):
            assert torch.equal(_row_bytes(cs[q], ss[q], fmt), expect), (impl, q)
    tables = peer_tables(code_rows, scale_rows)
    ref_rows = ([c.clone() for c in code_rows], [s.clone() for s in scale_rows])
    ref_reduce_peer_rows(*ref_rows, fmt, codes_out_rows=ref_rows[0], scales_out_rows=ref_rows[1], **kw)
    reduce_peer_rows(code_rows, scale_rows, fmt, codes_out_rows=code_rows, scales_out_rows=scale_rows,
                     tables=tables, out_tables=tables, **kw)  # fmt: skip
    for q in range(world):
        assert torch.equal(_row_bytes(code_rows[q], scale_rows[q], fmt), expect), ("in place", q)
        assert torch.equal(_row_bytes(ref_rows[0][q], ref_rows[1][q], fmt), expect), ("ref in place", q)


@pytest.mark.parametrize("in_offset, out_offset", [(0, 0), (0, 8), (8, 0)])
def test_push_aligned_flag_needs_every_input_and_output_row_aligned(in_offset, out_offset, monkeypatch):
    """The push launch carries ALIGNED (its last argument: vector loads and stores of the codes) only when every
    input and every output codes row starts at a multiple of PEER_ROW_ALIGN_BYTES, and gives the reference's
    rows either way."""
    from agoq.kernels import comm as k
    from agoq.ref.comm import ref_reduce_peer_rows

    fmt = parse_format("int8_b256")
    world, nb = 3, 5
    code_rows, scale_rows = _push_rows(world, nb, fmt, 91, "specials")

    def moved(rows, offset):  # the last row `offset` bytes into its allocation
        last = torch.zeros(rows[-1].numel() + offset, dtype=rows[-1].dtype, device=DEVICE)[offset:]
        return rows[:-1] + [last.copy_(rows[-1])]

    code_rows = moved(code_rows, in_offset)
    out_codes = moved([torch.full_like(c, 9) for c in code_rows], out_offset)
    out_scales = [torch.full_like(s, 9) for s in scale_rows]
    quant, reduce, dequant = k._KERNELS[k.PEER_NUM_WARPS]
    spy = _LaunchSpy(reduce)
    monkeypatch.setitem(k._KERNELS, k.PEER_NUM_WARPS, (quant, spy, dequant))
    k.reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=0.25, codes_out_rows=out_codes,
                       scales_out_rows=out_scales, tables=k.peer_tables(code_rows, scale_rows),
                       out_tables=k.peer_tables(out_codes, out_scales))  # fmt: skip
    k.reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=0.25, codes_out_rows=out_codes,
                       scales_out_rows=out_scales)  # tables built per call: the same flag
    assert [a[-1] for a in spy.args] == [in_offset == 0 and out_offset == 0] * 2
    ref_c, ref_s = [torch.empty_like(c) for c in out_codes], [torch.empty_like(s) for s in out_scales]
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=0.25, codes_out_rows=ref_c,
                         scales_out_rows=ref_s)  # fmt: skip
    for q in range(world):
        assert torch.equal(_row_bytes(out_codes[q], out_scales[q], fmt), _row_bytes(ref_c[q], ref_s[q], fmt))


def test_push_outputs_are_checked():
    from agoq.kernels.comm import reduce_peer_rows

    fmt = parse_format("int8_b256")
    code_rows, scale_rows = _push_rows(2, 2, fmt, 3, "gauss")
    kw = dict(average=False, post_scale=1.0)
    with pytest.raises(ValueError, match="exactly one of"):
        reduce_peer_rows(code_rows, scale_rows, fmt, codes_out=code_rows[0], scales_out=scale_rows[0],
                         codes_out_rows=code_rows, scales_out_rows=scale_rows, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="both codes_out_rows and scales_out_rows"):
        reduce_peer_rows(code_rows, scale_rows, fmt, codes_out_rows=code_rows, **kw)
    with pytest.raises(ValueError, match="2 contiguous blocks"):
        reduce_peer_rows(code_rows, scale_rows, fmt, codes_out_rows=[code_rows[0], code_rows[1][:256]],
                         scales_out_rows=scale_rows, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="every output row must hold 2 blocks"):
        reduce_peer_rows(code_rows, scale_rows, fmt, codes_out_rows=[c[:256] for c in code_rows],
                         scales_out_rows=[s[:1] for s in scale_rows], **kw)  # fmt: skip


class _RecordingHandle:
    """Stands in for a symmetric-memory handle: barrier() records (rank, "barrier") in a shared log."""

    def __init__(self, rank, log):
        self.rank, self.log = rank, log

    def barrier(self, channel=0):
        self.log.append((self.rank, "barrier"))


def _emulated_store(fmt, world, rank, num_blocks, buffers, log):
    """A SymmetricBlocks of rank ``rank`` over W local buffers (the peers' symmetric allocations) through its own
    view builder (_map), with a recording barrier: the W ranks of one group, emulated in one process."""
    from agoq.comm.symm_store import SymmetricBlocks

    blocks = SymmetricBlocks.__new__(SymmetricBlocks)
    blocks.fmt, blocks.world, blocks.rank, blocks.num_blocks = fmt, world, rank, num_blocks
    blocks.cb, blocks.handle = fmt.code_bytes(fmt.block), _RecordingHandle(rank, log)
    blocks._map(buffers)
    return blocks


def _spied_stores(fmt, world, nblocks, seed, monkeypatch):
    """W emulated SymmetricBlocks (_emulated_store) filled with _push_rows(..., "specials"), and reduce_peer_rows
    spied on: returns (stores, code_rows, scale_rows, launches: each launch's kwargs, log: barriers and launches in
    order)."""
    from agoq.comm import symm_store
    from agoq.kernels import comm as k

    log, launches = [], []
    real = k.reduce_peer_rows

    def spy(*args, **kw):
        launches.append(kw)
        log.append(("kernel", "reduce_peer_rows"))
        return real(*args, **kw)

    monkeypatch.setattr(k, "reduce_peer_rows", spy)  # the store imports it at the call
    nbytes = symm_store._aligned(nblocks * fmt.block) + symm_store._aligned(nblocks * _sdt(fmt).itemsize)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(world)]
    stores = [_emulated_store(fmt, world, r, nblocks, buffers, log) for r in range(world)]
    code_rows, scale_rows = _push_rows(world, nblocks, fmt, seed, "specials")
    for r in range(world):
        stores[r].codes_u8.copy_(code_rows[r])
        stores[r].scales.copy_(scale_rows[r])
    return stores, code_rows, scale_rows, launches, log


@pytest.mark.parametrize("name", _params(["int8_b256", "int8_b64_sp2", "fp8e4m3_b128"]))
@pytest.mark.parametrize("world, per_rank", [(2, 3), (3, 1), (4, 5)])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_symmetric_store_allreduce_is_one_push_between_two_barriers(name, world, per_rank, order, monkeypatch):
    """SymmetricBlocks.allreduce_ over W emulated ranks (local buffers laid out by its own _map, a recording
    barrier): each rank runs barrier, ONE reduce launch whose outputs are its segment in every rank's store, barrier
    (no copy phase); afterwards every rank's whole store is the reference's all-reduce (every block the requantized
    fp32 sum over ranks), bit for bit, whichever rank runs first (segments are disjoint)."""
    from agoq.ref.comm import ref_reduce_peer_rows

    fmt = parse_format(name)
    nblocks = world * per_rank
    stores, code_rows, scale_rows, launches, log = _spied_stores(fmt, world, nblocks, 101 + world, monkeypatch)
    expect_c, expect_s = torch.empty_like(code_rows[0]), torch.empty_like(scale_rows[0])
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=0.5, codes_out=expect_c,
                         scales_out=expect_s)  # fmt: skip
    ranks = list(range(world)) if order == "forward" else list(reversed(range(world)))
    for r in ranks:
        before = len(log)
        stores[r].allreduce_(average=True, post_scale=0.5)
        assert log[before:] == [(r, "barrier"), ("kernel", "reduce_peer_rows"), (r, "barrier")]
    for r, kw in zip(ranks, launches, strict=True):
        seg = slice(r * per_rank * stores[r].cb, (r + 1) * per_rank * stores[r].cb)
        assert "codes_out" not in kw and "out" not in kw  # pushed, not into the own rows only
        segment_r_of_every_rank = [s.codes_u8[seg].data_ptr() for s in stores]
        assert [c.data_ptr() for c in kw["codes_out_rows"]] == segment_r_of_every_rank
        assert kw["out_tables"].codes.tolist() == segment_r_of_every_rank  # the addresses the kernel stores to
        assert kw["out_tables"] is kw["tables"] and kw["tables"].codes_aligned
    expect = _row_bytes(expect_c, expect_s, fmt)
    for r in range(world):
        assert torch.equal(_row_bytes(stores[r].codes_u8, stores[r].scales, fmt), expect), r


def test_dequantize_rows_saturate_at_the_destination_dtype_like_the_reference():
    """Gradients past the destination dtype's range (here 1e5 into fp16) become its largest finite value in
    kernel and reference alike (agoq.ref.quant.saturate), never Inf; NaN blocks stay NaN."""
    fmt = parse_format("int8_b32")
    world, nb = 2, 2
    _, c, s = _packed(world, nb, fmt)
    x = torch.linspace(-1e5, 1e5, world * nb * fmt.block, device=DEVICE)
    x[3] = float("nan")
    ref_quantize_rows(x, c, s, fmt, row_stride=nb * fmt.block, row_numel=nb * fmt.block, col0=0)
    kw = dict(row_stride=nb * fmt.block, row_numel=nb * fmt.block, col0=0)
    ref = torch.zeros(x.numel(), dtype=torch.float16, device=DEVICE)
    got = ref.clone()
    ref_dequantize_rows(c, s, ref, fmt, **kw)
    _ops()[2](c, s, got, fmt, **kw)
    assert _same_values(got, ref)
    assert not torch.isinf(got).any() and float(got.nan_to_num().abs().max()) == 65504.0
    assert torch.isnan(got[:fmt.block]).all()


@pytest.mark.parametrize("name", _params(["int8_b256", "fp8e4m3_b128"]))
@pytest.mark.parametrize("world, nblocks", [(2, 9), (3, 11)])
def test_symmetric_store_reduce_to_owners_in_place_runs_are_one_launch(name, world, nblocks, monkeypatch):
    """SymmetricBlocks.reduce_to_owners over W emulated ranks, ranges that share a boundary block with the next
    rank (the distributed optimizer's case), those blocks as float spans, chunk_blocks=1: each float run goes chunk
    by chunk through fp32 (one launch and one consume per block), each in-place run is ONE launch whatever the chunk
    (chunking it only multiplied the host work); the float chunks are the reference's fp32 sums and the in-place
    blocks the reference's requantized sums, bit for bit. Ranks run in reverse order: a rank's in-place blocks are
    its own, so no order can change another rank's result."""
    from agoq.comm import symm_store
    from agoq.ref.comm import ref_reduce_peer_rows

    fmt = parse_format(name)
    stores, code_rows, scale_rows, launches, _ = _spied_stores(fmt, world, nblocks, 7 + world, monkeypatch)
    sum_f32 = torch.empty(nblocks * fmt.block, dtype=torch.float32, device=DEVICE)
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=1.0, out=sum_f32,
                         out_numel=sum_f32.numel())
    expect_c, expect_s = torch.empty_like(code_rows[0]), torch.empty_like(scale_rows[0])
    ref_reduce_peer_rows(code_rows, scale_rows, fmt, average=True, post_scale=1.0, codes_out=expect_c,
                         scales_out=expect_s)
    cuts = [round(r * nblocks / world) for r in range(world + 1)]
    ranges = [(cuts[r], min(nblocks, cuts[r + 1] + 1)) for r in range(world)]  # one block shared with the next
    shared = [(cuts[r], cuts[r] + 1) for r in range(1, world)]
    for r in reversed(range(world)):
        got, before = {}, len(launches)
        stores[r].reduce_to_owners(ranges, lambda first, v, got=got: got.setdefault(first, v.clone()), average=True,
                                   post_scale=1.0, chunk_blocks=1, float_spans=shared)
        mine = symm_store.split_segments(*ranges[r], shared)
        float_blocks = [b for a, z, f in mine if f for b in range(a, z)]
        assert len(launches) - before == len(float_blocks) + sum(1 for *_, f in mine if not f)
        assert sorted(got) == float_blocks
        for b in float_blocks:
            ref = sum_f32[b * fmt.block:(b + 1) * fmt.block]
            assert torch.equal(got[b].nan_to_num(), ref.nan_to_num()) and torch.equal(got[b].isnan(), ref.isnan())
        cb = stores[r].cb
        for a, z, f in mine:
            if not f:
                own = _row_bytes(stores[r].codes_u8[a * cb:z * cb], stores[r].scales[a:z], fmt)
                assert torch.equal(own, _row_bytes(expect_c[a * cb:z * cb], expect_s[a:z], fmt)), (r, a, z)
