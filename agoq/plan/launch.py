"""``python -m agoq.plan --gpus N``: the fastest predicted layout that fits on N GPUs, and the ``torchrun`` command
that launches ``scripts/pretrain_llama.py`` with it.

Searched: TP x PP x DP = N (as agoq.plan.capacity.layouts: TP divides the heads and query groups, PP the layers),
the micro-batch (powers of two up to --max-mbs whose global batch divides), recompute (none, selective, full), the
distributed optimizer (where DP > 1), the agoq preset (agoq.plan.capacity.PRESETS' agoq ones; the flags' own
optimizer / gradient settings where any is given) and the candidate policies, richest first. What the command line
fixes (a layout size, the micro-batch, recompute, ``--use-distributed-optimizer`` from either source) is not searched.
The layouts are visited fastest first by agoq.plan.speed (a model with stated constants); the first whose predicted
peak (agoq.plan.peak) fits every stage wins, ties going to the larger micro-batch, the earlier preset, the richer
policy and capacity's preference (smaller model-parallel group, fewer stages, no distributed optimizer)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from agoq.plan import capacity, speed
from agoq.plan.capacity import Candidate, Preset
from agoq.plan.headroom import EXPANDABLE, FRAGMENTATION_GIB, needs_expandable
from agoq.plan.memory import GIB
from agoq.plan.peak import predict_peaks
from agoq.plan.request import PLANNED_AGOQ_KEYS, PlanRequest
from agoq.plan.shape import ModelShape
from agoq.policy import PolicySpec

RECIPE_KEYS = ("agoq_optimizer", "agoq_moments", "agoq_master", "agoq_grads", "grad_reduce_in_bf16",
               "agoq_gradient_release")  # the settings a preset chooses; a flag among them makes the run's own preset
SCRIPT = "scripts/pretrain_llama.py"


@dataclass(frozen=True)
class Search:
    gpus: int
    seq: int
    divisible_by: int
    gbs: int | None = None  # None: 2 x PP micro-batches per data-parallel rank (capacity._global_batch)
    mbs: int | None = None  # None: searched
    max_mbs: int = capacity.DEFAULT_MAX_MBS
    recompute: str | None = None  # None: searched
    distributed_optimizer: bool | None = None  # True: asked for (the trainer cannot turn it off); None: searched
    fixed: dict = field(default_factory=dict)  # tp / pp / dp given on the command line
    per_chunk: int | None = None  # --num-layers-per-virtual-pipeline-stage (needs a fixed PP)


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    preset: Preset
    base_flags: dict
    time: speed.StepTime
    seq: int


def presets_for(values: dict) -> tuple[tuple[Preset, ...], dict]:
    """(the presets to try, the flags under each): the run's own settings where any of RECIPE_KEYS is given, else
    capacity's agoq presets without gradient release (it needs one GPU, --clip-grad 0 and no gradient buffer flags:
    give --agoq-gradient-release to plan it)."""
    given = {k: values[k] for k in PLANNED_AGOQ_KEYS if values.get(k) is not None and k != "recompute_granularity"}
    if any(k in given for k in RECIPE_KEYS):
        release = bool(given.get("agoq_gradient_release"))
        return (Preset("the flags' own", {}, None, distributed_optimizer=not release,
                       one_microbatch_per_step=release),), given
    return tuple(p for p in capacity.PRESETS if not p.is_baseline and not p.one_microbatch_per_step), given


def _micro_batches(search: Search) -> list[int]:
    if search.mbs is not None:
        return [search.mbs]
    out, m = [], 1
    while m <= search.max_mbs:
        out.append(m)
        m *= 2
    return out


def _vpp(shape: ModelShape, pp: int, search: Search) -> int | None:
    if not search.per_chunk:
        return None
    if "pp" not in search.fixed:
        raise ValueError("--num-layers-per-virtual-pipeline-stage with --gpus needs --pipeline-model-parallel-size "
                         "on the command line (the chunk count follows the stage size)")
    if shape.num_layers % (pp * search.per_chunk):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {search.per_chunk} does not divide the "
                         f"{shape.num_layers // pp} layers of each of the {pp} stages")
    return shape.num_layers // pp // search.per_chunk


def _slots(shape: ModelShape, presets: tuple[Preset, ...], search: Search):
    """(time, tie-break, layout) of every layout, micro-batch, recompute and distributed-optimizer setting."""
    recomputes = (search.recompute,) if search.recompute else capacity.RECOMPUTE_LEVELS
    for tp, pp, dp in capacity.layouts(shape, search.gpus, **search.fixed):
        vpp = _vpp(shape, pp, search)
        sized = replace(shape, vocab_size=capacity.padded_vocab(shape.vocab_size, tp, search.divisible_by))
        for mbs in _micro_batches(search):
            for recompute in recomputes:
                distopts = (True,) if search.distributed_optimizer else (False, True) if dp > 1 else (False,)
                for distopt in distopts:
                    for index, preset in enumerate(presets):
                        gbs = capacity._global_batch(preset, search.gbs, mbs, pp, dp)
                        if gbs is None or not capacity._allowed(preset, tp, pp, dp):
                            continue
                        if distopt and not preset.distributed_optimizer and not search.distributed_optimizer:
                            continue
                        t = speed.step_time(sized, tp=tp, pp=pp, vpp=vpp, dp=dp, mbs=mbs, gbs=gbs, seq=search.seq,
                                            recompute=recompute)
                        order = (round(t.total, 9), -mbs, index, tp * pp, pp, tp, distopt)
                        yield order, (tp, pp, dp, vpp, mbs, gbs, recompute, distopt, preset, sized, t)


def fastest(shape: ModelShape, presets_and_flags, policies: dict[str, PolicySpec], budget: int,
            search: Search) -> tuple[Choice | None, int]:
    """The fastest fitting layout (fastest first, the first that fits), and how many layouts were predicted."""
    presets, base_flags = presets_and_flags
    tried = 0
    for _, (tp, pp, dp, vpp, mbs, gbs, recompute, distopt, preset, sized, t) in sorted(
            _slots(shape, presets, search), key=lambda item: item[0]):
        recipe = capacity.recipe_for(preset, base_flags, recompute)
        for name in preset.policies or tuple(policies):
            cand = Candidate(search.gpus, tp, pp, dp, vpp, mbs, gbs, recompute, distopt, name, (), recipe)
            peaks = predict_peaks(sized, capacity._layout(cand, search.seq), policies[name], recipe)
            tried += 1
            cand = replace(cand, peaks=tuple(peaks))
            if cand.peak <= budget:
                return Choice(cand, preset, base_flags, t, search.seq), tried
    return None, tried




def allocator_env(choice: Choice, budget: int) -> dict[str, str]:
    """The environment a launch needs for its allocator: expandable segments when the predicted peak is within
    FRAGMENTATION_GIB of ``budget``, else nothing."""
    return dict(EXPANDABLE) if needs_expandable(choice.candidate.peak, budget) else {}


def describe(choice: Choice, budget: int) -> str:
    c, t = choice.candidate, choice.time
    tokens = c.gbs * choice.seq / t.total
    tight = ([f"margin {(budget - c.peak) / GIB:.2f} GiB is under the allocator's measured fragmentation "
              f"({FRAGMENTATION_GIB} GiB): the command sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
              "(without it this stage can run out of memory after its first iteration)"]
             if allocator_env(choice, budget) else [])
    return "\n".join([
        f"fastest that fits: TP={c.tp} PP={c.pp} DP={c.dp}{f' VPP={c.vpp}' if c.vpp else ''}, micro-batch {c.mbs}, "
        f"global batch {c.gbs}, recompute {c.recompute or 'none'}, distributed optimizer "
        f"{'yes' if c.distributed_optimizer else 'no'}, preset {choice.preset.name}, policy {c.policy}",
        f"predicted peak {c.peak / GIB:.2f} GiB of {budget / GIB:.2f} (stages: "
        f"{', '.join(f'{p.peak / GIB:.2f}' for p in c.peaks)}); modelled step {t.total:.3f} s, {tokens:,.0f} tokens/s "
        f"(compute {t.compute:.3f}, recompute {t.recompute:.3f}, TP all-reduces {t.tp_comm:.3f}, pipeline bubble "
        f"{t.bubble:.3f}; agoq.plan.speed: H100 constants, a ranking model, not a measurement)", *tight])


def _render(dest: str, value, actions) -> list[str]:
    """The command-line words of one trainer flag's value (its longest option string, as the trainer spells it)."""
    action = actions[dest]
    flag = max(action.option_strings, key=len)
    if isinstance(value, bool):
        return [flag] if value == action.const else []  # store_true: True; store_false (--no-...): False
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def command(choice: Choice, request: PlanRequest, policy_paths: list[Path], values: dict,
            env: dict[str, str] | None = None) -> str:
    """``torchrun ... scripts/pretrain_llama.py`` with the --config file, the command line's trainer flags and the
    chosen layout, batch, recompute, distributed optimizer, preset flags and policy; ``env`` (allocator_env) is
    written before ``torchrun`` as NAME=VALUE words."""
    from agoq.cli.flags import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    c = choice.candidate
    chosen = {"tensor_model_parallel_size": c.tp, "pipeline_model_parallel_size": c.pp, "micro_batch_size": c.mbs,
              "global_batch_size": c.gbs}
    if c.vpp:
        chosen["num_layers_per_virtual_pipeline_stage"] = request.num_layers_per_virtual_pipeline_stage
    if c.distributed_optimizer and not values.get("use_distributed_optimizer"):
        chosen["use_distributed_optimizer"] = True
    if c.recompute:
        chosen["recompute_granularity"] = c.recompute
    chosen.update({**choice.base_flags, **choice.preset.flags})
    policy = next(p for p in policy_paths if p.stem == c.policy)
    chosen["agoq_policy"] = _relative(policy)
    trainer_fields = [k for k in actions if hasattr(request, k) and k != "config"]
    own = {k: v for k, v in request.given(trainer_fields).items() if k not in chosen}
    words = [*(f"{k}={v}" for k, v in (env or {}).items()), "torchrun", "--standalone", "--nproc-per-node",
             str(c.gpus), SCRIPT]
    if request.config:
        words += ["--config", request.config]
    for dest, value in [*own.items(), *((k, v) for k, v in request.trainer if k not in chosen), *chosen.items()]:
        words += _render(dest, value, actions)
    return shlex.join(words)


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
