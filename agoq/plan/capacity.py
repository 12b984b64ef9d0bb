"""Capacity mode of ``python -m agoq.plan``: the fewest GPUs, and the layout, on which a model trains.

For a model shape, a sequence length and a GPU memory size, every *preset* (a recipe: Megatron's baseline or
one of agoq's, ``PRESETS``) is tried on 1, 2, ... ``max_gpus`` GPUs. At each GPU count every layout the
trainer accepts is predicted with ``agoq.plan.peak.predict_peaks`` (the same per-layout predictor as the
planner's default mode and the trainer's start-up report):

- GPUs = TP x PP x DP; TP divides the attention heads and the query groups (agoq.megatron.model
  ``ParallelLayout.check``); PP divides the layers (megatron-core 0.19.2 splits them evenly; the trainer has
  no uneven-split flag);
- recompute: none, Megatron's selective (core attention) or full (one layer per group);
- the distributed optimizer where the preset allows it and DP > 1 (at DP = 1 it shards nothing);
- agoq presets: the candidate policies, richest first (``DEFAULT_CANDIDATES``): the answer names the policy
  ``python -m agoq.plan --out`` would write for that layout;
- micro-batch 1 (the least memory); the answer also reports the largest micro-batch (powers of two up to
  ``max_mbs``) that still fits at its layout, what an equal-memory comparison spends the saved memory on.

VPP is not searched: the interleaved schedule keeps more chunk-micro-batches in flight on every rank
(``agoq.policy.inflight_microbatches``), so it never lowers the peak; ``--vpp`` plans every layout with it.

Among the fitting candidates with the fewest GPUs the answer is the cheapest to run (``_preference``): no
recompute before selective before full, the richest policy, the smallest model-parallel group (TP x PP, more
data parallelism), fewer pipeline stages (less bubble), then without the distributed optimizer. Where nothing
fits on ``max_gpus`` GPUs, the layout with the lowest predicted peak is reported with the term that dominates
its peak (``TERMS``) and what would move it (``REMEDIES``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from agoq.config import AgoqConfig, flag_for
from agoq.plan.memory import GIB, Layout
from agoq.plan.peak import MASTER_BYTES, Recipe, StagePeak, predict_peaks
from agoq.plan.recipe import recipe_of
from agoq.plan.shape import ModelShape
from agoq.policy import PolicySpec

RECOMPUTE_LEVELS = (None, "selective", "full")  # preference order: the least recomputation first
DEFAULT_MAX_GPUS = 8  # one node
DEFAULT_MAX_MBS = 16
TORCH_ADAM_MASTER_SHARE = 1 / 3  # Megatron's AdamW: fp32 master of the 12 B/param (master, exp_avg, exp_avg_sq)


@dataclass(frozen=True)
class Preset:
    """One recipe the capacity search tries: the trainer's flag values (``AgoqConfig.from_flags``)."""

    name: str
    flags: dict = field(default_factory=dict)
    policies: tuple[str, ...] | None = None  # candidate policy names; None: the planner's candidates
    distributed_optimizer: bool = True  # tried where DP > 1
    one_microbatch_per_step: bool = False  # gradient release: global batch = micro-batch (PP = TP = DP = 1)

    @property
    def is_baseline(self) -> bool:
        return bool(self.flags.get("agoq_disable"))


_AGOQ_FULL = {"agoq_grads": "int8_b256", "agoq_optimizer": "adamw"}  # the benchmarks' "agoq full"
_RELEASE = {"agoq_optimizer": "adamw", "agoq_gradient_release": True}
PRESETS = (
    Preset("megatron", {"agoq_disable": True}, ("bf16",), distributed_optimizer=False),
    Preset("megatron + distributed optimizer", {"agoq_disable": True}, ("bf16",)),
    Preset("agoq activations", {}),  # the policy ladder; Megatron's Adam and fp32 gradients
    Preset("agoq full", _AGOQ_FULL),  # + 8-bit gradient store + agoq AdamW (flash moments, split24 master)
    Preset("agoq full + 4-bit moments", {**_AGOQ_FULL, "agoq_moments": "4bit"}),
    Preset("agoq release", _RELEASE, distributed_optimizer=False, one_microbatch_per_step=True),
    Preset("agoq release + 4-bit moments", {**_RELEASE, "agoq_moments": "4bit"}, distributed_optimizer=False,
           one_microbatch_per_step=True),
)

# The terms of a stage's predicted peak (``terms_of``) and what lowers each.
TERMS = ("weights", "master", "optimizer states", "grads", "activations", "logits", "temporaries", "runtime")
REMEDIES = {
    "weights": "more pipeline / tensor parallelism (weights are split only by PP and TP)",
    "master": f"the distributed optimizer (DP > 1) or agoq's split master ({flag_for('optimizer.kind')} adamw)",
    "optimizer states": "the distributed optimizer (DP > 1), agoq's 8-bit or 4-bit moments",
    "grads": f"8-bit gradients ({flag_for('grads.format')} int8_b256) or gradient release (PP = TP = DP = 1)",
    "activations": "recompute, a lower-bit activation policy, or more pipeline stages",
    "logits": "tensor parallelism (the logits are vocabulary-parallel), a shorter sequence or micro-batch",
    "temporaries": "tensor parallelism (the largest temporaries are per-layer [tokens, ffn] tensors)",
    "runtime": "nothing agoq controls (cuBLAS workspaces)",
}


@dataclass(frozen=True)
class Candidate:
    """One layout of one preset with its predicted peaks."""

    gpus: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    mbs: int
    gbs: int
    recompute: str | None
    distributed_optimizer: bool
    policy: str
    peaks: tuple[StagePeak, ...]
    recipe: Recipe

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.peaks)

    @property
    def worst(self) -> StagePeak:
        return max(self.peaks, key=lambda p: p.peak)


@dataclass(frozen=True)
class Answer:
    preset: Preset
    fits: bool
    best: Candidate | None  # the answer (fits), else the lowest-peak layout on max_gpus GPUs
    max_mbs: int | None = None  # largest micro-batch that fits at the answer's layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, gpus: int, *, tp: int | None = None, pp: int | None = None,
            dp: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(TP, PP, DP) with TP x PP x DP = ``gpus`` that the trainer accepts; given values are fixed."""
    heads = math.gcd(shape.num_attention_heads, shape.num_query_groups)
    for t in divisors(gpus):
        if heads % t or (tp is not None and t != tp):
            continue
        for p in divisors(gpus // t):
            d = gpus // (t * p)
            if shape.num_layers % p or (pp is not None and p != pp) or (dp is not None and d != dp):
                continue
            yield t, p, d


def padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    """The trainer's embedding rows (agoq.data.tokenizer.padded_vocab_size, without its torch-free import)."""
    multiple = divisible_by * tp
    return math.ceil(vocab / multiple) * multiple


def recipe_for(preset: Preset, base_flags: dict, recompute: str | None) -> Recipe:
    """The planner's Recipe of ``preset`` (the trainer's AgoqConfig of its flags) with ``recompute``."""
    flags = {**base_flags, **preset.flags, "recompute_granularity": recompute}
    return recipe_of(AgoqConfig.from_flags(flags, policy=None))


def _grad_bytes(recipe: Recipe) -> int:
    return 0 if recipe.gradient_release else 4  # the float buffer (agoq.plan.__main__.layout_of)


def _layout(c: Candidate, seq: int) -> Layout:
    return Layout(tp=c.tp, pp=c.pp, vpp=c.vpp, dp=c.dp, mbs=c.mbs, gbs=c.gbs, seq=seq,
                  distributed_optimizer=c.distributed_optimizer, grad_bytes=_grad_bytes(c.recipe))


def _global_batch(preset: Preset, gbs: int | None, mbs: int, pp: int, dp: int) -> int | None:
    """The global batch a layout runs: one micro-batch per step for release; the given one where it divides
    into micro-batch x DP; without one, enough micro-batches (2 x PP) for 1F1B's steady state."""
    if preset.one_microbatch_per_step:
        return mbs * dp
    if gbs is None:
        return mbs * dp * 2 * pp
    return gbs if gbs % (mbs * dp) == 0 else None


def _allowed(preset: Preset, tp: int, pp: int, dp: int) -> bool:
    return not preset.one_microbatch_per_step or tp == pp == dp == 1


def candidates(shape: ModelShape, preset: Preset, gpus: int, policies: dict[str, PolicySpec], *, seq: int,
               vocab: int, divisible_by: int, base_flags: dict, gbs: int | None = None, mbs: int = 1,
               vpp: int | None = None, fixed: dict | None = None) -> Iterator[Candidate]:
    """Every layout of ``preset`` on ``gpus`` GPUs, predicted (policies richest first per layout)."""
    for tp, pp, dp in layouts(shape, gpus, **(fixed or {})):
        batch = _global_batch(preset, gbs, mbs, pp, dp)
        if batch is None or not _allowed(preset, tp, pp, dp) or (vpp and (pp < 2 or shape.num_layers % (pp * vpp))):
            continue
        sized = replace(shape, vocab_size=padded_vocab(vocab, tp, divisible_by))
        for recompute in RECOMPUTE_LEVELS:
            recipe = recipe_for(preset, base_flags, recompute)
            for distopt in (False, True) if preset.distributed_optimizer and dp > 1 else (False,):
                for name in (preset.policies or tuple(policies)):
                    cand = Candidate(gpus, tp, pp, dp, vpp, mbs, batch, recompute, distopt, name, (), recipe)
                    peaks = predict_peaks(sized, _layout(cand, seq), policies[name], recipe)
                    yield replace(cand, peaks=tuple(peaks))


def _preference(c: Candidate, policy_order: tuple[str, ...]) -> tuple:
    return (RECOMPUTE_LEVELS.index(c.recompute), policy_order.index(c.policy), c.tp * c.pp, c.pp, c.tp,
            c.distributed_optimizer)


def find_capacity(shape: ModelShape, preset: Preset, policies: dict[str, PolicySpec], budget: int, *,
                  max_gpus: int = DEFAULT_MAX_GPUS, max_mbs: int = DEFAULT_MAX_MBS, **kw) -> Answer:
    """The fewest GPUs (<= ``max_gpus``) on which ``preset`` fits ``budget`` per GPU, and its layout."""
    order = preset.policies or tuple(policies)
    lowest = None
    for gpus in range(1, max_gpus + 1):
        tried = list(candidates(shape, preset, gpus, policies, **kw))
        fitting = [c for c in tried if c.peak <= budget]
        if fitting:
            best = min(fitting, key=lambda c: _preference(c, order))
            return Answer(preset, True, best, largest_mbs(shape, preset, best, policies, budget, max_mbs, **kw))
        if tried and gpus == max_gpus:
            lowest = min(tried, key=lambda c: c.peak)
    if lowest is None:  # no layout at all on max_gpus (e.g. release beyond 1 GPU): the lowest one seen
        lowest = _lowest_any(shape, preset, policies, max_gpus, **kw)
    return Answer(preset, False, lowest)


def _lowest_any(shape, preset, policies, max_gpus, **kw) -> Candidate | None:
    tried = [c for g in range(1, max_gpus + 1) for c in candidates(shape, preset, g, policies, **kw)]
    return min(tried, key=lambda c: c.peak) if tried else None


def largest_mbs(shape: ModelShape, preset: Preset, best: Candidate, policies, budget: int, max_mbs: int,
                **kw) -> int:
    """The largest power-of-two micro-batch (<= ``max_mbs``) that fits at ``best``'s layout and settings."""
    fixed = {"tp": best.tp, "pp": best.pp, "dp": best.dp}
    found, mbs = best.mbs, best.mbs * 2
    while mbs <= max_mbs:
        same = [c for c in candidates(shape, preset, best.gpus, {best.policy: policies[best.policy]},
                                      **{**kw, "mbs": mbs, "fixed": fixed})
                if c.recompute == best.recompute and c.distributed_optimizer == best.distributed_optimizer]
        if not same or same[0].peak > budget:
            break
        found, mbs = mbs, mbs * 2
    return found


def terms_of(p: StagePeak, recipe: Recipe) -> dict[str, int]:
    """The bytes of each of ``TERMS`` at stage ``p``'s peak (its phase: DDP construction, forward/backward or
    the optimizer step); they add up to ``p.peak``."""
    if p.phase == "DDP construction":
        return {"weights": p.weights, "grads": p.construction - p.weights}
    master = int(p.optimizer * _master_share(recipe))
    out = {"weights": p.weights, "master": master, "optimizer states": p.optimizer - master, "grads": p.grads,
           "runtime": p.runtime + p.fp8}
    if p.phase == "optimizer step":
        return {**out, "temporaries": p.step_extra}
    logits_transient = p.transient if p.transient_source.startswith("LM-head") else 0
    return {**out, "activations": p.held - p.head_held, "logits": p.head_held + logits_transient,
            "temporaries": p.transient - logits_transient}


def _master_share(recipe: Recipe) -> float:
    if recipe.optimizer == "torch":
        return TORCH_ADAM_MASTER_SHARE
    from agoq.formats import parse_format

    moments = sum(parse_format(m).bytes_per_element() for m in recipe.moments)
    master = MASTER_BYTES[recipe.master]
    return master / (master + moments) if master + moments else 0.0


def dominant_term(c: Candidate) -> str:
    terms = terms_of(c.worst, c.recipe)
    return max(terms, key=terms.get)


def answer_dict(a: Answer, budget: int, policy_dir: str) -> dict:
    """The JSON record of one preset's answer."""
    out = {"preset": a.preset.name, "flags": a.preset.flags, "fits": a.fits}
    c = a.best
    if c is None:
        return {**out, "note": "no layout of this preset exists up to the GPU limit"}
    out.update(gpus=c.gpus, tp=c.tp, pp=c.pp, dp=c.dp, vpp=c.vpp, micro_batch_size=c.mbs, global_batch_size=c.gbs,
               recompute=c.recompute, distributed_optimizer=c.distributed_optimizer,
               policy=None if a.preset.is_baseline else f"{policy_dir}/{c.policy}.yaml",
               peak_gib=round(c.peak / GIB, 3), stage_peaks_gib=[round(p.peak / GIB, 3) for p in c.peaks],
               worst_stage=c.worst.pp_rank, phase=c.worst.phase,
               terms_gib={k: round(v / GIB, 3) for k, v in terms_of(c.worst, c.recipe).items()},
               dominant_term=dominant_term(c), budget_gib=round(budget / GIB, 3))
    if a.fits:
        out["max_micro_batch_size"] = a.max_mbs
    else:
        out["what_would_move_it"] = REMEDIES[out["dominant_term"]]
    return out


def format_table(answers: list[Answer], budget: int) -> str:
    head = (f"{'preset':<32} {'fits':>4} {'GPUs':>4} {'TP':>3} {'PP':>3} {'DP':>3} {'VPP':>3} {'mbs':>3} "
            f"{'recompute':<9} {'dist-opt':<8} {'policy':<10} {'peak GiB':>8} {'max mbs':>7}  dominant term")
    lines = [f"smallest layout per preset at {budget / GIB:.2f} GiB per GPU (agoq.plan.peak)", head]
    for a in answers:
        c = a.best
        if c is None:
            lines.append(f"{a.preset.name:<32} {'no':>4}  (no layout up to the GPU limit)")
            continue
        lines.append(
            f"{a.preset.name:<32} {'yes' if a.fits else 'no':>4} {c.gpus:>4} {c.tp:>3} {c.pp:>3} {c.dp:>3} "
            f"{c.vpp or '-':>3} {c.mbs:>3} {c.recompute or 'none':<9} {'yes' if c.distributed_optimizer else 'no':<8} "
            f"{'-' if a.preset.is_baseline else c.policy:<10} {c.peak / GIB:>8.2f} {a.max_mbs or '-':>7}  "
            f"{dominant_term(c)}" + ("" if a.fits else f" (lowest peak on {c.gpus} GPUs; "
                                                       f"{REMEDIES[dominant_term(c)]})"))
    return "\n".join(lines)


def candidate_dict(c: Candidate) -> dict:
    """The layout fields of a candidate (tests and benchmarks rebuild the per-layout prediction from them)."""
    return {k: v for k, v in asdict(c).items() if k not in ("peaks", "recipe")}
