"""Benchmark agoq's 8-bit gradient reduction against NCCL all-reduce / reduce-scatter (fp32, bf16).

For every gradient size (MiB of fp32 gradient; the bf16 baselines move half the bytes) it times, per
rank, with CUDA events (median of --iters after --warmup, a barrier before each run):

  nccl_allreduce_fp32 / _bf16          torch.distributed.all_reduce
  nccl_reduce_scatter_fp32 / _bf16     torch.distributed.reduce_scatter_tensor (distributed-optimizer layout)
  agoq_allreduce_<fmt>                 agoq.comm.allreduce_8bit on the fp32 gradient, quantization included
  agoq_reduce_scatter_<fmt>            agoq.comm.reduce_scatter_8bit (owned fp32 shard, no all-gather)
  agoq_quant_roundtrip_<fmt>           local quantize + dequantize of the whole gradient (no communication)

and reports speed-ups of agoq over each NCCL baseline. Targets (issue 5, >= 256 MiB): >= 2.5x vs fp32
all-reduce and >= 1.3x vs bf16 all-reduce. A link model (docs/grads.md) predicts the speed-up on
slower links: t(agoq) ~ t_local + wire_bytes / BW, t(nccl) ~ 2 (W-1)/W * bytes / BW.

    torchrun --nproc-per-node 2 scripts/bench_allreduce.py --out docs/benchmarks/grads.json
    python scripts/bench_allreduce.py --smoke            # CPU, 2 gloo ranks, tiny sizes, no targets
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from agoq.comm.reduce import allreduce_8bit, quant_ops_for, reduce_scatter_8bit, wire_bytes
from agoq.testing.dist import spawn_ranks

DEFAULT_SIZES_MIB = [16, 64, 256, 1024]
SMOKE_SIZES_MIB = [1, 4]
TARGET_MIN_MIB = 256
TARGET_VS_FP32, TARGET_VS_BF16 = 2.5, 1.3  # issue 5
LINK_GBPS = [25, 50, 100, 200, 400]  # inter-node (IB/RoCE 200-400 Gb/s = 25-50 GB/s) up to NVLink-class


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return run


def _median_ms(fn, device, warmup: int, iters: int) -> float:
    timer = _timer(device)
    for _ in range(warmup):
        dist.barrier()
        timer(fn)
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(timer(fn))
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    return float(t.item())


def bench_size(size_mib: int, fmt: str, device: torch.device, warmup: int, iters: int) -> dict:
    world = dist.get_world_size()
    numel = size_mib * (1 << 20) // 4
    numel -= numel % world
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    x32 = torch.randn(numel, generator=g).to(device)
    x16 = x32.to(torch.bfloat16)
    work32, work16 = x32.clone(), x16.clone()
    shard32 = torch.empty(numel // world, device=device)
    shard16 = torch.empty(numel // world, device=device, dtype=torch.bfloat16)
    quantize, dequantize = quant_ops_for(device)
    cases = {
        "nccl_allreduce_fp32": lambda: dist.all_reduce(work32),
        "nccl_allreduce_bf16": lambda: dist.all_reduce(work16),
        "nccl_reduce_scatter_fp32": lambda: dist.reduce_scatter_tensor(shard32, x32),
        "nccl_reduce_scatter_bf16": lambda: dist.reduce_scatter_tensor(shard16, x16),
        f"agoq_allreduce_{fmt}": lambda: allreduce_8bit(work32.copy_(x32), fmt=fmt),
        f"agoq_reduce_scatter_{fmt}": lambda: reduce_scatter_8bit(shard32, x32, fmt=fmt),
        f"agoq_quant_roundtrip_{fmt}": lambda: dequantize(quantize(x32, fmt), torch.float32),
        "copy_fp32": lambda: work32.copy_(x32),  # subtracted from the agoq all-reduce (it restores the input)
    }
    ms = {name: _median_ms(fn, device, warmup, iters) for name, fn in cases.items()}
    ar = ms[f"agoq_allreduce_{fmt}"] - ms["copy_fp32"]
    rs = ms[f"agoq_reduce_scatter_{fmt}"]
    return {
        "size_mib": size_mib, "numel": numel, "world_size": world, "format": fmt, "ms": ms,
        "agoq_allreduce_ms_net": ar,
        "speedup_vs_allreduce_fp32": ms["nccl_allreduce_fp32"] / ar,
        "speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ar,
        "rs_speedup_vs_reduce_scatter_fp32": ms["nccl_reduce_scatter_fp32"] / rs,
        "rs_speedup_vs_reduce_scatter_bf16": ms["nccl_reduce_scatter_bf16"] / rs,
        "wire_bytes_agoq_allreduce": wire_bytes(numel, world, fmt),
        "wire_bytes_nccl_allreduce_fp32": 2 * (world - 1) * numel * 4 // world,
        "link_model": link_model(numel, world, fmt, local_ms=ms[f"agoq_quant_roundtrip_{fmt}"]),
    }


def link_model(numel: int, world: int, fmt: str, local_ms: float) -> list[dict]:
    """Predicted speed-ups on a link of B GB/s per rank (bandwidth-bound ring collectives).

    agoq all-reduce ~ 2 local quantize+dequantize passes (measured round trip, counted twice: before
    the all-to-all and before the all-gather) + wire_bytes / B; NCCL ring all-reduce moves
    2 (W-1)/W * bytes per rank.
    """
    rows = []
    for gbps in LINK_GBPS:
        bw = gbps * 1e9 / 1e3  # bytes per ms
        agoq = 2 * local_ms + wire_bytes(numel, world, fmt) / bw
        fp32 = 2 * (world - 1) / world * numel * 4 / bw
        rows.append({"link_gbps": gbps, "pred_agoq_ms": agoq, "pred_speedup_vs_fp32": fp32 / agoq,
                     "pred_speedup_vs_bf16": fp32 / 2 / agoq})
    return rows


def run(rank: int, world: int, args) -> list[dict]:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return [bench_size(s, args.format, device, args.warmup, args.iters) for s in args.sizes_mib]


def _spawned(rank: int, world: int, args) -> list[dict]:
    return run(rank, world, args)


def summarize(rows: list[dict], check_targets: bool) -> list[str]:
    lines, failures = [], []
    for r in rows:
        lines.append(
            f"{r['size_mib']:>5} MiB  agoq AR {r['agoq_allreduce_ms_net']:8.3f} ms | fp32 AR "
            f"{r['ms']['nccl_allreduce_fp32']:8.3f} ({r['speedup_vs_allreduce_fp32']:.2f}x) | bf16 AR "
            f"{r['ms']['nccl_allreduce_bf16']:8.3f} ({r['speedup_vs_allreduce_bf16']:.2f}x) | RS vs fp32 RS "
            f"{r['rs_speedup_vs_reduce_scatter_fp32']:.2f}x, vs bf16 RS {r['rs_speedup_vs_reduce_scatter_bf16']:.2f}x"
        )
        if check_targets and r["size_mib"] >= TARGET_MIN_MIB:
            if r["speedup_vs_allreduce_fp32"] < TARGET_VS_FP32 or r["speedup_vs_allreduce_bf16"] < TARGET_VS_BF16:
                failures.append(r["size_mib"])
    if check_targets:
        lines.append("targets met" if not failures else f"TARGETS MISSED at sizes (MiB): {failures}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    p.add_argument("--format", default="int8_b256")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="write the JSON report here (rank 0)")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 self-spawned ranks, tiny sizes")
    args = p.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    args.sizes_mib = args.sizes_mib or (SMOKE_SIZES_MIB if args.smoke else DEFAULT_SIZES_MIB)
    if args.smoke:
        args.warmup, args.iters = 1, 3
        rows = spawn_ranks(2, _spawned, args=(args,))[0]
        rank, env = 0, "cpu/gloo x2 (smoke: semantics only, timings meaningless)"
    else:
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        rows = run(rank, dist.get_world_size(), args)
        env = f"{torch.cuda.get_device_name()} x{dist.get_world_size()} nccl"
        dist.destroy_process_group()
    if rank != 0:
        return
    for line in summarize(rows, check_targets=not args.smoke):
        print(line)
    if args.out:
        report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "env": env,
                  "torch": torch.__version__, "host": platform.node(), "rows": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
