"""Two or more GPUs of one host: the NVLink peer transport of the 8-bit gradient store
(agoq.comm.symm_store.SymmetricBlocks) gives bit for bit the results of the NCCL transport
(agoq.comm.reduce.allreduce_blocks_ / reduce_blocks_to_owners) on the same stored blocks: random stores with a
NaN block, ragged chunking, overlapping owner ranges (a block across a shard boundary), synchronous and on the
side stream (as under --overlap-grad-reduce), and a second call reusing the store (the closing barrier); the
reduce-to-owners that requantizes in place (the 8-bit store's case) equals the reference quantization of the NCCL
transport's sums.

Run: ``pytest tests/e2e/test_peer_store_multigpu.py -m multigpu`` (2 GPUs; also at 4 when 4 are visible).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.multigpu]

FMT = "int8_b256"
BLOCKS_PER_RANK = 37  # odd: ragged chunks
CHUNK_BLOCKS = 5


def _stores(world: int, seed: int):
    from agoq.formats import parse_format
    from agoq.ref.quant import ref_quantize

    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world):
        x = torch.randn(world * BLOCKS_PER_RANK * 256, generator=g) * (1 + 3 * r)
        x[1000 + r] = 1e4  # an outlier block
        q = ref_quantize(x, parse_format(FMT))
        if r == 0:
            q.scales[3] = float("nan")  # a non-finite block stays non-finite through both transports
        out.append((q.codes.reshape(-1).clone(), q.scales.reshape(-1).clone()))
    return out


def _rank_fn(rank: int, world: int, stores: list, ranges: list) -> dict:
    import torch.distributed as dist

    from agoq.comm.pipeline import run_maybe_async
    from agoq.comm.reduce import allreduce_blocks_, reduce_blocks_to_owners
    from agoq.comm.symm_store import SymmetricBlocks, symmetric_bytes

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD
    codes, scales = (t.to(dev) for t in stores[rank])
    nblocks = scales.numel()
    peer = SymmetricBlocks(group, FMT, nblocks, dev)
    out = {"symm_bytes": symmetric_bytes(), "nbytes": peer.nbytes}
    for async_op in (False, True):
        ref_c, ref_s = codes.clone(), scales.clone()
        allreduce_blocks_(ref_c, ref_s, FMT, group, average=True, post_scale=0.5,
                          chunk_bytes=CHUNK_BLOCKS * 256 * world)
        for repeat in range(2):  # the second call reuses the store right after the first
            peer.codes_u8.copy_(codes)
            peer.scales.copy_(scales)
            h = run_maybe_async(dev, lambda p=peer: p.allreduce_(average=True, post_scale=0.5), async_op=async_op)
            if h is not None:
                h.wait()
            out[f"ar_{async_op}_{repeat}"] = (torch.equal(peer.codes_u8, ref_c),
                                              torch.equal(peer.scales.view(torch.uint8), ref_s.view(torch.uint8)))
        ref_got, got = {}, {}
        reduce_blocks_to_owners(codes, scales, FMT, ranges, lambda b, v, d=ref_got: d.__setitem__(b, v.clone()), group,
                                post_scale=2.0, chunk_bytes=CHUNK_BLOCKS * 256 * world)
        peer.codes_u8.copy_(codes)
        peer.scales.copy_(scales)
        h = run_maybe_async(dev, lambda p=peer, d=got: p.reduce_to_owners(
            ranges, lambda b, v: d.__setitem__(b, v.clone()), average=False, post_scale=2.0,
            chunk_blocks=CHUNK_BLOCKS), async_op=async_op)
        if h is not None:
            h.wait()
        ref_cat = torch.cat([ref_got[k] for k in sorted(ref_got)]) if ref_got else torch.empty(0, device=dev)
        cat = torch.cat([got[k] for k in sorted(got)]) if got else torch.empty(0, device=dev)
        out[f"owners_{async_op}"] = (ref_cat.numel() == (ranges[rank][1] - ranges[rank][0]) * 256
                                     and torch.equal(ref_cat.view(torch.int32), cat.view(torch.int32)))
        out[f"owners_unmodified_{async_op}"] = torch.equal(peer.codes_u8, codes)  # reading leaves the store as it was
        out[f"owners_in_place_{async_op}"] = _in_place_matches(peer, codes, scales, ranges, rank, ref_cat, async_op)
    torch.cuda.synchronize()
    del peer
    out["symm_bytes_after"] = symmetric_bytes()
    return out


def _in_place_matches(peer, codes, scales, ranges, rank, ref_f32, async_op) -> tuple[bool, bool, bool]:
    """The 8-bit store's case (float_spans): the blocks shared with a neighbour's range arrive in fp32 (equal to
    the NCCL transport's) and stay untouched in the store; every other block of the range is requantized by the
    reduce kernel into this rank's own rows, equal to the reference quantization of the NCCL transport's sums."""
    from agoq.comm.pipeline import run_maybe_async
    from agoq.formats import parse_format
    from agoq.ref.quant import ref_quantize

    lo, hi = ranges[rank]
    shared = sorted({b for q, (a, z) in enumerate(ranges) if q != rank for b in range(max(lo, a), min(hi, z))})
    peer.codes_u8.copy_(codes)
    peer.scales.copy_(scales)
    got = {}
    h = run_maybe_async(codes.device, lambda: peer.reduce_to_owners(
        ranges, lambda b, v: got.__setitem__(b, v.clone()), average=False, post_scale=2.0, chunk_blocks=CHUNK_BLOCKS,
        float_spans=[(b, b + 1) for b in shared]), async_op=async_op)
    if h is not None:
        h.wait()
    torch.cuda.synchronize()
    ref_blocks = ref_f32.view(hi - lo, 256)
    floats_ok = sorted(got) == shared and all(
        torch.equal(got[b].view(torch.int32), ref_blocks[b - lo].view(torch.int32)) for b in shared)
    expect = ref_quantize(ref_f32, parse_format(FMT))
    own = torch.tensor([b for b in range(lo, hi) if b not in shared], dtype=torch.long, device=codes.device)
    store_codes = peer.codes_u8.view(-1, 256)
    codes_ok = torch.equal(store_codes[own], expect.codes.view(-1, 256)[own - lo])
    scales_ok = torch.equal(peer.scales.view(torch.int32)[own], expect.scales.reshape(-1).view(torch.int32)[own - lo])
    untouched = torch.tensor(shared, dtype=torch.long, device=codes.device)
    shared_ok = torch.equal(store_codes[untouched], codes.view(-1, 256)[untouched])
    return floats_ok and shared_ok, codes_ok, scales_ok


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("world", [2, 4])
def test_peer_store_reductions_equal_nccl_transport(world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, {_gpus()} visible")
    from agoq.testing.dist import spawn_ranks

    stores = _stores(world, seed=world)
    nblocks = world * BLOCKS_PER_RANK
    # owner ranges as the distributed optimizer's shards give them: neighbours share the boundary block
    ranges = [(max(0, r * nblocks // world - 1), min(nblocks, (r + 1) * nblocks // world + 1)) for r in range(world)]
    per_rank = spawn_ranks(world, _rank_fn, backend="nccl", args=(stores, ranges))
    for rank, res in enumerate(per_rank):
        for key, value in res.items():
            if key.startswith(("ar_", "owners")):
                assert value is True or all(value), f"rank {rank} {key}: {value}"
        assert res["symm_bytes"] >= res["nbytes"] >= nblocks * (256 + 4)  # the store is counted
        assert res["symm_bytes_after"] == res["symm_bytes"] - res["nbytes"]
