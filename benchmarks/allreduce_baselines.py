"""The bf16 reductions bench_allreduce.py measures beside NCCL's plain calls (issue 46 item 1), their bus bandwidth
and the link's measured peak.

Issue 46: the store all-reduce measured 2.07x NCCL's bf16 all-reduce at 160 MiB on 2 H100s (device time), more than
halving the bytes allows (2x), so the NCCL bf16 baseline ran below link speed. These are the faster bf16 reductions
the machine offers, each timed like the NCCL cases:

  symm_oneshot_allreduce_bf16      torch.ops.symm_mem.one_shot_all_reduce_out(inp, "sum", group, out): every rank
                                   loads every peer's input from its symmetric-memory buffer and sums (out of place)
  symm_twoshot_allreduce_bf16      torch.ops.symm_mem.two_shot_all_reduce_(inp, "sum", group): each rank reduces
                                   its 1/W of the peers' buffers and writes the sum into every peer's (in place)
  symm_reduce_scatter_bf16         torch.ops.symm_mem.reduce_scatter_out(inp, group, False, shard): the first half
                                   of the two-shot (1-D, the shard of rank r is elements [r N/W, (r+1) N/W))
  nccl_window_allreduce_bf16       dist.all_reduce / reduce_scatter_tensor on buffers of a torch.cuda.MemPool over
  nccl_window_reduce_scatter_bf16  NCCL's allocator registered as an NCCL window (register_mem_pool(pool, symm=True)
                                   -> ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)): NCCL may then take its
                                   symmetric kernels (NCCL >= 2.27, one NVLink domain); whether it did shows under
                                   NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING as "[Symmetric]" (not read here)

Where the API comes from: the op schemas are registered in pytorch/pytorch
torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.cpp (TORCH_LIBRARY_FRAGMENT(symm_mem)) and implemented for the
CUDA backend in .../symm_mem/CUDASymmetricMemoryOps.cu; read on pytorch main (commits 029e4735, 03a4032b: the index
holds no v2.11.0 copy), and the same schemas are in the torch 2.14.1 wheel's registry. The input must be a
``torch.distributed._symmetric_memory.empty`` allocation rendezvoused on the group (agoq.comm.symm.enable_group, as
agoq's own peer transport); 16-byte alignment, W in {2, 4, 8} for the two-shot and the reduce-scatter; bf16 and fp32
only. A torch 2.11 that lacks an op or refuses a size raises, and the bench records the error (below).

Accumulation (BASELINE_ACCUMULATION): the torch kernels add bf16 in bf16 (CUDASymmetricMemory-inl.h: add_vec ->
add_bf16x2 = __hadd2, one rounding per add, no fp32 accumulator; only the multimem kernels, off here, accumulate in
fp32). At W = 2 that is one add, the same as an fp32 sum rounded once; at W = 4 three roundings. NCCL's ring / tree
reduce bf16 operands hop by hop, rounding to bf16 at each hop; its symmetric kernels accumulate in fp32 (NVIDIA's
NCCL 2.27 release post). Every baseline's relative L2 error against the fp32 all-reduce of the same bf16 inputs is
checked (< BF16_MAX_REL_ERR) and recorded.

Nothing silent: a baseline that cannot be set up or raises while timed (op missing, dtype / size refused, NCCL
refusing a protocol) is recorded in the row's ``baseline_errors`` with its error text, printed to stderr with the
rank, and the other cases run on. A failure on one rank only leaves the other ranks waiting in a collective that
will not complete; every guarded case runs under a stall watchdog (:class:`StallWatchdog`, ``--case-timeout``):
a case that has not ended within its limit prints which case, on which rank, and ends the process with exit 3
rather than waiting for the step's time limit. The failures met so far (op missing, refused sizes) are the same on
every rank.

Bus bandwidth (nccl-tests' convention, bytes = the full input of the collective, for an all-gather its full output):
busbw = bytes / time x 2 (W-1)/W for an all-reduce, x (W-1)/W for a reduce-scatter or an all-gather. The link's peak
(measure_link_peak) is a copy-engine copy of LINK_PEAK_BYTES from a peer GPU's symmetric-memory buffer into local
memory (cudaMemcpyAsync through a peer mapping: no NCCL protocol, no SMs), one rank at a time, one direction: what
one GPU can receive from one peer, the rate a ring all-reduce's busbw is measured against.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist

ALLREDUCE, REDUCE_SCATTER, ALLGATHER = "allreduce", "reduce_scatter", "allgather"
COLLECTIVES = (ALLREDUCE, REDUCE_SCATTER)
# case -> (collective, bytes per element of its input): the cases whose bus bandwidth a row reports
BASELINE_CASES = {
    "nccl_allreduce_fp32": (ALLREDUCE, 4),
    "nccl_allreduce_bf16": (ALLREDUCE, 2),
    "nccl_reduce_scatter_fp32": (REDUCE_SCATTER, 4),
    "nccl_reduce_scatter_bf16": (REDUCE_SCATTER, 2),
    "symm_oneshot_allreduce_bf16": (ALLREDUCE, 2),
    "symm_twoshot_allreduce_bf16": (ALLREDUCE, 2),
    "symm_reduce_scatter_bf16": (REDUCE_SCATTER, 2),
    "nccl_window_allreduce_bf16": (ALLREDUCE, 2),
    "nccl_window_reduce_scatter_bf16": (REDUCE_SCATTER, 2),
    "raw_int8_allgather": (ALLGATHER, 1),  # W x N bytes gathered (the full output)
}
# the bf16 reductions agoq's store is judged against, by collective (the summary picks the fastest of each)
BF16_BASELINES = {coll: [c for c, (k, b) in BASELINE_CASES.items() if k == coll and b == 2] for coll in COLLECTIVES}
SYMM_CASES = ("symm_oneshot_allreduce_bf16", "symm_twoshot_allreduce_bf16", "symm_reduce_scatter_bf16")
WINDOW_CASES = ("nccl_window_allreduce_bf16", "nccl_window_reduce_scatter_bf16")
EXTRA_KINDS = {"symm": SYMM_CASES, "window": WINDOW_CASES}
_NCCL_RING = "NCCL ring / tree: bf16 operands reduced hop by hop, rounded to bf16 at each hop"
BASELINE_ACCUMULATION = {
    "nccl_allreduce_bf16": _NCCL_RING,
    "nccl_reduce_scatter_bf16": _NCCL_RING,
    **{c: "torch CUDA symmetric-memory kernel: bf16 adds (__hadd2), a rounding per add (W-1 per element)"
       for c in SYMM_CASES},
    **{c: "NCCL symmetric kernel if NCCL took it (fp32 accumulators, NCCL >= 2.27), else " + _NCCL_RING
       for c in WINDOW_CASES},
}
# bf16 sums of N(0,1) inputs: ~0.1-0.3 % relative L2 error against the fp32 sum (one to three bf16 roundings);
# a wrong shard or a lost peer gives O(100 %)
BF16_MAX_REL_ERR = 0.01
LINK_PEAK_BYTES = 256 << 20
LINK_PEAK_ITERS = 20
LINK_PEAK_METHOD = ("copy-engine copy (torch copy_ -> cudaMemcpyAsync) between local memory and a peer GPU's "
                    "symmetric-memory buffer, rank 0 with rank 1, the others idle; link_peak_gbps = the faster "
                    "direction; all_pull: every rank pulls from rank+1 at once (per-rank rate, slowest rank)")


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor: 2 (W-1)/W for an all-reduce, (W-1)/W for a reduce-scatter / all-gather."""
    if collective == ALLREDUCE:
        return 2 * (world - 1) / world
    if collective in (REDUCE_SCATTER, ALLGATHER):
        return (world - 1) / world
    raise ValueError(f"bus_factor: unknown collective {collective!r} (allowed: {ALLREDUCE}, {REDUCE_SCATTER}, "
                     f"{ALLGATHER})")


def bus_bandwidth_gbps(collective: str, nbytes: int, ms: float, world: int) -> float:
    """Bus bandwidth in GB/s (1e9 bytes) of a collective over ``nbytes`` (its full input; an all-gather's full
    output) that took ``ms`` milliseconds on ``world`` ranks."""
    if ms <= 0:
        raise ValueError(f"bus_bandwidth_gbps: time must be > 0 ms, got {ms}")
    return nbytes / (ms * 1e6) * bus_factor(collective, world)


def case_bytes(case: str, numel: int, world: int) -> int:
    """The bytes nccl-tests would name for ``case`` at ``numel`` gradient elements per rank."""
    collective, per_elem = BASELINE_CASES[case]
    return numel * per_elem * (world if collective == ALLGATHER else 1)


def add_bus_bandwidth(row: dict, link_peak_gbps: float | None) -> None:
    """busbw_gbps / device_busbw_gbps for every BASELINE_CASES case the row timed, and their fractions of the link's
    measured peak (when there is one)."""
    world, numel = row["world_size"], row["numel"]
    for timing, key in (("ms", "busbw_gbps"), ("device_ms", "device_busbw_gbps")):
        times = row.get(timing) or {}
        bw = {c: bus_bandwidth_gbps(BASELINE_CASES[c][0], case_bytes(c, numel, world), t, world)
              for c, t in times.items() if c in BASELINE_CASES}
        if bw:
            row[key] = bw
            if link_peak_gbps:
                row[key.replace("busbw_gbps", "link_fraction")] = {c: v / link_peak_gbps for c, v in bw.items()}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def record_failure(errors: dict, name: str, err: BaseException | str) -> None:
    """Record a baseline's failure (its error text) in ``errors`` and print it with the rank: never silent."""
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    errors[name] = text
    print(f"[rank {_rank()}] baseline {name} FAILED (recorded in the JSON, the other cases run on): {text}",
          file=sys.stderr, flush=True)


STALL_EXIT = 3


class StallWatchdog:
    """Ends the process (exit STALL_EXIT, after a line naming the case and the rank) when a case has run longer than
    ``limit_s``: a collective a peer never joined does not return. ``with watchdog.case(name): ...`` arms it for one
    case; ``limit_s`` None or 0 disarms it. ``exit_fn`` is os._exit (a test passes its own)."""

    def __init__(self, limit_s: float | None, exit_fn=os._exit):
        self.limit_s, self.exit_fn = limit_s, exit_fn

    def case(self, name: str):
        watchdog, done = self, threading.Event()  # one event per case: a late wake-up never fires for the next

        class _Armed:
            def __enter__(self):
                if watchdog.limit_s:
                    threading.Thread(target=watchdog._watch, args=(name, done), daemon=True).start()

            def __exit__(self, *exc):
                done.set()
                return False

        return _Armed()

    def _watch(self, name: str, done: threading.Event) -> None:
        if not done.wait(self.limit_s):
            print(f"[rank {_rank()}] baseline {name}: no result after {self.limit_s:.0f} s (a peer rank failed or "
                  "left the collective: see the other ranks' lines); ending this rank with exit "
                  f"{STALL_EXIT} instead of waiting", file=sys.stderr, flush=True)
            self.exit_fn(STALL_EXIT)


NO_WATCHDOG = StallWatchdog(None)


def time_cases(cases: dict, guarded: set, fresh, time_ms, time_device=None,
               watchdog: StallWatchdog = NO_WATCHDOG) -> dict:
    """Time every case: ``fresh()`` before each timing, ``time_ms(fn)`` -> ms, ``time_device(fn)`` -> (device ms,
    host enqueue ms, clean) when given. A case in ``guarded`` that raises is recorded in ``errors`` (and printed)
    and leaves no timing; any other case's error propagates."""
    out = {"ms": {}, "device_ms": {}, "host_enqueue_ms": {}, "device_clean": {}, "errors": {}}
    for name, fn in cases.items():
        try:
            with watchdog.case(name) if name in guarded else NO_WATCHDOG.case(name):
                fresh()
                out["ms"][name] = time_ms(fn)
                if time_device is not None:
                    fresh()
                    out["device_ms"][name], out["host_enqueue_ms"][name], out["device_clean"][name] = \
                        time_device(fn)
        except Exception as err:
            if name not in guarded:
                raise
            for key in ("ms", "device_ms", "host_enqueue_ms", "device_clean"):
                out[key].pop(name, None)
            record_failure(out["errors"], name, err)
    return out


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


class _SymmBuffers:
    """One bf16 symmetric-memory buffer of the largest size, rendezvoused once; each size uses its first N elements
    (the ops take the buffer's storage and the view's offset)."""

    def __init__(self, group, max_numel: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        from agoq.comm.symm import enable_group

        self.name, self.world = group.group_name, dist.get_world_size(group)
        enable_group(symm_mem, self.name)
        self.buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(self.buf, self.name)
        self.out = torch.empty(max_numel, dtype=torch.bfloat16, device=device)
        self.shard = torch.empty(max_numel // self.world, dtype=torch.bfloat16, device=device)

    def cases(self, numel: int) -> dict:
        inp, out, shard = self.buf[:numel], self.out[:numel], self.shard[: numel // self.world]
        name = self.name
        return {
            "symm_oneshot_allreduce_bf16": lambda: torch.ops.symm_mem.one_shot_all_reduce_out(inp, "sum", name, out),
            "symm_twoshot_allreduce_bf16": lambda: torch.ops.symm_mem.two_shot_all_reduce_(inp, "sum", name),
            "symm_reduce_scatter_bf16": lambda: torch.ops.symm_mem.reduce_scatter_out(inp, name, False, shard),
        }

    def results(self, numel: int) -> dict:
        """Where each case leaves its result: (tensor, True for an all-reduce / False for rank r's shard)."""
        return {"symm_oneshot_allreduce_bf16": (self.out[:numel], True),
                "symm_twoshot_allreduce_bf16": (self.buf[:numel], True),
                "symm_reduce_scatter_bf16": (self.shard[: numel // self.world], False)}

    def load(self, x16: torch.Tensor) -> None:
        self.buf[: x16.numel()].copy_(x16)

    def close(self) -> None:
        pass


class _WindowBuffers:
    """bf16 buffers in a MemPool over NCCL's allocator (ncclMemAlloc), registered as an NCCL window."""

    def __init__(self, group, max_numel: int, device: torch.device):
        self.group, self.world = group, dist.get_world_size(group)
        self.backend = group._get_backend(device)
        self.pool = torch.cuda.MemPool(self.backend.mem_allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.buf = torch.empty(max_numel, dtype=torch.bfloat16, device=device)
            self.shard = torch.empty(max_numel // self.world, dtype=torch.bfloat16, device=device)
        self.registered = False
        self.backend.register_mem_pool(self.pool, symm=True)  # a torch without symm= raises TypeError: recorded
        self.registered = True

    def cases(self, numel: int) -> dict:
        buf, shard, group = self.buf[:numel], self.shard[: numel // self.world], self.group
        return {"nccl_window_allreduce_bf16": lambda: dist.all_reduce(buf, group=group),
                "nccl_window_reduce_scatter_bf16": lambda: dist.reduce_scatter_tensor(shard, buf, group=group)}

    def results(self, numel: int) -> dict:
        return {"nccl_window_allreduce_bf16": (self.buf[:numel], True),
                "nccl_window_reduce_scatter_bf16": (self.shard[: numel // self.world], False)}

    def load(self, x16: torch.Tensor) -> None:
        self.buf[: x16.numel()].copy_(x16)

    def close(self) -> None:
        if self.registered:
            torch.cuda.synchronize()
            self.backend.deregister_mem_pool(self.pool)
            self.registered = False


class ExtraBaselines:
    """The symmetric-memory and NCCL-window baselines of one run (``kinds`` among EXTRA_KINDS), their buffers set up
    once for the largest size. A kind whose setup fails is recorded (``setup_errors``) and its cases are reported
    as not run in every row."""

    def __init__(self, kinds: list[str], group, max_numel: int, device: torch.device,
                 collectives: tuple[str, ...] = COLLECTIVES):
        unknown = set(kinds) - set(EXTRA_KINDS)
        if unknown:
            raise ValueError(f"--baselines: unknown {sorted(unknown)} (allowed: {sorted(EXTRA_KINDS)})")
        self.collectives, self.kinds, self.buffers, self.setup_errors = collectives, list(kinds), {}, {}
        builders = {"symm": _SymmBuffers, "window": _WindowBuffers}
        for kind in self.kinds:
            try:
                self.buffers[kind] = builders[kind](group, max_numel, device)
            except Exception as err:
                record_failure(self.setup_errors, f"{kind}_setup", err)

    def _wanted(self, case: str) -> bool:
        return BASELINE_CASES[case][0] in self.collectives

    def cases(self, numel: int) -> dict:
        out = {}
        for buffers in self.buffers.values():
            out.update({c: fn for c, fn in buffers.cases(numel).items() if self._wanted(c)})
        return out

    def not_run(self) -> dict:
        """case -> why it did not run (its kind's setup failed)."""
        return {c: f"not run: {kind} setup failed: {self.setup_errors[f'{kind}_setup']}"
                for kind in self.kinds if kind not in self.buffers for c in EXTRA_KINDS[kind] if self._wanted(c)}

    def load(self, x16: torch.Tensor) -> None:
        """Every buffer starts a case from the same bf16 gradient (the in-place cases grow the values)."""
        for buffers in self.buffers.values():
            buffers.load(x16)

    def check(self, x16: torch.Tensor, exact: torch.Tensor, errors: dict,
              watchdog: StallWatchdog = NO_WATCHDOG) -> dict:
        """Each extra baseline run once on ``x16`` and compared with ``exact`` (the fp32 all-reduce of the same bf16
        inputs); a case that raises is recorded in ``errors``."""
        numel, out = x16.numel(), {}
        for buffers in self.buffers.values():
            fns, results = buffers.cases(numel), buffers.results(numel)
            for case, fn in fns.items():
                if not self._wanted(case) or case in errors:
                    continue
                try:
                    with watchdog.case(case):
                        buffers.load(x16)
                        fn()
                        result, full = results[case]
                        out[case] = check_result(result, exact, full)
                except Exception as err:
                    record_failure(errors, case, err)
        return out

    def close(self) -> None:
        for buffers in self.buffers.values():
            buffers.close()


def check_result(result: torch.Tensor, exact: torch.Tensor, full: bool) -> dict:
    """An all-reduce (``full``) against the whole fp32 sum, identical on every rank; a reduce-scatter's shard
    against this rank's part of it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = exact if full else exact.view(world, -1)[rank]
    rel = rel_l2(result, ref)
    out = {"rel_l2_err_vs_fp32": rel}
    flags = torch.tensor([float(rel < BF16_MAX_REL_ERR)], dtype=torch.float64, device=result.device)
    if full:
        bits = result.view(torch.int16).to(torch.int64)
        s = torch.stack([(bits * (torch.arange(1, bits.numel() + 1, device=bits.device) % 65521)).sum(), bits.sum()])
        lo, hi = s.clone(), s.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        out["ranks_identical"] = bool(torch.equal(lo, hi))
        flags *= float(out["ranks_identical"])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    out["ok"] = bool(flags.item())
    return out


def _copy_ms(dst: torch.Tensor, src: torch.Tensor, iters: int) -> float:
    dst.copy_(src)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure_link_peak(group, device: torch.device, keep: list, nbytes: int = LINK_PEAK_BYTES,
                      iters: int = LINK_PEAK_ITERS) -> dict:
    """The link's one-directional peak between two GPUs (GB/s), see the module docstring; the same dict on every
    rank. The symmetric buffer goes into ``keep`` (freed with the run, not between rendezvous of other buffers)."""
    import torch.distributed._symmetric_memory as symm_mem

    from agoq.comm.symm import enable_group

    world, rank, name = dist.get_world_size(group), dist.get_rank(group), group.group_name
    enable_group(symm_mem, name)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, name)
    remote = handle.get_buffer((rank + 1) % world, (nbytes,), torch.uint8)
    local = torch.empty(nbytes, dtype=torch.uint8, device=device)
    one_way = torch.zeros(2, dtype=torch.float64, device=device)
    dist.barrier(group)
    if rank == 0:
        one_way[0] = nbytes / (_copy_ms(local, remote, iters) * 1e6)  # pull: rank 1 -> rank 0
        one_way[1] = nbytes / (_copy_ms(remote, local, iters) * 1e6)  # push: rank 0 -> rank 1
    dist.barrier(group)
    dist.all_reduce(one_way, op=dist.ReduceOp.MAX, group=group)  # rank 0's values (the others hold zeros)
    slowest = torch.tensor([_copy_ms(local, remote, iters)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    dist.barrier(group)
    torch.cuda.synchronize()
    keep.extend([buf, handle])
    pull, push = float(one_way[0]), float(one_way[1])
    return {"method": LINK_PEAK_METHOD, "bytes": nbytes, "iters": iters, "one_way_pull_gbps": pull,
            "one_way_push_gbps": push, "all_pull_per_rank_gbps": nbytes / (float(slowest) * 1e6),
            "link_peak_gbps": max(pull, push)}
