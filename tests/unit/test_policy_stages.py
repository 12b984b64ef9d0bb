"""In-flight micro-batch counts per stage and the auto ladder (pure Python)."""

from __future__ import annotations

import itertools
import types
from pathlib import Path

import pytest

from agoq.policy import ScheduleInfo, auto_names, inflight_microbatches, inflight_per_rank, policy_from_dict
from agoq.policy.stages import pick_rung, target_bits

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"
LADDER = ["int6_b64", "int8_b128", "bf16"]
NOMINAL_BITS = {"nf4_b64": 4, "int6_b64": 6, "int8_b128": 8, "bf16": 16}


def _auto_spec(rounding: str = "nearest"):
    return policy_from_dict(
        {
            "version": 1,
            "default": {"activations": "auto"},
            "auto": {"base": "nf4_b64", "ladder": LADDER, "rounding": rounding},
        }
    )


@pytest.mark.parametrize(
    "pp_size,num_mb", [(1, 1), (1, 5), (2, 1), (2, 8), (4, 2), (4, 4), (4, 8), (8, 3), (8, 64)]
)
def test_inflight_1f1b_is_min_stages_left_and_microbatches(pp_size, num_mb):
    schedule = ScheduleInfo(pp_size=pp_size, vp_size=None, num_microbatches=num_mb)
    assert inflight_per_rank(schedule) == tuple(min(pp_size - r, num_mb) for r in range(pp_size))


# Interleaved, worked by hand from warmup = 2(P-r-1) + (V-1)G, in flight = min(warmup + 1, M*V).
INTERLEAVED_CASES = [
    # (P, V, M, G) -> per rank
    ((4, 2, 8, None), (11, 9, 7, 5)),  # G defaults to P=4: r0 warmup 6+4=10
    ((2, 2, 2, None), (4, 3)),  # r0 warmup 2+2=4 >= M*V=4: all in warm-up -> 4
    ((2, 3, 4, 4), (11, 9)),  # r0 warmup 2+2*4=10 -> 11 <= 12
    ((4, 2, 4, None), (8, 8, 7, 5)),  # r0 warmup 10, r1 8: both capped at M*V=8
    ((2, 2, 6, 3), (6, 4)),  # G=3: r0 warmup 2+3=5 -> 6
]


@pytest.mark.parametrize("args,expected", INTERLEAVED_CASES, ids=[str(c[0]) for c in INTERLEAVED_CASES])
def test_inflight_interleaved_follows_megatron_warmup(args, expected):
    pp, vp, mb, group = args
    schedule = ScheduleInfo(pp_size=pp, vp_size=vp, num_microbatches=mb, microbatch_group_size=group)
    assert inflight_per_rank(schedule) == expected


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(pp_size=0, vp_size=None, num_microbatches=1), "pp_size must be an int >= 1"),
        (dict(pp_size=2, vp_size=None, num_microbatches=0), "num_microbatches must be an int >= 1"),
        (dict(pp_size=2, vp_size=0, num_microbatches=4), "vp_size must be None or an int >= 1"),
        (dict(pp_size=1, vp_size=2, num_microbatches=4), "needs pp_size > 1"),
        (
            dict(pp_size=2, vp_size=None, num_microbatches=4, microbatch_group_size=2),
            "only applies to the interleaved",
        ),
        (
            dict(pp_size=4, vp_size=2, num_microbatches=2),
            "pp_size <= microbatch_group_size <= num_microbatches",
        ),
        (
            dict(pp_size=4, vp_size=2, num_microbatches=8, microbatch_group_size=3),
            "got pp_size=4, microbatch_group_size=3",
        ),
    ],
)
def test_schedule_info_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ScheduleInfo(**kwargs)


def test_inflight_rank_out_of_range():
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, 2\)"):
        inflight_microbatches(2, ScheduleInfo(pp_size=2, vp_size=None, num_microbatches=4))


# Auto ladder, base nf4 (4 bits), rungs 6/8/16, rounding nearest (ties -> cheaper rung).
# Targets 4 * M_max / M_r: e.g. P=8, M=16: 4, 4.57, 5.33, 6.4, 8, 10.7, 16, 32.
AUTO_CASES = [
    ((1, 1), ["nf4_b64"]),
    ((1, 8), ["nf4_b64"]),
    ((2, 1), ["nf4_b64", "nf4_b64"]),  # M < P: both stages hold 1 micro-batch
    ((2, 8), ["nf4_b64", "int8_b128"]),  # target 8
    ((4, 8), ["nf4_b64", "int6_b64", "int8_b128", "bf16"]),  # AGoQ's 4 / 5.3 / 8 / 16 ladder
    ((4, 3), ["nf4_b64", "nf4_b64", "int6_b64", "int8_b128"]),  # in flight 3,3,2,1; 12 bits ties 8|16 -> 8
    ((4, 1), ["nf4_b64"] * 4),
    ((8, 16), ["nf4_b64", "nf4_b64", "int6_b64", "int6_b64", "int8_b128", "int8_b128", "bf16", "bf16"]),
    ((8, 3), ["nf4_b64"] * 6 + ["int6_b64", "int8_b128"]),
]


@pytest.mark.parametrize("pm,expected", AUTO_CASES, ids=[f"P{c[0][0]}_M{c[0][1]}" for c in AUTO_CASES])
def test_auto_ladder_1f1b(pm, expected):
    pp, mb = pm
    assert (
        list(auto_names(_auto_spec(), ScheduleInfo(pp_size=pp, vp_size=None, num_microbatches=mb)))
        == expected
    )


def test_auto_ladder_roundings_at_pp4():
    schedule = ScheduleInfo(pp_size=4, vp_size=None, num_microbatches=8)  # targets 4, 5.33, 8, 16
    assert auto_names(_auto_spec("up"), schedule) == ("nf4_b64", "int6_b64", "int8_b128", "bf16")
    assert auto_names(_auto_spec("down"), schedule) == ("nf4_b64", "nf4_b64", "int8_b128", "bf16")


def test_auto_ladder_interleaved():
    schedule = ScheduleInfo(pp_size=4, vp_size=2, num_microbatches=8)  # in flight 11, 9, 7, 5
    # targets 4, 4.89, 6.29, 8.8 -> nearest 4, 4, 6, 8
    assert auto_names(_auto_spec(), schedule) == ("nf4_b64", "nf4_b64", "int6_b64", "int8_b128")


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_auto_ladder_invariants(rounding):
    """down never exceeds the busiest stage's memory; up never goes below the target bits;
    every stage gets at least the base; bits never fall with fewer micro-batches in flight."""
    spec = _auto_spec(rounding)
    for pp, mb, vp in itertools.product(range(1, 9), range(1, 13), (None, 2)):
        if vp is not None and (pp == 1 or mb < pp):
            continue  # Megatron's interleaved schedule needs P > 1 and M >= G = P
        schedule = ScheduleInfo(pp_size=pp, vp_size=vp, num_microbatches=mb)
        inflight = inflight_per_rank(schedule)
        bits = [NOMINAL_BITS[n] for n in auto_names(spec, schedule)]
        budget = 4 * max(inflight)
        for m, b in zip(inflight, bits, strict=True):
            assert b >= 4
            if rounding == "down":
                assert m * b <= budget, (pp, mb, vp)
            if rounding == "up":
                assert b >= min(16, target_bits(4, m, max(inflight))), (pp, mb, vp)
        pairs = sorted(zip(inflight, bits, strict=True), reverse=True)
        assert [b for _, b in pairs] == sorted(b for _, b in pairs), (pp, mb, vp)


def test_pick_rung_edges():
    rungs = [("a", 4.0), ("b", 6.0), ("c", 8.0)]
    assert pick_rung(rungs, 5.0, "nearest") == "a"  # tie -> cheaper
    assert pick_rung(rungs, 5.01, "nearest") == "b"
    assert pick_rung(rungs, 100.0, "up") == "c"  # above the top: top rung
    assert pick_rung(rungs, 3.0, "down") == "a"  # below the bottom: bottom rung
    with pytest.raises(ValueError, match=r"not one of \['nearest', 'up', 'down'\]"):
        pick_rung(rungs, 5.0, "ceil")


def test_config_agoq_auto_is_the_paper_ladder_at_pp4():
    from agoq.policy import load_policy

    spec = load_policy(CONFIG_DIR / "agoq.yaml")
    schedule = ScheduleInfo(pp_size=4, vp_size=None, num_microbatches=16)
    assert [spec.format(n).bits for n in auto_names(spec, schedule)] == [4, 6, 8, 16]


@pytest.mark.megatron
def test_inflight_matches_megatron_get_pp_rank_microbatches():
    """Cross-check against megatron-core's own warm-up arithmetic (a duck-typed communicator
    stands in for the process group; no distributed init needed)."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    for pp, vp, mb in itertools.product((2, 3, 4, 8), (None, 1, 2, 3), (1, 2, 4, 8, 12)):
        if vp is not None and mb < pp:
            continue
        schedule = ScheduleInfo(pp_size=pp, vp_size=vp, num_microbatches=mb)
        for rank in range(pp):
            group = types.SimpleNamespace(size=lambda pp=pp: pp, rank=lambda rank=rank: rank)
            comm = types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)
            total, all_warmup, warmup, _ = schedules.get_pp_rank_microbatches(
                mb, vp or 1, schedule.group_size, p2p_communicator=comm
            )
            megatron_inflight = total if all_warmup or warmup >= total else warmup + 1
            assert inflight_microbatches(rank, schedule) == megatron_inflight, (pp, vp, mb, rank)
