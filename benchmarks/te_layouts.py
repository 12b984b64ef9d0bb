"""bench_te.py's multi-GPU rows (issue 46 items 2 and 4) and what their summary computes: one host, 2 or 4 GPUs.

A row here is one of bench_te's one-GPU rows (``base``: its driver and precision flags, a ``ROWS`` name) run at a
layout: tensor (TP), pipeline (PP) and context (CP) parallel sizes, data parallel the rest of ``nproc``. Where DP > 1
it runs as Megatron-LM users run data parallelism: ``--use-distributed-optimizer --overlap-grad-reduce`` with
Megatron's default bucket size (no ``--ddp-bucket-size``); ``--grad-reduce-in-bf16`` is Megatron-LM's bf16
gradient reduction (megatron.training.arguments, megatron-core 0.19.2). ``socket`` rows take ``SOCKET_LINK_ENV``:
NCCL over TCP sockets between the local GPUs, the stand-in for an inter-node link (as in
benchmarks/pretrain_suites_scale.py).

Suites (``python benchmarks/bench_te.py --suite NAME``; ``--nproc N`` keeps a suite's N-GPU rows):

* ``dp_1b``: the ~1B body at DP=2 and DP=4 (micro-batch 2, global batch 16, as the one-GPU rows), Megatron + TE
  bf16 and FP8 with fp32 and bf16 gradient reduction against agoq + TE full (bf16, FP8); DP=2 on the socket link;
* ``dp2_pp2_3b``: the LLaMA-3.2-3B body (benchmarks/pretrain_suites_scale.py SHAPE_3B, LLaMA-3's 128,256
  vocabulary, untied as every bench_te shape) at DP=2 x PP=2, micro-batch 1, global batch 16; the same six rows,
  the FP8 ones on the socket link too;
* ``eqmem_8b``: the LLaMA-3-8B shape on 4 GPUs, micro-batch 1 (2 where named), global batch 16: Megatron + TE FP8 at
  its layouts with its levers (recompute, precision-aware optimizer, activation offloading) against agoq + TE FP8
  at its layouts; every row under expandable segments (the one-GPU 8B row needed them; both sides get them).
  ``equal_memory`` picks each side's fastest row under per-GPU budgets (``EQUAL_MEMORY_BUDGETS_GIB``);
* ``cp_16k``: the ~1B body at sequence 16,384, micro-batch 1, global batch 4: CP=2 on 2 GPUs against its CP=1
  twin on one GPU (same data, same seed), agoq + TE (bf16, FP8) and Megatron + TE bf16; ``cp_losses`` compares
  each CP=2 row's losses with its twin's. The dataloader's [s, s] attention mask is off
  (``--no-create-attention-mask-in-dataloader``: TE's causal attention does not read it).

The planner (``planner`` of a row): agoq.plan's TE path predicts one GPU; a row it cannot model carries the
planner's own refusal as ``not modelled: ...`` (no number); CP is not modelled at all (agoq.plan has no
context-parallel term: ``CP_NOT_MODELLED``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# NCCL over TCP sockets between the local GPUs (no peer access, no shared memory, no InfiniBand), as in
# benchmarks/pretrain_suites_scale.py: the inter-node stand-in
SOCKET_LINK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
DP_USERS = ["--use-distributed-optimizer", "--overlap-grad-reduce"]  # Megatron's default bucket size
BF16_REDUCE = ["--grad-reduce-in-bf16"]
SWITCHES = (*DP_USERS, "--sequence-parallel")  # layout_flags' flags without a value
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
NO_MASK = ["--no-create-attention-mask-in-dataloader"]
CP_NOT_MODELLED = ("planner: CP not modelled (agoq.plan has no context-parallel term; it takes no "
                   "--context-parallel-size)")
# per-GPU budgets of the 8B equal-memory table, peaks as allocated (the largest rank's): 77.89 GiB is an H100 80GB's
# 79.18 GiB less the 1.29 GiB a process holds outside PyTorch's allocator (agoq.plan.__main__.OUTSIDE_ALLOCATOR_GIB)
EQUAL_MEMORY_BUDGETS_GIB = (40.0, 60.0, 77.89)
EIGHT_B_TARGET = 1.3  # issue 46 item 2: agoq + TE FP8's fastest fitting layout >= 1.3x Megatron + TE FP8's
GIB = 2**30


@dataclass(frozen=True)
class LayoutRow:
    base: str  # a bench_te ROWS name: driver and flags
    shape: str
    nproc: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1
    global_batch: int = 16
    seq: int | None = None  # None: the shape's
    extra: tuple[str, ...] = ()
    env: dict = field(default_factory=dict, hash=False)

    @property
    def dp(self) -> int:
        return self.nproc // (self.tp * self.pp * self.cp)

    @property
    def side(self) -> str:
        return "agoq" if self.base.startswith("agoq") else "megatron"


def check_layout(name: str, row: LayoutRow) -> None:
    if row.tp * row.pp * row.cp * row.dp != row.nproc:
        raise ValueError(f"{name}: TP {row.tp} x PP {row.pp} x CP {row.cp} does not divide --nproc {row.nproc}")
    if row.global_batch % (row.micro_batch * row.dp):
        raise ValueError(f"{name}: global batch {row.global_batch} is not a multiple of micro-batch {row.micro_batch} "
                         f"x DP {row.dp}")


def row_env(row: LayoutRow) -> dict:
    """The row's environment: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` under TP or CP (megatron.training's validate_args
    asserts it before Blackwell, as Megatron-LM's example scripts export it), the row's own (the socket link)."""
    return {**({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if row.tp > 1 or row.cp > 1 else {}), **row.env}


def layout_flags(row: LayoutRow) -> list[str]:
    """Megatron-LM's parallelism flags of ``row`` (the data-parallel users' flags where DP > 1)."""
    flags = []
    if row.tp > 1:  # Megatron-LM users run TP with sequence parallelism
        flags += ["--tensor-model-parallel-size", str(row.tp), "--sequence-parallel"]
    if row.pp > 1:
        flags += ["--pipeline-model-parallel-size", str(row.pp)]
    if row.cp > 1:
        flags += ["--context-parallel-size", str(row.cp)]
    if row.dp > 1:
        flags += DP_USERS
    return flags


def _dp_rows(shape: str, prefix: str, nproc: int, pp: int, mbs: int, socket: bool) -> dict[str, LayoutRow]:
    rows = {}
    for side, base in (("te_bf16", "te/bf16"), ("te_fp8", "te/fp8_delayed")):
        if socket and side == "te_bf16":
            continue
        for reduce, extra in (("fp32_reduce", ()), ("bf16_reduce", tuple(BF16_REDUCE))):
            rows[f"{prefix}/{side}/{reduce}"] = LayoutRow(base, shape, nproc, pp=pp, micro_batch=mbs,
                                                          extra=extra, env=SOCKET_LINK_ENV if socket else {})
    for name, base in (("agoq_te/full", "agoq_te/full"), ("agoq_te/full_fp8", "agoq_te/full_fp8")):
        if socket and name == "agoq_te/full":
            continue
        rows[f"{prefix}/{name}"] = LayoutRow(base, shape, nproc, pp=pp, micro_batch=mbs,
                                             env=SOCKET_LINK_ENV if socket else {})
    return rows


def _eqmem_8b() -> dict[str, LayoutRow]:
    aware = ("--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
    te = {"pp4": dict(pp=4), "pp2_dp2": dict(pp=2), "tp2_dp2": dict(tp=2), "tp4": dict(tp=4),
          "pp2_dp2_precision_aware": dict(pp=2, extra=aware),
          "dp4_precision_aware_selective": dict(extra=aware + ("--recompute-granularity", "selective")),
          "dp4_precision_aware_full_recompute": dict(extra=aware + tuple(FULL_RECOMPUTE)),
          "pp2_dp2_precision_aware_offload": dict(pp=2, extra=aware + ("--fine-grained-activation-offloading",
                                                  "--offload-modules", "attn_norm", "qkv_linear", "core_attn",
                                                  "attn_proj", "mlp_norm"), env={"NVTE_CPU_OFFLOAD_V1": "1"})}
    agoq = {"dp4": dict(), "dp4_mbs2": dict(micro_batch=2), "pp2_dp2": dict(pp=2), "pp4": dict(pp=4),
            "tp2_dp2": dict(tp=2)}
    rows = {}
    for side, base, table in (("te_fp8", "te/fp8_delayed", te), ("agoq_te_fp8", "agoq_te/full_fp8", agoq)):
        for name, spec in table.items():
            spec = dict(spec)
            env = {**EXPANDABLE, **spec.pop("env", {})}
            if spec.get("extra") and "--use-precision-aware-optimizer" in spec["extra"]:
                spec["extra"] = ("--use-distributed-optimizer", *spec["extra"])  # Megatron requires it
            rows[f"eqmem_8b/{side}/{name}"] = LayoutRow(base, "8b", 4, env=env, **spec)
    return rows


def _cp_16k() -> dict[str, LayoutRow]:
    rows = {}
    for name, base in (("agoq_te/full", "agoq_te/full"), ("agoq_te/full_fp8", "agoq_te/full_fp8"),
                       ("te/bf16", "te/bf16")):
        for cp in (1, 2):
            rows[f"cp_16k/cp{cp}/{name}"] = LayoutRow(base, "1b", cp, cp=cp, micro_batch=1, global_batch=4,
                                                      seq=16384, extra=tuple(NO_MASK))
    return rows


SUITES: dict[str, dict[str, LayoutRow]] = {
    "dp_1b": {**_dp_rows("1b", "dp2_1b", 2, 1, 2, False), **_dp_rows("1b", "dp4_1b", 4, 1, 2, False),
              **_dp_rows("1b", "dp2_1b_socket", 2, 1, 2, True)},
    "dp2_pp2_3b": {**_dp_rows("3b", "dp2_pp2_3b", 4, 2, 1, False),
                   **_dp_rows("3b", "dp2_pp2_3b_socket", 4, 2, 1, True)},
    "eqmem_8b": _eqmem_8b(),
    "cp_16k": _cp_16k(),
}
for _suite in SUITES.values():
    for _name, _row in _suite.items():
        check_layout(_name, _row)


def cp_twin(name: str) -> str | None:
    """The CP=1 twin of a CP>1 row name (``cp_16k/cp2/x`` -> ``cp_16k/cp1/x``), None for other rows."""
    parts = name.split("/")
    if len(parts) > 2 and parts[1].startswith("cp") and parts[1] != "cp1":
        return "/".join([parts[0], "cp1", *parts[2:]])
    return None


def cp_losses(rows: list[dict]) -> list[dict]:
    """Each CP>1 row's losses against its CP=1 twin's, iteration by iteration (same data, same seed): the largest
    absolute and relative difference, over every iteration both have, and both rows' per-GPU peaks."""
    by_name = {r["name"]: r for r in rows}
    out = []
    for row in rows:
        twin = by_name.get(cp_twin(row["name"]) or "")
        if twin is None:
            continue
        losses, twin_losses = row.get("losses") or [], twin.get("losses") or []
        n = min(len(losses), len(twin_losses))
        entry = {"row": row["name"], "twin": twin["name"], "iterations": [len(losses), len(twin_losses)],
                 "peak_allocated_bytes": row.get("peak_allocated_bytes"),
                 "twin_peak_allocated_bytes": twin.get("peak_allocated_bytes"),
                 "planner": row.get("planner"), "twin_planner": twin.get("planner")}
        if n:
            diffs = [abs(losses[i] - twin_losses[i]) for i in range(n)]
            rel = [diffs[i] / abs(twin_losses[i]) for i in range(n) if twin_losses[i]]
            entry.update(max_abs_diff=max(diffs), mean_abs_diff=statistics.fmean(diffs),
                         max_rel_diff=max(rel, default=None), last=[losses[n - 1], twin_losses[n - 1]])
        out.append(entry)
    return out


def _fits(row: dict, side: str, budget_bytes: float) -> bool:
    peak = row.get("peak_allocated_bytes")
    return (row.get("side") == side and row.get("returncode") == 0 and bool(row.get("losses"))
            and row.get("tokens_per_s") is not None and peak is not None and peak <= budget_bytes)


def equal_memory(rows: list[dict], budgets_gib=EQUAL_MEMORY_BUDGETS_GIB, target: float = EIGHT_B_TARGET) -> list[dict]:
    """Per per-GPU budget: each side's fastest finished row whose largest rank peak fits it, and agoq's tokens/s
    over Megatron's (``ratio``; ``met``: ratio >= target). A failed row (out of memory) never fits."""
    table = []
    for budget in budgets_gib:
        entry = {"budget_gib": budget}
        for side in ("megatron", "agoq"):
            fits = [r for r in rows if _fits(r, side, budget * GIB)]
            best = max(fits, key=lambda r: r["tokens_per_s"]) if fits else None
            entry[side] = best and {"name": best["name"], "tokens_per_s": best["tokens_per_s"],
                                    "peak_gib": round(best["peak_allocated_bytes"] / GIB, 2)}
        if entry["megatron"] and entry["agoq"]:
            entry["ratio"] = entry["agoq"]["tokens_per_s"] / entry["megatron"]["tokens_per_s"]
            entry["target"], entry["met"] = target, entry["ratio"] >= target
        table.append(entry)
    return table


def stage_peaks(rank_records: list[dict]) -> list[int]:
    """Each pipeline stage's peak (the largest of its ranks' allocated peaks), stage 0 first."""
    stages: dict[int, int] = {}
    for rec in rank_records:
        stage = rec["pp_stage"]
        stages[stage] = max(stages.get(stage, 0), rec["peak_allocated_bytes"])
    return [stages[s] for s in sorted(stages)]


def planner_error(row: dict) -> float | None:
    predicted, measured = row.get("planner", {}).get("predicted_peak_bytes"), row.get("peak_allocated_bytes")
    return None if predicted is None or not measured else (predicted - measured) / measured
