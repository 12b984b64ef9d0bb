"""Pipeline-schedule arithmetic for stage-aware bit allocation (pure Python, no torch).

In-flight counts mirror megatron-core 0.19.2 ``pipeline_parallel/schedules.py:get_pp_rank_microbatches``
(verified against the installed wheel):

- no virtual pipeline (``forward_backward_pipelining_without_interleaving``): rank r runs
  ``warmup = P - r - 1`` forwards (capped at M), then 1F1B, so at most ``min(P - r, M)``
  micro-batches hold activations at once;
- interleaved (``forward_backward_pipelining_with_interleaving``): ``warmup = (P - r - 1) * 2 +
  (V - 1) * G`` chunk-micro-batches, G = ``microbatch_group_size_per_vp_stage`` (Megatron's
  ``ModelParallelConfig.__post_init__`` defaults it to P); if warmup >= M * V every chunk-micro-batch
  is in warm-up, else the 1F1B steady state adds one: in flight = ``min(warmup + 1, M * V)``.
  One chunk-micro-batch holds 1/V of the rank's layers, so counts compare across ranks as-is.

The auto rule (arXiv 2605.00539, [recon] of AGoQ's DBCA-PP): a rank's activation memory is
proportional to in-flight count x bits, so rank r targets ``b_r = b_base * M_max / M_r`` bits to
match the busiest rank's peak at the base format.
"""

from __future__ import annotations

import dataclasses

from agoq.policy.schema import AUTO_ROUNDINGS


@dataclasses.dataclass(frozen=True)
class ScheduleInfo:
    """What the pipeline schedule looks like: sizes and micro-batch counts per global batch.

    ``vp_size`` is None without virtual pipelining (Megatron selects the interleaved schedule
    whenever it is not None). ``microbatch_group_size`` is Megatron's
    ``microbatch_group_size_per_vp_stage``; None means Megatron's default, ``pp_size``.
    """

    pp_size: int
    vp_size: int | None
    num_microbatches: int
    microbatch_group_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("pp_size", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ScheduleInfo.{name} must be an int >= 1; got {value!r}")
        if self.vp_size is not None and (not isinstance(self.vp_size, int) or self.vp_size < 1):
            raise ValueError(f"ScheduleInfo.vp_size must be None or an int >= 1; got {self.vp_size!r}")
        if self.vp_size is None:
            if self.microbatch_group_size is not None:
                raise ValueError(
                    "ScheduleInfo.microbatch_group_size only applies to the interleaved schedule; "
                    f"set vp_size or leave it None (got {self.microbatch_group_size})"
                )
            return
        if self.pp_size == 1:
            raise ValueError(
                f"ScheduleInfo.vp_size={self.vp_size} needs pp_size > 1 (Megatron runs PP=1 without "
                "pipelining); set vp_size=None"
            )
        group = self.group_size
        # Megatron raises the same condition in forward_backward_pipelining_with_interleaving.
        if not self.pp_size <= group <= self.num_microbatches:
            raise ValueError(
                f"interleaved schedule needs pp_size <= microbatch_group_size <= num_microbatches "
                f"(Megatron's rule); got pp_size={self.pp_size}, microbatch_group_size={group}, "
                f"num_microbatches={self.num_microbatches}: raise num_microbatches or lower the group size"
            )

    @property
    def group_size(self) -> int:
        """Megatron's ``microbatch_group_size_per_vp_stage`` with its default (pp_size) applied."""
        return self.pp_size if self.microbatch_group_size is None else self.microbatch_group_size


def inflight_microbatches(pp_rank: int, schedule: ScheduleInfo) -> int:
    """Peak number of (chunk-)micro-batches whose activations rank ``pp_rank`` holds at once."""
    if not 0 <= pp_rank < schedule.pp_size:
        raise ValueError(f"pp_rank must be in [0, {schedule.pp_size}); got {pp_rank}")
    if schedule.pp_size == 1:
        return 1  # forward_backward_no_pipelining: each micro-batch runs forward then backward
    num_stages_after = schedule.pp_size - pp_rank - 1
    if schedule.vp_size is None:
        total = schedule.num_microbatches
        warmup = num_stages_after
    else:
        total = schedule.num_microbatches * schedule.vp_size
        warmup = num_stages_after * 2 + (schedule.vp_size - 1) * schedule.group_size
    if warmup >= total:
        return total
    return warmup + 1


def inflight_per_rank(schedule: ScheduleInfo) -> tuple[int, ...]:
    """``inflight_microbatches`` for every pipeline rank, rank 0 first."""
    return tuple(inflight_microbatches(r, schedule) for r in range(schedule.pp_size))


def target_bits(base_bits: float, inflight: int, max_inflight: int) -> float:
    """Bits that give a rank with ``inflight`` micro-batches the busiest rank's peak memory."""
    if not 1 <= inflight <= max_inflight:
        raise ValueError(f"need 1 <= inflight <= max_inflight; got {inflight}, {max_inflight}")
    return base_bits * max_inflight / inflight


def pick_rung(rungs: list[tuple[str, float]], target: float, rounding: str) -> str:
    """Choose a rung (name, bits) for ``target`` bits; ``rungs`` is sorted by strictly rising bits.

    - ``nearest``: the rung closest to target; a tie goes to the cheaper rung.
    - ``up``: the cheapest rung with bits >= target (never less precision than memory allows;
      peak memory may exceed the busiest rank's by up to one rung).
    - ``down``: the richest rung with bits <= target (peak memory never exceeds the busiest rank's).
    ``up`` above the top rung gives the top rung; ``down`` below the bottom gives the bottom rung.
    """
    if rounding not in AUTO_ROUNDINGS:
        raise ValueError(f"auto rounding {rounding!r} is not one of {list(AUTO_ROUNDINGS)}")
    if not rungs:
        raise ValueError("pick_rung needs at least one rung")
    if rounding == "up":
        return next((name for name, bits in rungs if bits >= target), rungs[-1][0])
    if rounding == "down":
        below = [name for name, bits in rungs if bits <= target]
        return below[-1] if below else rungs[0][0]
    best_name, best_dist = rungs[0][0], abs(rungs[0][1] - target)
    for name, bits in rungs[1:]:
        if abs(bits - target) < best_dist:  # strict: ties keep the cheaper rung
            best_name, best_dist = name, abs(bits - target)
    return best_name
