"""Benchmark agoq's 8-bit gradient reduction against NCCL all-reduce / reduce-scatter (fp32, bf16).

For every gradient size (MiB of fp32 gradient; the bf16 cases move half the bytes) it times, per rank,
with CUDA events (median of --iters after --warmup, a barrier before each run; the slowest rank's
median is reported):

  nccl_allreduce_fp32 / _bf16          torch.distributed.all_reduce (in place)
  nccl_reduce_scatter_fp32 / _bf16     torch.distributed.reduce_scatter_tensor (distributed-optimizer layout)
  raw_int8_a2a_ag                      all_to_all of N bytes + all_gather of N/W bytes: the wire floor of
                                       any 8-bit all-reduce (issue 5's "ceiling")
  raw_int8_allgather                   one all_gather of N bytes per rank (W x N gathered): the floor of an
                                       all-gather-only 8-bit all-reduce (every rank sums every rank's codes).
                                       It sends (W - 1) x N bytes per rank, as many as a2a + ag only at W = 2.
                                       It is measured because on the socket link NCCL's all-to-all + all-gather
                                       reached only 1.45x its bf16 all-reduce at 160 MiB where the bytes say ~2x
                                       (grads_socket.json, 2026-11-26): one ring collective may use the link as
                                       the all-reduce does
  agoq_allreduce_fp32[_c<MiB>]         agoq.comm.allreduce_8bit on the fp32 gradient, in place, quantization
                                       included; one entry per --chunk-mib value (0 = auto)
  agoq_allreduce_bf16                  the same on a bf16 gradient (auto chunks)
  agoq_reduce_scatter_fp32             agoq.comm.reduce_scatter_8bit (owned fp32 shard, no all-gather)
  agoq_store_allreduce                 agoq.comm.allreduce_blocks_: 8-bit storage reduced in place (what
                                       --agoq-grads store does: no quantize / dequantize pass)
  agoq_store_allreduce_gather          agoq.comm.allreduce_blocks_gather_: the same storage reduced through one
                                       all-gather per chunk, every rank reducing every block (checked bit for bit
                                       against allreduce_blocks_ on every size)
  local_quant_roundtrip                quantize + dequantize of the whole fp32 gradient (no communication)
  agoq_peer_allreduce_fp32 / _bf16     agoq.comm.symm.allreduce_8bit_peer: the same reduction with NVLink peer
                                       memory as the transport instead of NCCL collectives (CUDA, --link default
                                       only); default algorithm (one-shot at 2 ranks, two-shot beyond)
  agoq_peer_twoshot_allreduce_fp32     the two-shot algorithm forced (at 2 ranks; bit-identical to allreduce_8bit)
  agoq_peer_reduce_scatter_fp32        agoq.comm.symm.reduce_scatter_8bit_peer (checked against reduce_scatter_8bit)
  agoq_peer_store_allreduce            agoq.comm.symm_store.SymmetricBlocks.allreduce_: the 8-bit store in peer
                                       memory reduced in place, what a training step runs with --agoq-grads and
                                       --agoq-grad-transport peer/auto (checked bit for bit against
                                       agoq_store_allreduce's allreduce_blocks_)
  agoq_peer_store_reduce_to_owners     SymmetricBlocks.reduce_to_owners requantizing in place (float_spans): the
                                       distributed optimizer's reduction of the store (vs NCCL's reduce-scatter)
  agoq_peer_store_reduce_to_owners_via_fp32  the same through an fp32 chunk and a separate quantize (the path
                                       before the in-place reduction; still taken for shared/touched blocks)

Issue 46 item 1, the fastest bf16 reductions the machine offers (allreduce_baselines.py says what each is, where
torch's API comes from, how each accumulates; CUDA, --link default; --baselines picks them, default both):

  symm_oneshot_allreduce_bf16 / symm_twoshot_allreduce_bf16 / symm_reduce_scatter_bf16   (--baselines symm)
                                       torch.ops.symm_mem one-shot / two-shot all-reduce and reduce-scatter on a
                                       bf16 symmetric-memory buffer
  nccl_window_allreduce_bf16 / nccl_window_reduce_scatter_bf16                              (--baselines window)
                                       NCCL on buffers registered as an NCCL window (its symmetric kernels)

A baseline that cannot be set up or raises is recorded in the row's ``baseline_errors`` (and printed), and the other
cases run on; each one's result is checked against the fp32 all-reduce of the same bf16 inputs (``baseline_check``,
relative L2 error < 1 %, all-reduce results identical on every rank). A failed baseline does not fail the run (the
exit status is agoq's correctness); the summary step (allreduce_best.py) leaves failed baselines out of the best.
--baseline-only times only NCCL's bf16 all-reduce / reduce-scatter (--collectives) and the --baselines cases, every
one guarded: the NCCL_ALGO / NCCL_PROTO sweep (nccl_sweep.py) launches it once per setting.

Bus bandwidth (nccl-tests' convention; bytes = the collective's full input, an all-gather's full output): busbw =
bytes / time x 2 (W-1)/W for an all-reduce, x (W-1)/W for a reduce-scatter or all-gather; ``busbw_gbps`` (from ms)
and ``device_busbw_gbps`` (from device_ms) for every NCCL, symmetric-memory and window case and the raw all-gather,
and ``link_fraction`` / ``device_link_fraction``: each over the link's measured peak (the report's ``link_peak``: a
copy-engine copy from a peer GPU's symmetric-memory buffer, one direction, once per run).

Two timings per case (--timing both, the default on GPUs). ``ms``: one call from an idle GPU, so the host's enqueue
time (Python, launches) is part of it, as when a reduction is issued with nothing queued ahead of it. ``device_ms``:
the same call with a GPU sleep and a one-element all-reduce (which lines the ranks' GPUs up) enqueued before the
start event, the sleep long enough for the host to finish enqueuing first (checked per run, ``device_clean``): the
call's own GPU time, with nothing else on the GPU. Megatron issues a bucket's reduction during backward with the
GPU still busy, so there the host's enqueue is hidden as here, but the reduction shares the SMs and memory with
backward, which this does not measure (the whole-step suites do). ``host_enqueue_ms`` is the host's side.
Both are reported; the targets are judged on each.

Correctness, on every size: all ranks hold bit-identical agoq all-reduce results, and the relative L2
error vs the fp32 NCCL all-reduce is below MAX_REL_ERR. At sizes <= --exact-check-mib every rank also
rebuilds all ranks' inputs (seeded) and checks the fused GPU path bit for bit against the plain-PyTorch
reference (agoq.ref.collectives) for the all-reduce and the reduce-scatter. A failed check is reported
in the JSON and makes the script exit non-zero (after writing it).

Targets (issues 5, 19), for the faster agoq transport: >= 2.5x vs NCCL's fp32 all-reduce and >= 1.3x vs its bf16
one at >= 256 MiB; >= 2x and >= 1.1x at 64-256 MiB (Megatron's 40M-element bucket is 160 MiB). A link
model (docs/benchmarks/log.md, 'Link model') predicts the speed-up on slower links:
t(agoq) ~ 2 t_roundtrip + wire_bytes / B.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py --out $OUT/grads.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py --baseline-only --baselines \\
        --collectives allreduce --out $OUT/ar.json     # NCCL's bf16 all-reduce alone (under NCCL_ALGO=...)
    python benchmarks/bench_allreduce.py --smoke            # CPU, 2 gloo ranks, tiny sizes, no targets
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# NVLink multicast stays off (the GPU machines' rule; agoq's peer reduction uses point-to-point signal pads only).
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # allreduce_baselines.py beside this script (not a package)

from allreduce_baselines import (  # noqa: E402
    ALLREDUCE,
    BASELINE_ACCUMULATION,
    COLLECTIVES,
    EXTRA_KINDS,
    REDUCE_SCATTER,
    ExtraBaselines,
    StallWatchdog,
    add_bus_bandwidth,
    check_result,
    measure_link_peak,
    record_failure,
    time_cases,
)

from agoq.comm.reduce import (  # noqa: E402
    allreduce_8bit,
    allreduce_blocks_,
    allreduce_blocks_gather_,
    quant_ops_for,
    reduce_scatter_8bit,
    wire_bytes,
)
from agoq.formats import parse_format  # noqa: E402
from agoq.ref.collectives import ref_allreduce_8bit, ref_reduce_scatter_8bit  # noqa: E402
from agoq.testing.dist import spawn_ranks  # noqa: E402
from agoq.testing.procs import source_commit  # noqa: E402

DEFAULT_SIZES_MIB = [16, 64, 256, 1024]
SMOKE_SIZES_MIB = [1]
DEFAULT_CHUNK_MIB = [0, 8, 32, 1024]  # 0 = auto (agoq.comm.pipeline.chunk_bytes_for); 1024 = one chunk
# --link socket: NCCL over TCP sockets between the local GPUs (no NVLink/PCIe peer access, no shared
# memory, no InfiniBand): a stand-in for an inter-node Ethernet link (issue 19, item 3). The report
# labels it and records the bus bandwidth NCCL's fp32 all-reduce reaches on it.
SOCKET_LINK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}
# (smallest size MiB, x NCCL fp32 all-reduce, x NCCL bf16 all-reduce): issue 19's targets on NVLink
TARGETS = [(256, 2.5, 1.3), (64, 2.0, 1.1)]
LINK_GBPS = [25, 50, 100, 200, 400]  # inter-node (IB/RoCE 200-400 Gb/s = 25-50 GB/s) up to NVLink-class
# int8_b256 all-reduce of N(0,1) gradients: ~1 % relative L2 error (docs/numerics.md, W = 2..8); 2 % flags
# a broken path (a lost scale or a wrong shard gives O(100 %)) without flaking on a correct one.
MAX_REL_ERR = 0.02
# Device time (--timing both): torch.cuda._sleep keeps the GPU busy while the host enqueues a case. The sleep is
# the case's host enqueue time (measured by the latency runs) times DEVICE_SLEEP_FACTOR plus DEVICE_SLEEP_MARGIN_MS,
# so that the host finishes first (checked per run: a run where it did not is reported as not clean).
CALIBRATION_CYCLES = 10_000_000  # ~5 ms at H100 clocks: long enough that launch jitter is < 1 % of the calibration
DEVICE_SLEEP_FACTOR = 2.0
DEVICE_SLEEP_MARGIN_MS = 0.3
WARMUP_SLEEP_MS = 20.0  # the warm-up runs' sleep: above any case's host enqueue time seen (NCCL-transport routes ~2 ms)


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


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep on this device (calibrated once per run)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(CALIBRATION_CYCLES)  # first call: warm the launch
    start.record()
    torch.cuda._sleep(CALIBRATION_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return CALIBRATION_CYCLES / start.elapsed_time(end)


def _device_run(fn, sleep_cycles: int, align: torch.Tensor) -> tuple[float, float, bool]:
    """(device ms, host enqueue ms, clean) of one run with the host's enqueue hidden behind a GPU sleep: the events
    around ``fn`` time only the GPU's work when the host finished enqueuing before the sleep ended (``clean``;
    a case that waits on the host inside, e.g. a host synchronisation, shows as not clean). A one-element NCCL
    all-reduce after the sleep lines the ranks' GPUs up, so that the time does not include how much later one
    rank's GPU started than another's (the first run at 2 x H100, without it, read 0.081-0.090 ms for the store's
    reduce-to-owners at 16, 64 and 160 MiB alike, which a skew between the ranks' starts would explain)."""
    slept, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter()
    slept.record()
    torch.cuda._sleep(sleep_cycles)
    dist.all_reduce(align)
    start.record()
    t1 = time.perf_counter()
    fn()
    host_done = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), (host_done - t1) * 1e3, (host_done - t0) * 1e3 < slept.elapsed_time(start)


def _median_device_ms(fn, warmup: int, iters: int, cycles_per_ms: float) -> tuple[float, float, bool]:
    """Device-time median (the slowest rank's), host enqueue median (the slowest rank's), every run clean on
    every rank. The warm-up runs sleep WARMUP_SLEEP_MS and measure the host's enqueue time, which sizes the sleep
    of the timed runs (the same on every rank: the slowest host's)."""
    host, align = [], torch.zeros(1, device="cuda")
    for _ in range(max(1, warmup)):
        dist.barrier()
        host.append(_device_run(fn, int(WARMUP_SLEEP_MS * cycles_per_ms), align)[1])
    t = torch.tensor([max(host)], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    sleep_cycles = int((DEVICE_SLEEP_FACTOR * float(t) + DEVICE_SLEEP_MARGIN_MS) * cycles_per_ms)
    runs = []
    for _ in range(iters):
        dist.barrier()
        runs.append(_device_run(fn, sleep_cycles, align))
    t = torch.tensor([statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                      float(not all(r[2] for r in runs))], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1]), not bool(t[2])


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


def _inputs(numel: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    return torch.randn(numel, generator=g).to(device)


def _same_on_all_ranks(x: torch.Tensor) -> bool:
    """Bitwise identity across ranks via a position-weighted checksum of the raw bits (int64, exact)."""
    bits = x.view(torch.int32 if x.element_size() == 4 else torch.int16).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, device=x.device, dtype=torch.int64) % 65521
    s = torch.stack([(bits * weights).sum(), bits.sum()])
    lo, hi = s.clone(), s.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def check_size(numel: int, fmt: str, device, exact: bool) -> dict:
    """Correctness of the agoq paths at this size (see module docstring)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = _inputs(numel, rank, device)
    exact_sum = x.clone()
    dist.all_reduce(exact_sum)
    ar = x.clone()
    allreduce_8bit(ar, fmt=fmt)
    rel = float((ar - exact_sum).norm() / exact_sum.norm())
    out = {"rel_l2_err_vs_fp32": rel, "ranks_identical": _same_on_all_ranks(ar)}
    out["ok"] = out["ranks_identical"] and rel < MAX_REL_ERR
    if exact:
        everyone = [_inputs(numel, r, device) for r in range(world)]
        out["bitwise_vs_reference_allreduce"] = torch.equal(ar, ref_allreduce_8bit(everyone, fmt)[0])
        shard = torch.empty(numel // world, device=device)
        reduce_scatter_8bit(shard, x, fmt=fmt)
        out["bitwise_vs_reference_reduce_scatter"] = torch.equal(shard, ref_reduce_scatter_8bit(everyone, fmt)[rank])
        out["ok"] = out["ok"] and out["bitwise_vs_reference_allreduce"] and out["bitwise_vs_reference_reduce_scatter"]
    q = quant_ops_for(device)[0](x, fmt)  # the 8-bit storage: both routes must store the same bits
    owner_route, gather_route = (q.codes.clone(), q.scales.clone()), (q.codes.clone(), q.scales.clone())
    allreduce_blocks_(*owner_route, fmt, average=True)
    allreduce_blocks_gather_(*gather_route, fmt, average=True)
    out["store_gather_bitwise_vs_allreduce_blocks"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                                          for a, b in zip(owner_route, gather_route, strict=True))
    out["ok"] = out["ok"] and out["store_gather_bitwise_vs_allreduce_blocks"]
    return out


def gradient_numel(size_mib: int, world: int, fmt: str) -> int:
    """Elements of a ``size_mib`` MiB fp32 gradient, rounded down to whole blocks on every rank."""
    numel = size_mib * (1 << 20) // 4
    return numel - numel % (world * parse_format(fmt).block)


def check_baselines(x16: torch.Tensor, extras: ExtraBaselines | None, errors: dict,
                    collectives: tuple[str, ...], watchdog: StallWatchdog) -> dict:
    """NCCL's bf16 all-reduce / reduce-scatter and the extra baselines on ``x16``, each against the fp32 all-reduce of
    the same bf16 inputs (allreduce_baselines.check_result); a case that raises is recorded in ``errors``."""
    exact = x16.float()
    dist.all_reduce(exact)
    world, out = dist.get_world_size(), {}
    nccl = {}
    if ALLREDUCE in collectives:
        nccl["nccl_allreduce_bf16"] = (lambda y: (dist.all_reduce(y), y)[1], x16.clone(), True)
    if REDUCE_SCATTER in collectives:
        shard = torch.empty(x16.numel() // world, dtype=x16.dtype, device=x16.device)
        nccl["nccl_reduce_scatter_bf16"] = (lambda y: (dist.reduce_scatter_tensor(shard, y), shard)[1], x16, False)
    for case, (fn, arg, full) in nccl.items():
        if case in errors:
            continue
        try:
            with watchdog.case(case):
                out[case] = check_result(fn(arg), exact, full)
        except Exception as err:
            record_failure(errors, case, err)
    if extras is not None:
        out.update(extras.check(x16, exact, errors, watchdog))
    return out


def _guarded_timings(cases: dict, guarded: set, fresh, device, args) -> dict:
    device_timer = None
    if args.cycles_per_ms:
        def device_timer(fn):
            return _median_device_ms(fn, args.warmup, args.iters, args.cycles_per_ms)
    return time_cases(cases, guarded, fresh, lambda fn: _median_ms(fn, device, args.warmup, args.iters),
                      device_timer, args.watchdog)


def bench_baselines(size_mib: int, device: torch.device, args) -> dict:
    """--baseline-only: NCCL's bf16 all-reduce / reduce-scatter (--collectives) and the --baselines cases, every
    case guarded (an NCCL_ALGO / NCCL_PROTO that NCCL refuses is recorded, not raised)."""
    world = dist.get_world_size()
    numel = gradient_numel(size_mib, world, args.format)
    x16 = _inputs(numel, dist.get_rank(), device).to(torch.bfloat16)
    shard16 = torch.empty(numel // world, device=device, dtype=torch.bfloat16)
    work = {}
    cases = {}
    if ALLREDUCE in args.collectives:
        cases["nccl_allreduce_bf16"] = lambda: dist.all_reduce(work["bf16"])
    if REDUCE_SCATTER in args.collectives:
        cases["nccl_reduce_scatter_bf16"] = lambda: dist.reduce_scatter_tensor(shard16, x16)
    extras = args.extras
    if extras is not None:
        cases.update(extras.cases(numel))

    def fresh() -> None:
        work["bf16"] = x16.clone()
        if extras is not None:
            extras.load(x16)

    timed = _guarded_timings(cases, set(cases), fresh, device, args)
    work.clear()
    errors = {**(extras.not_run() if extras is not None else {}), **timed["errors"]}
    row = {"size_mib": size_mib, "numel": numel, "world_size": world, "baseline_only": True,
           "collectives": list(args.collectives), "ms": timed["ms"]}
    if timed["device_ms"]:
        row.update(device_ms=timed["device_ms"], host_enqueue_ms=timed["host_enqueue_ms"],
                   device_clean=timed["device_clean"])
    row["baseline_check"] = check_baselines(x16, extras, errors, args.collectives, args.watchdog)
    row["baseline_errors"] = errors
    return row


def bench_size(size_mib: int, fmt: str, device: torch.device, args) -> dict:
    if args.baseline_only:
        return bench_baselines(size_mib, device, args)
    world = dist.get_world_size()
    qfmt = parse_format(fmt)
    numel = gradient_numel(size_mib, world, fmt)
    x32 = _inputs(numel, dist.get_rank(), device)
    x16 = x32.to(torch.bfloat16)
    shard32 = torch.empty(numel // world, device=device)
    shard16 = torch.empty(numel // world, device=device, dtype=torch.bfloat16)
    q = quant_ops_for(device)[0](x32, fmt)  # 8-bit storage of the gradient (blocks: a multiple of W)
    codes0, scales0 = q.codes, q.scales  # pristine: every case starts from them (the store cases reduce in place)
    codes, scales = codes0.clone(), scales0.clone()
    raw_send = torch.empty(numel, dtype=torch.uint8, device=device)
    raw_recv, raw_own = torch.empty_like(raw_send), torch.empty(numel // world, dtype=torch.uint8, device=device)
    raw_gathered = torch.empty(world * numel, dtype=torch.uint8, device=device)
    quantize, dequantize = quant_ops_for(device)
    work = {}  # fresh copies per case: in-place all-reduces grow the values (timing is value-blind)
    cases = {
        "nccl_allreduce_fp32": lambda: dist.all_reduce(work["fp32"]),
        "nccl_allreduce_bf16": lambda: dist.all_reduce(work["bf16"]),
        "nccl_reduce_scatter_fp32": lambda: dist.reduce_scatter_tensor(shard32, x32),
        "nccl_reduce_scatter_bf16": lambda: dist.reduce_scatter_tensor(shard16, x16),
        "raw_int8_a2a_ag": lambda: (dist.all_to_all_single(raw_recv, raw_send),
                                    dist.all_gather_into_tensor(raw_send, raw_own)),
        "raw_int8_allgather": lambda: dist.all_gather_into_tensor(raw_gathered, raw_send),
        "agoq_allreduce_bf16": lambda: allreduce_8bit(work["bf16"], fmt=fmt),
        "agoq_reduce_scatter_fp32": lambda: reduce_scatter_8bit(shard32, x32, fmt=fmt),
        "agoq_store_allreduce": lambda: allreduce_blocks_(codes, scales, fmt),
        "agoq_store_allreduce_gather": lambda: allreduce_blocks_gather_(codes, scales, fmt),
        "local_quant_roundtrip": lambda: dequantize(quantize(x32, fmt), torch.float32),
    }
    if args.peer:
        from agoq.comm.symm import allreduce_8bit_peer, reduce_scatter_8bit_peer

        cases["agoq_peer_allreduce_fp32"] = lambda: allreduce_8bit_peer(work["fp32"], fmt=fmt)
        cases["agoq_peer_allreduce_bf16"] = lambda: allreduce_8bit_peer(work["bf16"], fmt=fmt)
        cases["agoq_peer_reduce_scatter_fp32"] = lambda: reduce_scatter_8bit_peer(shard32, x32, fmt=fmt)
        if world == 2:
            cases["agoq_peer_twoshot_allreduce_fp32"] = lambda: allreduce_8bit_peer(work["fp32"], fmt=fmt,
                                                                                    one_shot=False)
        from agoq.comm.symm_store import SymmetricBlocks

        peer_store = SymmetricBlocks(dist.group.WORLD, fmt, scales.numel(), device)
        per = scales.numel() // world
        owners = [(r * per, (r + 1) * per) for r in range(world)]
        chunk_blocks = max(1, (16 << 20) // (world * qfmt.block))  # the training path's auto chunk floor
        cases["agoq_peer_store_allreduce"] = lambda: peer_store.allreduce_(average=False, post_scale=1.0)
        # what a training step runs: the reduce kernel requantizes the owned blocks into the store in place
        # (average: repeated timing calls keep the stored values bounded)
        cases["agoq_peer_store_reduce_to_owners"] = lambda: peer_store.reduce_to_owners(
            owners, None, average=True, post_scale=1.0, chunk_blocks=chunk_blocks, float_spans=[])
        cases["agoq_peer_store_reduce_to_owners_via_fp32"] = lambda: peer_store.reduce_to_owners(
            owners, lambda b, v: quantize(v, fmt), average=False, post_scale=1.0, chunk_blocks=chunk_blocks)
    for mib in args.chunk_mib:
        name = "agoq_allreduce_fp32" + (f"_c{mib}" if mib else "")
        chunk = mib << 20 if mib else None
        cases[name] = (lambda c: lambda: allreduce_8bit(work["fp32"], fmt=fmt, chunk_bytes=c))(chunk)
    extras = args.extras
    extra_cases = extras.cases(numel) if extras is not None else {}
    cases.update(extra_cases)

    def fresh_inputs() -> None:
        """Every case starts from the same gradient: the in-place reductions grow the values (every stored scale
        x W per call without averaging: at W = 4 the fp32 scales overflowed within a case's 100 calls)."""
        work.update(fp32=x32.clone(), bf16=x16.clone())
        codes.copy_(codes0)
        scales.copy_(scales0)
        if args.peer:
            peer_store.codes_u8.copy_(codes0)
            peer_store.scales.copy_(scales0)
        if extras is not None:
            extras.load(x16)

    timed = _guarded_timings(cases, set(extra_cases), fresh_inputs, device, args)  # only the extra baselines guarded
    ms, device_ms, host_ms, clean = timed["ms"], timed["device_ms"], timed["host_enqueue_ms"], timed["device_clean"]
    work.clear()
    agoq_names = [n for n in ms if n.startswith("agoq_allreduce_fp32")]
    best = min(agoq_names, key=lambda n: ms[n])
    auto = "agoq_allreduce_fp32" if "agoq_allreduce_fp32" in ms else best
    row = {
        "size_mib": size_mib, "numel": numel, "world_size": world, "format": fmt, "ms": ms,
        "agoq_allreduce_best": best,
        "speedup_vs_allreduce_fp32": ms["nccl_allreduce_fp32"] / ms[auto],
        "speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms[auto],
        "best_speedup_vs_allreduce_fp32": ms["nccl_allreduce_fp32"] / ms[best],
        "best_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms[best],
        "store_speedup_vs_allreduce_fp32": ms["nccl_allreduce_fp32"] / ms["agoq_store_allreduce"],
        "store_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms["agoq_store_allreduce"],
        "store_gather_speedup_vs_allreduce_fp32": ms["nccl_allreduce_fp32"] / ms["agoq_store_allreduce_gather"],
        "store_gather_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms["agoq_store_allreduce_gather"],
        "agoq_vs_raw_int8_floor": ms[auto] / ms["raw_int8_a2a_ag"],
        "raw_floor_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms["raw_int8_a2a_ag"],
        "raw_allgather_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms["raw_int8_allgather"],
        "rs_speedup_vs_reduce_scatter_fp32": ms["nccl_reduce_scatter_fp32"] / ms["agoq_reduce_scatter_fp32"],
        "rs_speedup_vs_reduce_scatter_bf16": ms["nccl_reduce_scatter_bf16"] / ms["agoq_reduce_scatter_fp32"],
        "wire_bytes_agoq_allreduce": wire_bytes(numel, world, fmt),
        "wire_bytes_nccl_allreduce_fp32": 2 * (world - 1) * numel * 4 // world,
        "link_model": link_model(numel, world, fmt, local_ms=ms["local_quant_roundtrip"]),
        "check": check_size(numel, fmt, device, exact=size_mib <= args.exact_check_mib),
    }
    baseline_errors = {**(extras.not_run() if extras is not None else {}), **timed["errors"]}
    row["baseline_check"] = check_baselines(x16, extras, baseline_errors, COLLECTIVES, args.watchdog)
    row["baseline_errors"] = baseline_errors
    if device_ms:
        row.update(device_ms=device_ms, host_enqueue_ms=host_ms, device_clean=clean,
                   device_speedups=device_speedups(device_ms))
    if args.peer:
        row.update({
            "peer_speedup_vs_allreduce_fp32": ms["nccl_allreduce_fp32"] / ms["agoq_peer_allreduce_fp32"],
            "peer_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms["agoq_peer_allreduce_fp32"],
            "peer_bf16_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms["agoq_peer_allreduce_bf16"],
            "peer_twoshot_speedup_vs_allreduce_fp32":
                ms["nccl_allreduce_fp32"] / ms.get("agoq_peer_twoshot_allreduce_fp32", ms["agoq_peer_allreduce_fp32"]),
            "peer_rs_speedup_vs_reduce_scatter_fp32":
                ms["nccl_reduce_scatter_fp32"] / ms["agoq_peer_reduce_scatter_fp32"],
            "peer_rs_speedup_vs_reduce_scatter_bf16":
                ms["nccl_reduce_scatter_bf16"] / ms["agoq_peer_reduce_scatter_fp32"],
            "peer_store_speedup_vs_allreduce_fp32": ms["nccl_allreduce_fp32"] / ms["agoq_peer_store_allreduce"],
            "peer_store_speedup_vs_allreduce_bf16": ms["nccl_allreduce_bf16"] / ms["agoq_peer_store_allreduce"],
            "peer_store_owners_speedup_vs_reduce_scatter_fp32":
                ms["nccl_reduce_scatter_fp32"] / ms["agoq_peer_store_reduce_to_owners"],
            "peer_store_owners_speedup_vs_reduce_scatter_bf16":
                ms["nccl_reduce_scatter_bf16"] / ms["agoq_peer_store_reduce_to_owners"],
        })
        row["check"].update(check_peer(numel, fmt, device))
        store_ok = _peer_store_equal(peer_store, codes0, scales0, fmt)
        row["check"]["peer_store_allreduce_bitwise_vs_nccl_transport"] = store_ok
        row["check"]["peer_ok"] = row["check"]["peer_ok"] and store_ok
        del peer_store
        row["check"]["ok"] = row["check"]["ok"] and row["check"]["peer_ok"]
    return row


# (name, agoq case, NCCL case): the ratios reported on device time (NCCL time / agoq time)
DEVICE_RATIOS = [
    ("store_ar_vs_allreduce_fp32", "agoq_peer_store_allreduce", "nccl_allreduce_fp32"),
    ("store_ar_vs_allreduce_bf16", "agoq_peer_store_allreduce", "nccl_allreduce_bf16"),
    ("store_owners_vs_reduce_scatter_fp32", "agoq_peer_store_reduce_to_owners", "nccl_reduce_scatter_fp32"),
    ("store_owners_vs_reduce_scatter_bf16", "agoq_peer_store_reduce_to_owners", "nccl_reduce_scatter_bf16"),
    ("fp32_input_ar_vs_allreduce_fp32", "agoq_peer_allreduce_fp32", "nccl_allreduce_fp32"),
    ("fp32_input_ar_vs_allreduce_bf16", "agoq_peer_allreduce_fp32", "nccl_allreduce_bf16"),
    ("peer_rs_vs_reduce_scatter_fp32", "agoq_peer_reduce_scatter_fp32", "nccl_reduce_scatter_fp32"),
    ("peer_rs_vs_reduce_scatter_bf16", "agoq_peer_reduce_scatter_fp32", "nccl_reduce_scatter_bf16"),
    ("store_gather_vs_allreduce_bf16", "agoq_store_allreduce_gather", "nccl_allreduce_bf16"),
    # issue 46: against the faster bf16 baselines (allreduce_baselines.py), where they ran
    ("store_ar_vs_symm_oneshot_bf16", "agoq_peer_store_allreduce", "symm_oneshot_allreduce_bf16"),
    ("store_ar_vs_symm_twoshot_bf16", "agoq_peer_store_allreduce", "symm_twoshot_allreduce_bf16"),
    ("store_ar_vs_nccl_window_bf16", "agoq_peer_store_allreduce", "nccl_window_allreduce_bf16"),
    ("store_owners_vs_symm_reduce_scatter_bf16", "agoq_peer_store_reduce_to_owners", "symm_reduce_scatter_bf16"),
    ("store_owners_vs_nccl_window_reduce_scatter_bf16", "agoq_peer_store_reduce_to_owners",
     "nccl_window_reduce_scatter_bf16"),
]


def device_speedups(device_ms: dict) -> dict:
    """NCCL device time / agoq device time for each of DEVICE_RATIOS whose two cases ran."""
    return {name: device_ms[ref] / device_ms[case] for name, case, ref in DEVICE_RATIOS
            if case in device_ms and ref in device_ms}


def _peer_store_equal(peer_store, codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> bool:
    """The peer store's in-place all-reduce = allreduce_blocks_ (the NCCL transport) bit for bit, on every rank."""
    ref_c, ref_s = codes.clone(), scales.clone()
    allreduce_blocks_(ref_c, ref_s, fmt)
    peer_store.codes_u8.copy_(codes)
    peer_store.scales.copy_(scales)
    peer_store.allreduce_(average=False, post_scale=1.0)
    ok = torch.tensor(float(torch.equal(peer_store.codes_u8, ref_c)
                            and torch.equal(peer_store.scales.view(torch.uint8), ref_s.view(torch.uint8))),
                      device=codes.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def check_peer(numel: int, fmt: str, device) -> dict:
    """The peer transport's results, bit for bit: two-shot all-reduce = allreduce_8bit (NCCL transport),
    reduce-scatter = reduce_scatter_8bit, one-shot all-reduce = every rank's reduce_scatter_8bit shard
    all-gathered (fp32 sums, no second quantization); identical on every rank; error vs the fp32 sum."""
    from agoq.comm.symm import allreduce_8bit_peer, reduce_scatter_8bit_peer

    world = dist.get_world_size()
    x = _inputs(numel, dist.get_rank(), device)
    exact_sum = x.clone()
    dist.all_reduce(exact_sum)
    a, two, one = x.clone(), x.clone(), x.clone()
    allreduce_8bit(a, fmt=fmt)
    allreduce_8bit_peer(two, fmt=fmt, one_shot=False)
    allreduce_8bit_peer(one, fmt=fmt, one_shot=True)
    sa, sb = torch.empty(numel // world, device=device), torch.full((numel // world,), 7.0, device=device)
    reduce_scatter_8bit(sa, x, fmt=fmt)
    reduce_scatter_8bit_peer(sb, x, fmt=fmt)
    gathered = torch.empty(numel, device=device)
    dist.all_gather_into_tensor(gathered, sa)
    out = {"peer_twoshot_allreduce_bitwise_vs_nccl_transport": torch.equal(a, two),
           "peer_oneshot_allreduce_bitwise_vs_gathered_reduce_scatter": torch.equal(one, gathered),
           "peer_reduce_scatter_bitwise_vs_nccl_transport": torch.equal(sa, sb),
           "peer_ranks_identical": _same_on_all_ranks(one) and _same_on_all_ranks(two)}
    rel = {"peer_oneshot_rel_l2_err_vs_fp32": float((one - exact_sum).norm() / exact_sum.norm()),
           "peer_twoshot_rel_l2_err_vs_fp32": float((two - exact_sum).norm() / exact_sum.norm())}
    flags = torch.tensor([all(out.values()) and max(rel.values()) < MAX_REL_ERR], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    out.update(rel)
    out["peer_ok"] = bool(flags.item())
    return out


def link_model(numel: int, world: int, fmt: str, local_ms: float) -> list[dict]:
    """Predicted speed-ups on a link of B GB/s per rank (bandwidth-bound ring collectives).

    agoq all-reduce ~ 2 local quantize+dequantize passes (measured round trip, counted twice: before the
    all-to-all and before the all-gather; an upper bound, as the pipeline overlaps them with the wire) +
    wire_bytes / B; NCCL ring all-reduce moves 2 (W-1)/W * bytes per rank.
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
    args.cycles_per_ms = _sleep_cycles_per_ms(device) if device.type == "cuda" and args.timing == "both" else 0.0
    group, keep = dist.group.WORLD, []
    args.link_peak = None
    if device.type == "cuda" and args.link == "default":
        try:
            args.link_peak = measure_link_peak(group, device, keep)
        except Exception as err:
            args.link_peak = {}
            record_failure(args.link_peak, "error", err)
    max_numel = max(gradient_numel(s, world, args.format) for s in args.sizes_mib)
    args.extras = ExtraBaselines(args.baselines, group, max_numel, device,
                                 tuple(args.collectives)) if args.baselines else None
    try:
        rows = [bench_size(s, args.format, device, args) for s in args.sizes_mib]
    finally:
        if args.extras is not None:
            args.extras.close()
    peak = (args.link_peak or {}).get("link_peak_gbps")
    for row in rows:
        add_bus_bandwidth(row, peak)
        if args.extras is not None and args.extras.setup_errors:
            row["baseline_setup_errors"] = dict(args.extras.setup_errors)
    args.extras = None
    return rows


def _spawned(rank: int, world: int, args) -> list[dict]:
    return run(rank, world, args)


def baseline_lines(r: dict) -> list[str]:
    """The bf16 baselines of a row (issue 46): device time (else single-call) ms, bus bandwidth and its fraction of
    the link's peak; failed baselines and failed checks by name."""
    timing = "device_ms" if r.get("device_ms") else "ms"
    bw = r.get("device_busbw_gbps" if timing == "device_ms" else "busbw_gbps", {})
    frac = r.get("device_link_fraction" if timing == "device_ms" else "link_fraction", {})
    parts = []
    for case, t in r.get(timing, {}).items():
        if case in bw and (case.endswith("_bf16") or r.get("baseline_only")):
            parts.append(f"{case} {t:.3f} ms {bw[case]:.0f} GB/s" + (f" ({frac[case]:.0%} of link)" if case in frac
                                                                      else ""))
    lines = [f"      bf16 baselines ({timing}): " + ", ".join(parts)] if parts else []
    failed = sorted(c for c, chk in r.get("baseline_check", {}).items() if not chk["ok"])
    if failed:
        lines.append(f"      BASELINE CHECK FAILED (left out of the best): {failed}")
    for case, err in r.get("baseline_errors", {}).items():
        lines.append(f"      BASELINE FAILED {case}: {err}")
    return lines


def summarize(rows: list[dict], check_targets: bool) -> tuple[list[str], bool]:
    lines, ok = [], True
    for r in rows:
        if r.get("baseline_only"):
            lines.append(f"{r['size_mib']:>5} MiB | baseline only ({', '.join(r['collectives'])})")
            lines.extend(baseline_lines(r))
            continue
        ms = r["ms"]
        auto = ms["agoq_allreduce_fp32"] if "agoq_allreduce_fp32" in ms else ms[r["agoq_allreduce_best"]]
        lines.append(
            f"{r['size_mib']:>5} MiB | NCCL AR fp32 {ms['nccl_allreduce_fp32']:7.3f} ms, bf16 "
            f"{ms['nccl_allreduce_bf16']:7.3f} | raw int8 a2a+ag {ms['raw_int8_a2a_ag']:7.3f}"
            f" | agoq AR {auto:7.3f} ({r['speedup_vs_allreduce_fp32']:.2f}x fp32, "
            f"{r['speedup_vs_allreduce_bf16']:.2f}x bf16)"
            f" | best {r['agoq_allreduce_best']} {r['best_speedup_vs_allreduce_fp32']:.2f}x / "
            f"{r['best_speedup_vs_allreduce_bf16']:.2f}x"
            f" | store AR {ms['agoq_store_allreduce']:7.3f} ({r['store_speedup_vs_allreduce_fp32']:.2f}x / "
            f"{r['store_speedup_vs_allreduce_bf16']:.2f}x) | RS {r['rs_speedup_vs_reduce_scatter_fp32']:.2f}x fp32 RS"
            f" | check {'ok' if r['check']['ok'] else 'FAILED'} (rel err {r['check']['rel_l2_err_vs_fp32']:.4f})"
        )
        ok = ok and r["check"]["ok"]
        if "peer_speedup_vs_allreduce_fp32" in r:
            peer_ar, peer_rs = ms["agoq_peer_allreduce_fp32"], ms["agoq_peer_reduce_scatter_fp32"]
            lines.append(
                f"      peer AR {peer_ar:7.3f} ms ({r['peer_speedup_vs_allreduce_fp32']:.2f}x fp32, "
                f"{r['peer_speedup_vs_allreduce_bf16']:.2f}x bf16) | peer AR of bf16 "
                f"{r['peer_bf16_speedup_vs_allreduce_bf16']:.2f}x bf16 | peer RS {peer_rs:7.3f} ms "
                f"({r['peer_rs_speedup_vs_reduce_scatter_fp32']:.2f}x fp32 RS, "
                f"{r['peer_rs_speedup_vs_reduce_scatter_bf16']:.2f}x bf16 RS)")
            lines.append(
                f"      peer 8-bit store AR {ms['agoq_peer_store_allreduce']:7.3f} ms "
                f"({r['peer_store_speedup_vs_allreduce_fp32']:.2f}x fp32, "
                f"{r['peer_store_speedup_vs_allreduce_bf16']:.2f}x bf16 AR) | "
                f"to owners {ms['agoq_peer_store_reduce_to_owners']:7.3f} ms "
                f"({r['peer_store_owners_speedup_vs_reduce_scatter_fp32']:.2f}x fp32, "
                f"{r['peer_store_owners_speedup_vs_reduce_scatter_bf16']:.2f}x bf16 RS)")
        if "agoq_peer_store_allreduce" in r.get("device_ms", {}):
            dev, sp = r["device_ms"], r["device_speedups"]
            unclean = sorted(n for n, ok in r["device_clean"].items() if not ok)
            lines.append("      device time: " + ", ".join(f"{n} {v:.2f}x" for n, v in sp.items())
                         + f" | store AR {dev.get('agoq_peer_store_allreduce', float('nan')):7.3f} ms, to owners "
                         f"{dev.get('agoq_peer_store_reduce_to_owners', float('nan')):7.3f} ms"
                         + (f" | NOT CLEAN (host still enqueuing): {unclean}" if unclean else ""))
        lines.extend(baseline_lines(r))
    if check_targets and not all(r.get("baseline_only") for r in rows):
        lines.append(target_line(rows))
        if any("device_speedups" in r for r in rows):
            lines.append(device_target_line(rows))
    lines.append("correctness checks passed" if ok else "CORRECTNESS CHECK FAILED")
    return lines, ok


def target_line(rows: list[dict]) -> str:
    """Which sizes meet issue 19's targets (TARGETS), with the faster agoq transport of each size."""
    missed, judged = [], 0
    for r in rows:
        tgt = next(((f, b) for lo, f, b in TARGETS if r["size_mib"] >= lo), None)
        if tgt is None:
            continue
        judged += 1
        fp32 = max(r["speedup_vs_allreduce_fp32"], r.get("peer_speedup_vs_allreduce_fp32", 0.0))
        bf16 = max(r["speedup_vs_allreduce_bf16"], r.get("peer_speedup_vs_allreduce_bf16", 0.0))
        if fp32 < tgt[0] or bf16 < tgt[1]:
            missed.append(r["size_mib"])
    return "targets met" if judged and not missed else f"targets missed at sizes (MiB): {missed}"


def device_target_line(rows: list[dict]) -> str:
    """Issue 19's NVLink targets on device time, for the store's all-reduce (vs NCCL all-reduce) and its
    reduce-to-owners (vs NCCL reduce-scatter): the sizes missed by each, or that all are met."""
    missed, judged = {"store all-reduce": [], "store to owners": []}, 0
    for r in rows:
        tgt = next(((f, b) for lo, f, b in TARGETS if r["size_mib"] >= lo), None)
        sp = r.get("device_speedups", {})
        if tgt is None or "store_ar_vs_allreduce_fp32" not in sp:
            continue
        judged += 1
        for label, key in (("store all-reduce", "store_ar_vs_"), ("store to owners", "store_owners_vs_")):
            suffix = "allreduce" if label == "store all-reduce" else "reduce_scatter"
            if sp[f"{key}{suffix}_fp32"] < tgt[0] or sp[f"{key}{suffix}_bf16"] < tgt[1]:
                missed[label].append(r["size_mib"])
    if not judged:
        return "device time: no size judged (the store reductions need the peer transport and a size >= 64 MiB)"
    return "device time: " + "; ".join(f"{k} " + (f"missed at sizes (MiB) {v}" if v else "targets met")
                                       for k, v in missed.items())


def _add_bus_bandwidth(rows: list[dict], world: int) -> None:
    """NCCL fp32 all-reduce bus bandwidth per size (GB/s; nccl-tests' convention 2 (W-1)/W bytes / time)."""
    for r in rows:
        bus_bytes = 2 * (world - 1) / world * r["size_mib"] * 2**20
        r["nccl_allreduce_fp32_busbw_gbps"] = bus_bytes / (r["ms"]["nccl_allreduce_fp32"] * 1e6)  # ms -> GB/s


def resolve_baseline_args(args, parser: argparse.ArgumentParser) -> None:
    """--baselines default (both kinds on CUDA over NVLink, none otherwise), refused where they cannot run;
    --collectives only with --baseline-only."""
    args.watchdog = StallWatchdog(args.case_timeout)  # every guarded case runs under it (allreduce_baselines.py)
    cuda_nvlink = args.device == "cuda" and args.link == "default"
    if args.baselines is None:
        args.baselines = sorted(EXTRA_KINDS) if cuda_nvlink else []
    elif args.baselines and not cuda_nvlink:
        parser.error(f"--baselines {' '.join(args.baselines)} needs CUDA and --link default (symmetric memory and "
                     "NCCL windows are NVLink features); pass --baselines with no value or leave it out")
    if args.collectives is not None and not args.baseline_only:
        parser.error("--collectives selects the cases of --baseline-only; a full run times both collectives")
    args.collectives = tuple(args.collectives or COLLECTIVES)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=None)
    p.add_argument("--chunk-mib", type=int, nargs="+", default=DEFAULT_CHUNK_MIB,
                   help="chunk sizes (MiB of codes) for the fp32 all-reduce; 0 = auto")
    p.add_argument("--format", default="int8_b256")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--exact-check-mib", type=int, default=16,
                   help="sizes up to this also get the bit-exact comparison with the reference")
    p.add_argument("--out", default=None, help="JSON report (rank 0); default $OUT/grads.json when $OUT is set")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 self-spawned ranks, tiny sizes")
    p.add_argument("--case-timeout", type=float, default=300.0,
                   help="seconds a guarded baseline case may run before its rank ends with exit 3 (a peer rank "
                        "failed and left the collective; 0: wait)")
    p.add_argument("--link", choices=("default", "socket"), default="default",
                   help="socket: NCCL over TCP sockets between the local GPUs, a stand-in for an inter-node link "
                        f"(sets {' '.join(f'{k}={v}' for k, v in SOCKET_LINK_ENV.items())})")
    p.add_argument("--no-peer", action="store_true", help="skip the NVLink peer-memory transport")
    p.add_argument("--baselines", nargs="*", choices=sorted(EXTRA_KINDS), default=None,
                   help="the extra bf16 baselines (issue 46; allreduce_baselines.py): symm = torch symmetric-memory "
                        "one-shot / two-shot all-reduce and reduce-scatter, window = NCCL on window-registered "
                        "buffers; default both on CUDA with --link default, none otherwise; --baselines with no "
                        "value: none")
    p.add_argument("--baseline-only", action="store_true",
                   help="time only NCCL's bf16 reductions (--collectives) and the --baselines cases, every one "
                        "guarded (the NCCL_ALGO / NCCL_PROTO sweep, nccl_sweep.py)")
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=None,
                   help=f"with --baseline-only: the collectives timed (default: {' '.join(COLLECTIVES)})")
    p.add_argument("--timing", choices=("both", "latency"), default="both",
                   help="both (default on GPUs): each case is timed as a single call from an idle GPU (ms: host "
                        "enqueue included) and again with the enqueue hidden behind a GPU sleep (device_ms); "
                        "latency: the first only")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.link == "socket":
        os.environ.update(SOCKET_LINK_ENV)  # read by NCCL when the communicator is created
    args.device = "cpu" if args.smoke else "cuda"
    args.peer = args.device == "cuda" and args.link == "default" and not args.no_peer and not args.baseline_only
    resolve_baseline_args(args, p)
    args.sizes_mib = args.sizes_mib or (SMOKE_SIZES_MIB if args.smoke else DEFAULT_SIZES_MIB)
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "grads.json")
    started = time.time()
    if args.smoke:
        args.warmup, args.iters = 1, 2
        rows = spawn_ranks(2, _spawned, args=(args,))[0]
        rank, env = 0, "cpu/gloo x2 (smoke: semantics only, timings meaningless)"
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
        rank = dist.get_rank()
        rows = run(rank, dist.get_world_size(), args)
        env = f"{torch.cuda.get_device_name()} x{dist.get_world_size()} nccl {torch.cuda.nccl.version()}"
        if not args.baseline_only:
            _add_bus_bandwidth(rows, dist.get_world_size())
        dist.destroy_process_group()
    if rank != 0:
        return
    lines, ok = summarize(rows, check_targets=not args.smoke)
    for line in lines:
        print(line)
    if args.out:
        import triton

        link = ("NCCL over TCP sockets between local GPUs (stand-in for an inter-node link): "
                + " ".join(f"{k}={v}" for k, v in SOCKET_LINK_ENV.items())) if args.link == "socket" else "default"
        report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "env": env, "link": link,
                  "torch": torch.__version__, "triton": triton.__version__, "host": platform.node(),
                  "agoq_commit": source_commit(), "command": " ".join(sys.argv),
                  "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
                  "baselines": args.baselines, "baseline_only": args.baseline_only,
                  "baseline_accumulation": BASELINE_ACCUMULATION, "link_peak": getattr(args, "link_peak", None),
                  "seconds": time.time() - started, "correct": ok, "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
