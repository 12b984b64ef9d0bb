"""8-bit all-reduce / reduce-scatter on 2 and 4 gloo ranks vs agoq.ref.collectives and an exact sum.

Each world size runs one spawn_ranks call that executes every case (process start-up dominates on
2 CPU cores). Checks per case:
  * bit-identical to the single-process reference (agoq.ref.collectives) on every rank;
  * all-reduce: every rank holds the same tensor;
  * |result - exact fp64 sum| <= error_bound_8bit (derived in agoq/ref/collectives.py and
    docs/numerics.md), elementwise, for integer formats; bf16 outputs add half a bf16 ulp (2**-9 relative,
    bound 2**-8 to cover the double rounding of the fp32 sum);
  * adversarial inputs: 1e4x outlier in one block, one rank all zeros, tiny values, Inf / NaN on
    one rank (the affected block is NaN on the owner, everything else finite and in bound).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from agoq.comm.reduce import (
    allreduce_8bit,
    allreduce_blocks_,
    allreduce_blocks_gather_,
    reduce_blocks_to_owners,
    reduce_scatter_8bit,
)
from agoq.formats import parse_format
from agoq.ref.collectives import error_bound_8bit, ref_allreduce_8bit, ref_reduce_scatter_8bit
from agoq.testing.dist import spawn_ranks

pytestmark = [pytest.mark.dist]

BF16_REL_SLACK = 2.0**-8  # bf16 output: half an ulp (2**-9 relative) of the value, doubled for safety
OUTLIER_FACTOR = 1e4  # the adversarial case: one 1e4x outlier in one block
TINY = 1e-30  # far below any real gradient, still above the subnormal-scale range (qmax * 2**-126)


def _gauss(seed: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype)


def _cases(world_size: int) -> list[dict]:
    """Inputs of every rank for each case (built in the parent; forked ranks inherit them)."""
    cases = []

    def add(name, inputs, fmt="int8_b256", average=False):
        cases.append(dict(name=name, inputs=inputs, fmt=fmt, average=average))

    w = world_size
    aligned = w * 256 * 3
    add("aligned_int8", [_gauss(10 + r, aligned) for r in range(w)])
    add("tail_int8", [_gauss(20 + r, 1001 * w) for r in range(w)])  # shard 1001: not a block multiple
    add("tiny_numel", [_gauss(30 + r, w) for r in range(w)])
    add("bf16_int8_avg", [_gauss(40 + r, aligned, torch.bfloat16) for r in range(w)], average=True)
    add("int4_b64", [_gauss(50 + r, 640 * w) for r in range(w)], fmt="int4_b64")
    add("int8_b128_fp16_scales", [_gauss(60 + r, 512 * w) for r in range(w)], fmt="int8_b128_s16")
    add("fp8e4m3_b128", [_gauss(70 + r, 512 * w) for r in range(w)], fmt="fp8e4m3_b128")
    outlier = [_gauss(80 + r, aligned) for r in range(w)]
    outlier[0][300] *= OUTLIER_FACTOR
    add("outlier_1e4", outlier)
    zeros = [_gauss(90 + r, aligned) for r in range(w)]
    zeros[w - 1].zero_()
    add("one_rank_zeros", zeros)
    add("tiny_values", [_gauss(100 + r, aligned) * TINY for r in range(w)])
    inf = [_gauss(110 + r, aligned) for r in range(w)]
    inf[1][5] = float("inf")
    add("inf_one_rank", inf)
    nan = [_gauss(120 + r, aligned) for r in range(w)]
    nan[0][aligned - 3] = float("nan")
    add("nan_one_rank", nan)
    return cases


def _rank_fn(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    op = lambda c: dist.ReduceOp.AVG if c["average"] else dist.ReduceOp.SUM
    for case in cases:
        x = case["inputs"][rank]
        ar = x.clone()
        allreduce_8bit(ar, op(case), fmt=case["fmt"])
        ar_async = x.clone()
        allreduce_8bit(ar_async, op(case), async_op=True, fmt=case["fmt"]).wait()
        shard = torch.empty(x.numel() // world_size, dtype=x.dtype)
        reduce_scatter_8bit(shard, x, op(case), fmt=case["fmt"])
        shard_async = torch.empty_like(shard)
        reduce_scatter_8bit(shard_async, x, op(case), None, True, fmt=case["fmt"]).wait()
        results.append(dict(ar=ar, ar_async=ar_async, rs=shard, rs_async=shard_async))
    return results


def _exact(case) -> torch.Tensor:
    total = sum(x.double() for x in case["inputs"])
    return total / len(case["inputs"]) if case["average"] else total


def _slack(case, exact: torch.Tensor) -> torch.Tensor:
    if case["inputs"][0].dtype == torch.bfloat16:
        return exact.abs() * BF16_REL_SLACK
    return torch.zeros_like(exact)


def _nonfinite_rows(case, world_size: int) -> torch.Tensor:
    """[W, S] bool: elements in a block (of the row layout) where any rank has a non-finite input."""
    bad = torch.zeros(case["inputs"][0].numel(), dtype=torch.bool)
    for x in case["inputs"]:
        bad |= ~torch.isfinite(x)
    if not bad.any():
        return bad  # (non-finite cases use block-aligned rows, so the view below is exact)
    block = int(case["fmt"].split("_b")[1].split("_")[0])
    rows = bad.view(world_size, -1)
    return rows.view(world_size, -1, block).any(-1, keepdim=True).expand(-1, -1, block).reshape(world_size, -1)


def _check_case(case, results: list[dict], world_size: int) -> None:
    name, fmt, avg = case["name"], case["fmt"], case["average"]
    ref_ar = ref_allreduce_8bit(case["inputs"], fmt, average=avg)[0]
    ref_rs = ref_reduce_scatter_8bit(case["inputs"], fmt, average=avg)
    for r, res in enumerate(results):
        for key in ("ar", "ar_async"):
            same = torch.equal(res[key].view(torch.uint8), ref_ar.view(torch.uint8))
            assert same, f"{name}: rank {r} {key} != ref"
        for key in ("rs", "rs_async"):
            same = torch.equal(res[key].view(torch.uint8), ref_rs[r].view(torch.uint8))
            assert same, f"{name}: rank {r} {key} != ref"
    if not fmt.startswith("int"):
        return  # fp8 has no uniform-step bound; bit-equality with the reference is the check
    exact = _exact(case)
    bad = _nonfinite_rows(case, world_size).reshape(exact.shape)
    bound_ar = error_bound_8bit(case["inputs"], fmt, all_gather=True, average=avg) + _slack(case, exact)
    err_ar = (ref_ar.double() - exact).abs()
    ok = ~bad
    excess = float((err_ar - bound_ar)[ok].max())
    assert torch.all(err_ar[ok] <= bound_ar[ok]), f"{name}: all-reduce error exceeds the bound by {excess}"
    assert torch.isnan(ref_ar[bad]).all(), f"{name}: non-finite input block not NaN after all-reduce"
    bound_rs = error_bound_8bit(case["inputs"], fmt, all_gather=False, average=avg) + _slack(case, exact)
    rs = torch.cat(ref_rs).double()
    err_rs = (rs - exact).abs()
    assert torch.all(err_rs[ok] <= bound_rs[ok]), f"{name}: reduce-scatter error over bound"
    assert torch.isnan(rs[bad]).all(), f"{name}: non-finite input block not NaN after reduce-scatter"


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_8bit_matches_reference_and_bound(world_size):
    cases = _cases(world_size)
    per_rank = spawn_ranks(world_size, _rank_fn, args=(cases,))
    for idx, case in enumerate(cases):
        _check_case(case, [per_rank[r][idx] for r in range(world_size)], world_size)


def test_bound_is_tight_enough_to_fail():
    """The bound must reject a result off by one quantization step of the largest block (it can fail)."""
    inputs = [_gauss(200 + r, 1024) for r in range(2)]
    exact = sum(x.double() for x in inputs)
    bound = error_bound_8bit(inputs, "int8_b256", all_gather=True)
    wrong = exact.clone()
    wrong[7] += 2.5 * bound[7]
    assert not torch.all((wrong - exact).abs() <= bound)
    # and the reference collective itself sits well inside it on Gaussian data
    err = (ref_allreduce_8bit(inputs, "int8_b256")[0].double() - exact).abs()
    assert float((err / bound).max()) < 1.0


# -- chunked pipeline and 8-bit storage -----------------------------------------------------------------
CHUNK_BYTES = 3 * 256 * 2  # 3 blocks per rank and chunk at W=2 (int8_b256): several chunks, a ragged last one


def _chunked_rank_fn(rank: int, world_size: int, inputs: list, stores: list, ranges: list) -> dict:
    fmt = "int8_b256"
    x = inputs[rank]
    whole, chunked = x.clone(), x.clone()
    allreduce_8bit(whole, fmt=fmt)
    allreduce_8bit(chunked, dist.ReduceOp.SUM, None, True, fmt=fmt, chunk_bytes=CHUNK_BYTES).wait()
    shard = torch.empty(x.numel() // world_size)
    reduce_scatter_8bit(shard, x, fmt=fmt, chunk_bytes=CHUNK_BYTES)
    codes, scales = stores[rank][0].clone(), stores[rank][1].clone()
    allreduce_blocks_(codes, scales, fmt, average=True, post_scale=0.5, chunk_bytes=CHUNK_BYTES)
    # the all-gather route, chunked (3 blocks per chunk at W=2, 2 at W=3: ragged last chunks) and whole (async)
    g_codes, g_scales = stores[rank][0].clone(), stores[rank][1].clone()
    allreduce_blocks_gather_(g_codes, g_scales, fmt, average=True, post_scale=0.5, chunk_bytes=CHUNK_BYTES)
    w_codes, w_scales = stores[rank][0].clone(), stores[rank][1].clone()
    allreduce_blocks_gather_(w_codes, w_scales, fmt, average=True, post_scale=0.5, async_op=True).wait()
    got = {}
    reduce_blocks_to_owners(stores[rank][0], stores[rank][1], fmt, ranges,
                            lambda b, v: got.__setitem__(b, v.clone()), chunk_bytes=CHUNK_BYTES)
    return dict(whole=whole, chunked=chunked, shard=shard, codes=codes, scales=scales, owned=got,
                gather=[(g_codes, g_scales), (w_codes, w_scales)])


@pytest.mark.parametrize("world_size", [2, 3])
def test_chunked_pipeline_and_8bit_storage_reductions(world_size):
    from agoq.ref.quant import QuantizedTensor, ref_dequantize, ref_quantize

    fmt, blocks = parse_format("int8_b256"), 7 * world_size  # storage: a multiple of W blocks
    inputs = [_gauss(300 + r, 256 * 11 * world_size + 5 * world_size) for r in range(world_size)]
    quantized = [ref_quantize(_gauss(400 + r, blocks * 256), fmt) for r in range(world_size)]
    quantized[0].scales[3] = float("nan")  # a non-finite block stays non-finite
    stores = [(q.codes, q.scales) for q in quantized]
    ranges = [(max(0, r * blocks // world_size - 1), (r + 1) * blocks // world_size) for r in range(world_size)]
    per_rank = spawn_ranks(world_size, _chunked_rank_fn, args=(inputs, stores, ranges))
    ref_ar = ref_allreduce_8bit(inputs, fmt)[0]
    ref_rs = ref_reduce_scatter_8bit(inputs, fmt)
    values = [ref_dequantize(QuantizedTensor(c, s, fmt, torch.Size((blocks * 256,)), torch.float32)) for c, s in stores]
    total = values[0].clone()
    for v in values[1:]:
        total += v
    expect = ref_quantize(total / world_size * 0.5, fmt)
    for r, res in enumerate(per_rank):
        assert torch.equal(res["whole"], ref_ar) and torch.equal(res["chunked"], ref_ar)  # chunking is exact
        assert torch.equal(res["shard"], ref_rs[r])
        assert torch.equal(res["codes"], expect.codes)
        assert torch.equal(res["scales"].view(torch.uint8), expect.scales.view(torch.uint8))  # NaN bits too
        for g_codes, g_scales in res["gather"]:  # the all-gather route ends bit-identical to allreduce_blocks_
            assert torch.equal(g_codes, expect.codes)
            assert torch.equal(g_scales.view(torch.uint8), expect.scales.view(torch.uint8))
        lo, hi = ranges[r]
        owned = torch.cat([res["owned"][b] for b in sorted(res["owned"])])
        assert sorted(res["owned"])[0] == lo and owned.numel() == (hi - lo) * 256
        assert torch.equal(owned.isnan(), total[lo * 256: hi * 256].isnan())
        assert torch.equal(owned.nan_to_num(), total[lo * 256: hi * 256].nan_to_num())
