"""``python -m agoq.plan``: predict each stage's peak GPU memory and write the richest policy that fits.

Example (a ~1B LLaMA, PP=2, 80 GiB GPUs)::

    python -m agoq.plan --model configs/model/tiny.yaml --num-layers 16 --hidden-size 2048 \
        --ffn-hidden-size 5632 --num-attention-heads 32 --num-query-groups 8 --vocab-size 32000 \
        --tp 1 --pp 2 --mbs 4 --gbs 64 --seq 4096 --memory-budget 80GiB --out chosen.yaml

Candidates (richest first): configs/policy/{bf16,int8,agoq,int4,aggressive}.yaml, or --policies. A
policy fits when the predicted peak (agoq.plan.peak: persistent state + activations + backward / loss /
optimizer-step temporaries; accuracy in docs/benchmarks/planner.md) of every stage is within the
budget. --agoq-optimizer / --agoq-grads / --grad-reduce-in-bf16 / --recompute-granularity / --agoq-fp8 /
--agoq-smooth-swiglu / --agoq-fp8-bf16-first-layers / --agoq-fp8-bf16-last-layers describe the run as
scripts/pretrain_llama.py's flags of the same names do (FP8: the flags only, not a policy's fp8 section):
the run's ``AgoqConfig`` is built by the trainer's function (``AgoqConfig.from_flags``, same defaults) from
the --model file's values and these flags. The --model file (a trainer config, configs/model/*.yaml) gives
the shape, the layout (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``num_layers_per_virtual_pipeline_stage``, ``use_distributed_optimizer``), the batch, the vocabulary
(``tokenizer_model`` padded to ``make_vocab_size_divisible_by`` x TP as the trainer does; else 32000) and
any ``agoq_*`` settings; flags given here override it. It is read by the trainer's own loader, so a misspelt key
or a value of the wrong type stops with the file, the key and the flag, as ``--config`` does; ``vocab_size`` is
the one key the planner adds.
Exit code 0 when a policy fits (its YAML is copied to --out), 3 when none does.

Capacity mode (``--capacity``): the fewest GPUs, and the layout, on which the model trains at --memory-budget
per GPU, for Megatron's baseline (bf16 weights, fp32 gradients, Megatron's AdamW; with and without the
distributed optimizer) and each agoq preset (agoq.plan.capacity.PRESETS), searching TP / PP / DP, recompute
(none, selective, full), the distributed optimizer and the candidate policies; a table, and with --out a
JSON file. The model file gives the shape, the sequence and the global batch; its layout and agoq settings
are what the search varies, so they are not read. --vocab-size (or the file's tokenizer) is the tokenizer's
vocabulary, padded per TP as the trainer pads it. Example (LLaMA-3-8B with its 128,256-entry vocabulary)::

    python -m agoq.plan --capacity --model configs/model/llama3-8b.yaml --vocab-size 128256 --seq 4096 \
        --memory-budget 80GiB --max-gpus 8 --out capacity.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from agoq.config import (
    MASTER_CHOICES,
    OPTIMIZERS,
    RECOMPUTE_GRANULARITIES,
    ROPE_FUSIONS,
    AgoqConfig,
    float_grads_mismatch,
    torch_optimizer_state_refusal,
)
from agoq.plan import capacity
from agoq.plan.memory import Layout, ModelShape
from agoq.plan.peak import Recipe, choose_by_peak, format_peak_report, grad_bytes_per_param
from agoq.plan.recipe import recipe_of
from agoq.plan.request import AGOQ_FLAGS, PLANNER_FP8_RECIPES, PlanRequest, flag_name
from agoq.plan.storage import check_requests_on_model
from agoq.policy import SMOOTH_SWIGLU_MODES, ScheduleInfo, load_policy

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"
DEFAULT_CANDIDATES = ("bf16", "int8", "agoq", "int4", "aggressive")
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
DEFAULT_VOCAB = 32000  # without --vocab-size or a model file's tokenizer_model
MEGATRON_VOCAB_DIVISIBLE_BY = 128  # the trainer's --make-vocab-size-divisible-by default
# planner flag -> the trainer's flag (config-file key) it stands for
LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "mbs": "micro_batch_size",
               "gbs": "global_batch_size", "seq": "seq_length", "distributed_optimizer": "use_distributed_optimizer"}
LAYOUT_DEFAULTS = {"tp": 1, "pp": 1, "dp": 1, "mbs": 1, "gbs": 1, "seq": 2048, "distributed_optimizer": False}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agoq.plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model YAML (configs/model/*.yaml): shape, layout, batch, vocabulary; flags "
                                   "below override it")
    for key in SHAPE_KEYS:
        p.add_argument("--" + key.replace("_", "-"), type=int)
    for flag in ("--tp", "--pp", "--dp", "--mbs", "--gbs", "--seq"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per rank")
    p.add_argument("--distributed-optimizer", action="store_true", default=None)
    _add_agoq_flags(p)
    p.add_argument("--memory-budget", required=True, help="per GPU, e.g. 80GiB")
    p.add_argument("--policies", nargs="+", help="candidate policy YAMLs, richest first")
    p.add_argument("--out", help="write the chosen policy YAML here (with --capacity: the answers as JSON)")
    p.add_argument("--capacity", action="store_true",
                   help="report the smallest layout that fits --memory-budget for the baseline and each agoq preset")
    p.add_argument("--max-gpus", type=int, default=capacity.DEFAULT_MAX_GPUS, help="--capacity: GPUs searched")
    p.add_argument("--max-mbs", type=int, default=capacity.DEFAULT_MAX_MBS,
                   help="--capacity: largest micro-batch tried at each answer's layout")
    return p


def _add_agoq_flags(p: argparse.ArgumentParser) -> None:
    """agoq's settings: the trainer's flags, defaults from agoq.config (None: not given here)."""
    p.add_argument("--agoq-optimizer", choices=OPTIMIZERS, default=None,
                   help="torch (Megatron's AdamW, default) or an agoq optimizer (adamw, lion, sgd)")
    p.add_argument("--agoq-moments", default=None, help="agoq optimizer's state formats (default flash)")
    p.add_argument("--agoq-master", default=None, choices=MASTER_CHOICES)
    p.add_argument("--agoq-grads", default=None, metavar="FORMAT", help="8-bit gradient store, e.g. int8_b256")
    p.add_argument("--grad-reduce-in-bf16", action="store_true", default=None)
    p.add_argument("--agoq-gradient-release", action="store_true", default=None,
                   help="no gradient buffer; each parameter stepped inside backward (agoq optimizer, PP=DP=1)")
    p.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="Megatron's full recompute (one layer per group) or selective recompute of core attention")
    p.add_argument("--agoq-fp8", choices=list(PLANNER_FP8_RECIPES), default=None,
                   help="agoq's FP8 linears: weight caches, scaling state, FP8 saved inputs (agoq.plan.fp8)")
    p.add_argument("--agoq-smooth-swiglu", choices=SMOOTH_SWIGLU_MODES, default=None)
    p.add_argument("--agoq-fp8-bf16-first-layers", type=int, default=None)
    p.add_argument("--agoq-fp8-bf16-last-layers", type=int, default=None)
    p.add_argument("--rope-fusion", choices=ROPE_FUSIONS, default=None,
                   help="the trainer's --rope-fusion (default auto: agoq's fused RoPE on a GPU with agoq on; off: "
                        "Megatron's RoPE, which keeps cos / sin per layer)")


def request_of(namespace: argparse.Namespace) -> PlanRequest:
    """The one place the Namespace is read: every flag's value, typed and frozen (policies as a tuple)."""
    values = vars(namespace)
    policies = values["policies"]
    return PlanRequest(**{**values, "policies": tuple(policies) if policies is not None else None})


def parse(argv=None) -> PlanRequest:
    return request_of(build_parser().parse_args(argv))


def _gradient_line(recipe: Recipe, layout: Layout) -> str:
    held, after = grad_bytes_per_param(recipe, layout)
    extra = f" + {after:.3f} B fp32 from the reduction to zero_grad" if after else ""
    optimizer = "Megatron's Adam" if recipe.optimizer == "torch" else "agoq's optimizer"
    if layout.distributed_optimizer:
        optimizer += f", distributed over {layout.dp} rank{'s' if layout.dp > 1 else ''}"
    return f"gradients per parameter per rank: {held:.3f} B held{extra} ({recipe.grads or 'float'}; {optimizer})"


def read_model_file(path: str | None) -> dict:
    """The model file's values (a trainer config: flag names in snake_case, read and checked by the trainer's own
    loader, so a misspelt key or a value of the wrong type is an error naming the file, not skipped); the planner's
    ``vocab_size`` key too; {} without one."""
    if not path:
        return {}
    # torch-free: the trainer's command line
    from agoq.megatron.train.config_file import load_config_file
    from agoq.megatron.train.flags import build_parser

    parser = build_parser()
    parser.add_argument("--vocab-size", type=int, default=None, help="the planner's own key: the tokenizer's size")
    values = load_config_file(path, parser, flag="--model")
    _check_unmodelled(path, values)
    return values


# model-file keys that change a run's memory in ways the planner does not model: key -> (the value it models, why);
# a file that sets another value is refused (its prediction would be for the modelled value without a word)
UNMODELLED_KEYS = {
    "attention_backend": ("sdpa", "Megatron's unfused attention keeps the [b, heads, s, s] softmax for backward"),
    "fp32": (False, "fp32 parameters change the weights', gradients' and master's bytes"),
    "recompute_num_layers": (1, "full recompute is modelled one layer per group"),
    "agoq_disable": (False, "plans are for agoq's candidate policies (the bf16 candidate is the closest; capacity "
                            "mode's megatron preset is the baseline)"),
    "untie_embeddings_and_output_weights": (True, "tied embeddings (LLaMA-3.2-1B / 3B) keep one vocabulary table "
                                                  "fewer; the planner models the untied output layer"),
    "agoq_policy": (None, "the candidates are --policies (default: the shipped ones); pass --policies FILE to plan "
                          "this one"),
}


def _check_unmodelled(path: str, values: dict) -> None:
    for key, (modelled, why) in UNMODELLED_KEYS.items():
        value = values.get(key, modelled)
        if value != modelled:
            raise ValueError(f"--model {path}: {key}: {value} is not something the planner models ({why}); its "
                             f"prediction would be for {key}: {modelled}. Plan a copy of the file without the key")


def _vocab_size(cfg: dict, tp: int) -> int:
    """The trainer's padded vocabulary of the model file's tokenizer_model, else DEFAULT_VOCAB."""
    if not cfg.get("tokenizer_model"):
        return DEFAULT_VOCAB
    from agoq.data.tokenizer import Tokenizer, padded_vocab_size

    vocab = Tokenizer.load(cfg["tokenizer_model"]).vocab_size
    return padded_vocab_size(vocab, tp, cfg.get("make_vocab_size_divisible_by", MEGATRON_VOCAB_DIVISIBLE_BY))


def layout_of(request: PlanRequest, cfg: dict, config: AgoqConfig) -> Layout:
    """The planner's Layout: flags over the model file's layout and batch keys over the defaults."""
    values = {key: cfg.get(LAYOUT_KEYS.get(key, key), default) for key, default in LAYOUT_DEFAULTS.items()}
    values.update(request.given(LAYOUT_DEFAULTS))
    vpp = request.vpp
    per_chunk = cfg.get("num_layers_per_virtual_pipeline_stage")
    if vpp is None and per_chunk:
        vpp = cfg["num_layers"] // values["pp"] // per_chunk
    grad_bytes = 0 if config.optimizer.gradient_release else 2 if config.grads.reduce_in_bf16 else 4
    return Layout(vpp=vpp, grad_bytes=grad_bytes, **values)


def config_of(request: PlanRequest, cfg: dict, policy=None) -> AgoqConfig:
    """The run's AgoqConfig as the trainer builds it (AgoqConfig.from_flags): the model file's values, then
    the flags given here; ``policy``: a candidate whose fp8 / default grads sections apply under the flags, as the
    trainer applies its --agoq-policy's (None: no policy section)."""
    return AgoqConfig.from_flags({**cfg, **request.given(AGOQ_FLAGS)}, policy=policy)


def check_run_flags(values: dict, layout: Layout) -> None:
    """The trainer's refusals of flags that would do nothing or cannot run (scripts/pretrain_llama.py stops on each),
    on the model file's values with the flags given here over them: a plan for a run that cannot start, or for a
    setting the run would not keep, is an error naming the flag (2026-11-27 review: each printed a plan)."""
    optimizer = values.get("agoq_optimizer") or "torch"
    for key in ("agoq_moments", "agoq_master"):
        if values.get(key) is not None and optimizer == "torch":
            raise ValueError(torch_optimizer_state_refusal(flag_name(key), values[key]))
    grads = values.get("agoq_grads")
    mismatch = float_grads_mismatch(grads, bf16_buffer=bool(values.get("grad_reduce_in_bf16")))
    if mismatch:
        raise ValueError(f"--agoq-grads {grads} {mismatch}")
    if not values.get("agoq_gradient_release"):
        return
    # with --agoq-optimizer torch, --agoq-grads or --grad-reduce-in-bf16 AgoqConfig already refused it (config_of)
    conflicts = [(layout.distributed_optimizer, "the distributed optimizer"), (layout.tp > 1, f"TP={layout.tp}"),
                 (layout.pp > 1, f"PP={layout.pp}"), (layout.dp > 1, f"DP={layout.dp}")]
    found = [what for hit, what in conflicts if hit]
    if found:
        raise ValueError(f"--agoq-gradient-release conflicts with {', '.join(found)} (from the flags or the model "
                         "file): release keeps no gradient buffer and needs one GPU per model, as the trainer "
                         "refuses; drop --agoq-gradient-release or those settings")


def _shape_values(request: PlanRequest, cfg: dict, keys: tuple[str, ...]) -> dict:
    """The shape: each flag given here over the model file's value (None: neither)."""
    return {**{k: cfg.get(k) for k in keys}, **request.given(keys)}


def _missing_message(values: dict, model: str | None) -> str | None:
    """The shape keys neither the flags nor the --model file give (None: all given), naming the file if one was."""
    missing = [k for k, v in values.items() if v is None]
    if not missing:
        return None
    flags = ", ".join(flag_name(m) for m in missing)
    if model:
        return (f"--model {model} lacks the model shape's {', '.join(missing)}: add them to the file, or give "
                f"{flags}")
    return f"give {flags} (or a --model YAML)"


def _error(err) -> int:
    print(f"agoq.plan: error: {err}", file=sys.stderr)
    return 2


# flags capacity mode refuses: the presets and the search set them
CAPACITY_REFUSED = ("agoq_optimizer", "agoq_moments", "agoq_master", "agoq_grads", "grad_reduce_in_bf16",
                    "agoq_gradient_release", "recompute_granularity", "distributed_optimizer", "policies")


def _raw_vocab(vocab_size: int | None, cfg: dict) -> int:
    """The tokenizer's vocabulary (unpadded): --vocab-size, the model file's vocab_size or tokenizer_model."""
    if vocab_size or cfg.get("vocab_size"):
        return vocab_size or cfg["vocab_size"]
    if not cfg.get("tokenizer_model"):
        return DEFAULT_VOCAB
    from agoq.data.tokenizer import Tokenizer

    return Tokenizer.load(cfg["tokenizer_model"]).vocab_size


def _check_capacity_request(request: PlanRequest) -> None:
    refused = request.given(CAPACITY_REFUSED)
    if refused:
        flags = ", ".join(flag_name(k) for k in refused)
        raise ValueError(f"--capacity searches {flags} itself (agoq.plan.capacity.PRESETS); drop them")
    if request.max_gpus < 1:
        raise ValueError(f"--max-gpus {request.max_gpus}: need at least 1")


def _capacity_search(request: PlanRequest, cfg: dict, vocab: int) -> dict:
    """capacity.find_capacity's keywords: the sequence, the vocabulary, the batch and the flags' fixed sizes."""
    return dict(seq=request.seq or cfg.get("seq_length") or LAYOUT_DEFAULTS["seq"], vocab=vocab,
                divisible_by=cfg.get("make_vocab_size_divisible_by", MEGATRON_VOCAB_DIVISIBLE_BY), base_flags={},
                gbs=request.gbs or cfg.get("global_batch_size"), mbs=request.mbs or 1, vpp=request.vpp,
                fixed=request.given(("tp", "pp", "dp")))


def run_capacity(request: PlanRequest, cfg: dict) -> int:
    """--capacity: one answer per preset (agoq.plan.capacity), printed and written to --out as JSON."""
    _check_capacity_request(request)
    values = _shape_values(request, cfg, SHAPE_KEYS[:-1])
    missing = _missing_message(values, request.model)
    if missing:
        raise ValueError(missing)
    vocab = _raw_vocab(request.vocab_size, cfg)
    shape = ModelShape(**values, vocab_size=vocab)
    policies = {n: load_policy(POLICY_DIR / f"{n}.yaml") for n in DEFAULT_CANDIDATES}
    budget = request.memory_budget_bytes
    kw = _capacity_search(request, cfg, vocab)
    answers = [capacity.find_capacity(shape, preset, policies, budget, max_gpus=request.max_gpus,
                                      max_mbs=request.max_mbs, **kw) for preset in capacity.PRESETS]
    print(f"model {request.model or '(flags)'}: {values}, vocabulary {vocab} (padded per TP), seq {kw['seq']}, "
          f"global batch {kw['gbs'] or '2 x PP micro-batches per DP rank'}; up to {request.max_gpus} GPUs"
          + ("; the model file's layout and agoq_* settings are not read (searched)" if request.model else ""))
    print(capacity.format_table(answers, budget))
    if request.out:
        report = {"model": request.model, "shape": values, "vocab": vocab, "seq_length": kw["seq"],
                  "global_batch_size": kw["gbs"], "memory_budget_gib": round(budget / 2**30, 3),
                  "max_gpus": request.max_gpus,
                  "answers": [capacity.answer_dict(a, budget, "configs/policy") for a in answers]}
        Path(request.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {request.out}")
    return 0


def run_plan(request: PlanRequest) -> int:
    """The richest candidate policy whose predicted peak fits every stage; its YAML copied to --out."""
    try:
        cfg = read_model_file(request.model)
        config = config_of(request, cfg)
        layout = layout_of(request, cfg, config)
        values = _shape_values(request, cfg, SHAPE_KEYS)
        values["vocab_size"] = values["vocab_size"] or _vocab_size(cfg, layout.tp)  # the file's tokenizer_model
    except ValueError as err:
        return _error(err)
    missing = _missing_message(values, request.model)
    if missing:
        return _error(missing)
    try:
        check_run_flags({**cfg, **request.given(AGOQ_FLAGS)}, layout)
    except ValueError as err:
        return _error(err)
    recipe = recipe_of(config)
    paths = [Path(p) for p in request.policies or [POLICY_DIR / f"{n}.yaml" for n in DEFAULT_CANDIDATES]]
    try:
        candidates = [(p.stem, load_policy(p)) for p in paths]  # PolicyError names the file and the fix
        schedule = ScheduleInfo(layout.pp, layout.vpp, layout.num_microbatches)
        for _, policy in candidates:  # as the trainer refuses them: a rule naming a role it cannot change
            check_requests_on_model(policy, values["num_layers"], schedule)
        budget = request.memory_budget_bytes
        # a candidate's own fp8 / default grads sections change its run as the trainer would apply them (they were
        # planned as the flags' run: float gradients for a policy that stores them in 8 bits)
        recipes = {name: recipe_of(config_of(request, cfg, policy)) for name, policy in candidates}
        chosen, report = choose_by_peak(ModelShape(**values), layout, candidates, budget, recipe, recipes=recipes)
    except ValueError as err:
        return _error(err)
    print(_gradient_line(recipe, layout))
    for name, own in recipes.items():
        if (own.grads, own.fp8) != (recipe.grads, recipe.fp8):
            print(f"{name}: its own sections apply to its rows (gradients {own.grads or 'float'}, "
                  f"FP8 {own.fp8.recipe})")
    print(format_peak_report(report, budget))
    if chosen is None:
        print("no candidate policy fits: lower --mbs, raise --pp/--tp, or use the distributed optimizer")
        return 3
    print(f"chosen: {chosen}")
    if request.out:
        shutil.copyfile(paths[[n for n, _ in candidates].index(chosen)], request.out)
        print(f"wrote {request.out}")
    return 0


def main(argv=None) -> int:
    try:
        request = parse(argv)
    except ValueError as err:  # a value argparse took that the request refuses (PlanRequest names the flag)
        return _error(err)
    if not request.capacity:
        return run_plan(request)
    try:
        return run_capacity(request, read_model_file(request.model))
    except ValueError as err:
        return _error(err)


if __name__ == "__main__":
    sys.exit(main())
