"""``python -m agoq.plan``: predict each stage's peak GPU memory and write the richest policy that fits; with
``--gpus N`` the fastest layout that fits on N GPUs and the ``torchrun`` command that launches it.

The planner takes ``scripts/pretrain_llama.py``'s own flags and ``--config`` files (agoq.cli: one definition of each
flag), so the trainer's command line plans as it is::

    python -m agoq.plan --config configs/model/llama3-8b.yaml --gpus 8
    python -m agoq.plan --config configs/model/llama-1b.yaml --pipeline-model-parallel-size 2 --micro-batch-size 4 \
        --global-batch-size 64 --memory-budget 80GiB --out chosen.yaml

The model is what the trainer would build from the --config file's values with the flags given here over them (the
shape, the layout, the batch and any agoq settings); the trainer's flags that do not change memory (``--lr``,
``--data-path``, ...) are taken and passed on to the launch command. The vocabulary is the model's: ``--vocab-size``
(the trainer's flag, also a --config key), else the ``--tokenizer-model`` file's, padded to
``--make-vocab-size-divisible-by`` x TP as the trainer pads it; neither is an error naming both. ``--memory-budget``
(a GPU's memory: ``80GiB``, ``80GB`` or a byte count) defaults to the smallest GPU ``nvidia-smi`` lists, else 80 GiB;
predictions must fit it less agoq.plan.headroom.OUTSIDE_ALLOCATOR_GIB (the CUDA context), and the line that
starts the report says both. ``--dp`` (the trainer takes it from the world size) is the planner's own.

Default mode: candidates (richest first) configs/policy/{bf16,int8,agoq,int4,aggressive}.yaml, or --policies; a
policy fits when the predicted peak (agoq.plan.peak: persistent state + activations + backward / loss /
optimizer-step temporaries; accuracy in docs/benchmarks/planner.md) of every stage is within the budget. Exit code 0
when a policy fits (its YAML is copied to --out), 3 when none does.

``--gpus N`` (agoq.plan.launch): every layout on N GPUs (TP x PP x DP), micro-batch, recompute, the distributed
optimizer and agoq preset (the flags' own agoq settings where given), each with the candidate policies; the fitting
one with the shortest predicted step (agoq.plan.speed) is printed with its command. A layout or recompute flag given on
the command line is kept; the --config file's layout is what the search replaces. Exit code 3 when nothing fits.

``--transformer-impl transformer_engine`` (agoq.plan.te, agoq.plan.te_cli): one GPU on Megatron's TE spec, with
Megatron-LM's ``--fp8-format hybrid --fp8-recipe delayed`` or bf16, agoq on or ``--agoq-disable`` (Megatron + TE
alone); it prints which terms TE changes and refuses, in one line, what it does not model.

Capacity mode (``--capacity``): the fewest GPUs, and the layout, on which the model trains at --memory-budget
per GPU, for Megatron's baseline (bf16 weights, fp32 gradients, Megatron's AdamW; with and without the
distributed optimizer) and each agoq preset (agoq.plan.capacity.PRESETS); a table, and with --out a JSON file::

    python -m agoq.plan --capacity --config configs/model/llama3-8b.yaml --seq-length 4096 --memory-budget 80GiB \
        --max-gpus 8 --out capacity.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

from agoq.cli.agoq_flags import PRESET_FLAG, load_preset, merge_preset
from agoq.cli.config_file import load_config_file
from agoq.cli.flags import build_parser as trainer_parser
from agoq.cli.seqpar_args import sequence_parallel_problem
from agoq.config import AgoqConfig, flag_for
from agoq.config.values import float_grads_mismatch, torch_optimizer_state_refusal
from agoq.plan import capacity, launch, te, te_cli
from agoq.plan.headroom import OUTSIDE_ALLOCATOR_GIB, allocator_budget
from agoq.plan.memory import GIB, Layout
from agoq.plan.peak import Recipe, choose_by_peak, format_peak_report, grad_bytes_per_param
from agoq.plan.recipe import recipe_of
from agoq.plan.request import PLANNED_AGOQ_KEYS, PlanRequest, flag_name
from agoq.plan.shape import SHAPE_FIELDS, ModelShape
from agoq.plan.storage import check_requests_on_model, sequence_parallel_note
from agoq.policy import ScheduleInfo, load_policy

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"
DEFAULT_CANDIDATES = ("bf16", "int8", "agoq", "int4", "aggressive")
SHAPE_KEYS = tuple(k for k in SHAPE_FIELDS if k != "vocab_size")  # what --config gives; the tokenizer the vocabulary
MEGATRON_VOCAB_DIVISIBLE_BY = 128  # the trainer's --make-vocab-size-divisible-by default
DEFAULT_BUDGET_GIB = 80  # without --memory-budget and without a GPU nvidia-smi lists (an H100 80GB's size class)
# the planner's layout defaults where neither the flags nor the --config file set a value (trainer flag names)
LAYOUT_DEFAULTS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "dp": 1, "micro_batch_size": 1,
                   "global_batch_size": 1, "seq_length": 2048, "use_distributed_optimizer": False}
# the planner's flags before it took the trainer's (2026-12): each is named with its replacement
RENAMED = {"--model": "--config", "--tp": "--tensor-model-parallel-size", "--pp": "--pipeline-model-parallel-size",
           "--mbs": "--micro-batch-size", "--gbs": "--global-batch-size", "--seq": "--seq-length",
           "--vpp": "--num-layers-per-virtual-pipeline-stage (layers per virtual stage, as the trainer counts)",
           "--distributed-optimizer": "--use-distributed-optimizer"}


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser (agoq.cli.flags, every flag and its type and choices) with every default None (a flag
    not given leaves the --config file's value, then the planner's default) and the planner's own flags."""
    p = trainer_parser()
    p.prog, p.description = "python -m agoq.plan", __doc__.splitlines()[0]
    p.epilog = "The flags above the planner's group are scripts/pretrain_llama.py's (its --help has their defaults)."
    p.set_defaults(**{a.dest: None for a in p._actions if a.dest != "help"})
    g = p.add_argument_group("planner (python -m agoq.plan's own flags)")
    g.add_argument("--memory-budget", default=None,
                   help="a GPU's memory: 80GiB, 80GB or a byte count (default: the smallest GPU nvidia-smi lists, "
                        f"else 80GiB); predictions must fit it less {OUTSIDE_ALLOCATOR_GIB} GiB (CUDA context)")
    g.add_argument("--gpus", type=int, default=None,
                   help="the fastest layout that fits on this many GPUs, and the torchrun command to launch it")
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default 1; --gpus: GPUs / (TP x PP))")
    g.add_argument("--policies", nargs="+", help="candidate policy YAMLs, richest first")
    g.add_argument("--out", help="write the chosen policy YAML here (with --capacity: the answers as JSON)")
    g.add_argument("--capacity", action="store_true", default=False,
                   help="report the smallest layout that fits --memory-budget for the baseline and each agoq preset")
    g.add_argument("--max-gpus", type=int, default=capacity.DEFAULT_MAX_GPUS, help="--capacity: GPUs searched")
    g.add_argument("--max-mbs", type=int, default=capacity.DEFAULT_MAX_MBS,
                   help="--capacity / --gpus: largest micro-batch tried")
    te.add_arguments(p)
    return p


OWN_FIELDS = frozenset(f.name for f in fields(PlanRequest)) - {"trainer"}


def request_of(namespace: argparse.Namespace) -> PlanRequest:
    """The one place the Namespace is read: the planner's fields typed and frozen, the trainer's other flags that were
    given kept as (destination, value) pairs."""
    values = dict(vars(namespace))
    own = {k: values.pop(k) for k in list(values) if k in OWN_FIELDS}
    trainer = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in values.items() if v is not None)
    policies = own["policies"]
    return PlanRequest(**{**own, "policies": tuple(policies) if policies is not None else None}, trainer=trainer)


def parse(argv=None) -> PlanRequest:
    argv = sys.argv[1:] if argv is None else list(argv)
    for word in argv:
        name = word.split("=", 1)[0]
        if name in RENAMED:
            raise ValueError(f"{name} is now the trainer's {RENAMED[name]} (python -m agoq.plan takes "
                             "scripts/pretrain_llama.py's flags)")
    return request_of(build_parser().parse_args(argv))


def default_budget(probe=None) -> tuple[int, str]:
    """(bytes, where from) without --memory-budget: the smallest GPU ``nvidia-smi`` lists, else DEFAULT_BUDGET_GIB.
    ``probe``: a function returning nvidia-smi's MiB per GPU (tests); torch-free, so no CUDA context either."""
    try:
        mib = (probe or _nvidia_smi_mib)()
    except (OSError, ValueError, subprocess.SubprocessError):
        mib = []
    if mib:
        return min(mib) * 2**20, f"the smallest visible GPU's memory ({min(mib)} MiB, nvidia-smi)"
    return DEFAULT_BUDGET_GIB * GIB, f"no GPU visible: the stated default {DEFAULT_BUDGET_GIB} GiB"


def _nvidia_smi_mib() -> list[int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    return [int(line) for line in out.split() if line.strip()]


def budget_of(request: PlanRequest, probe=None) -> int:
    """The bytes a prediction may take per GPU: --memory-budget (a GPU's memory) or the default, less the memory a
    process holds outside PyTorch's allocator (OUTSIDE_ALLOCATOR_GIB); both and where they came from are printed."""
    if request.memory_budget is not None:
        gpu, source = request.memory_budget_bytes, f"--memory-budget {request.memory_budget}"
    else:
        gpu, source = default_budget(probe)
        source += "; --memory-budget to change"
    budget = allocator_budget(gpu)
    if budget <= 0:
        raise ValueError(f"--memory-budget {gpu / GIB:.2f} GiB leaves nothing for training: a process holds "
                         f"{OUTSIDE_ALLOCATOR_GIB} GiB outside PyTorch's allocator (CUDA context); give a GPU's memory")
    print(f"memory budget: {gpu / GIB:.2f} GiB per GPU ({source}); {budget / GIB:.2f} GiB of it for PyTorch's "
          f"allocator ({OUTSIDE_ALLOCATOR_GIB} GiB outside it: CUDA context, measured on an H100)")
    return budget


def _gradient_line(recipe: Recipe, layout: Layout) -> str:
    held, after = grad_bytes_per_param(recipe, layout)
    extra = f" + {after:.3f} B fp32 from the reduction to zero_grad" if after else ""
    optimizer = "Megatron's Adam" if recipe.optimizer == "torch" else "agoq's optimizer"
    if layout.distributed_optimizer:
        optimizer += f", distributed over {layout.dp} rank{'s' if layout.dp > 1 else ''}"
    return f"gradients per parameter per rank: {held:.3f} B held{extra} ({recipe.grads or 'float'}; {optimizer})"


PLANNER_ONLY = ("memory_budget", "config", "policies", "out", "capacity", "max_gpus", "max_mbs", "gpus")


def read_model_file(path: str | None) -> dict:
    """The --config file's values (the trainer's model YAML, read and checked by the trainer's own loader: a
    misspelt key or a value of the wrong type is an error naming the file); {} without one."""
    if not path:
        return {}
    return load_config_file(path, trainer_parser())


def read_files(request: PlanRequest) -> dict:
    """The --config file's values with the --agoq-preset file's over them, as the trainer merges them (a key in
    both is an error; the command line wins over both)."""
    cfg = read_model_file(request.config)
    preset = dict(request.trainer).get("agoq_preset")
    return merge_preset(cfg, preset, request.config) if preset else cfg


def values_of(request: PlanRequest, cfg: dict) -> dict:
    """The run's flag values as the trainer would merge them, without its defaults: the --config file's, then the
    command line's (the planner's trainer-named fields and the trainer's other flags)."""
    given = request.given(f for f in OWN_FIELDS if f not in PLANNER_ONLY)
    values = {**cfg, **dict(request.trainer), **given}
    _check_unmodelled(values, request, cfg)
    return values


# settings that change a run's memory in ways the planner does not model: key -> (the value it models, why); a run
# that sets another value is refused (its prediction would be for the modelled value without a word)
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
    "cuda_graph_impl": ("none", "CUDA graphs keep static input/output buffers the planner does not model"),
}


def _check_unmodelled(values: dict, request: PlanRequest, cfg: dict) -> None:
    problem = te.local_problem(values)
    if problem:
        raise ValueError(problem)
    preset = dict(request.trainer).get("agoq_preset")
    preset_keys = load_preset(preset).keys() if preset else ()
    for key, (modelled, why) in UNMODELLED_KEYS.items():
        if key == "agoq_disable" and te.is_te(values):
            continue  # the TE path plans Megatron + TE alone (agoq.plan.te_cli)
        value = values.get(key, modelled)
        if value != modelled:
            where = (flag_name(key) if key in dict(request.trainer) else f"{PRESET_FLAG} {preset}: {key}"
                     if key in preset_keys else f"--config {request.config}: {key}" if key in cfg else flag_name(key))
            fix = ("plan a copy of the file without the key" if where.startswith("--config") else "plan another "
                   "preset" if where.startswith(PRESET_FLAG) else "drop the flag")
            raise ValueError(f"{where}: {value} is not something the planner models ({why}); its prediction would "
                             f"be for {key}: {modelled}. {fix[0].upper()}{fix[1:]}")


def raw_vocab(values: dict) -> int:
    """The model's vocabulary before padding: --vocab-size (flag or --config key), else the --tokenizer-model file's;
    neither is an error naming both (no default: LLaMA-3 has 128,256 entries, LLaMA-2 32,000)."""
    vocab, tokenizer = values.get("vocab_size"), values.get("tokenizer_model")
    if tokenizer:
        from agoq.data.tokenizer import Tokenizer, model_vocab_size

        return model_vocab_size(Tokenizer.load(tokenizer).vocab_size, vocab, f"--tokenizer-model {tokenizer}")
    if vocab:
        return vocab
    raise ValueError("the vocabulary is unknown: give --vocab-size N (the model's vocabulary, e.g. 128256 for "
                     "LLaMA-3, 32000 for LLaMA-2) or --tokenizer-model FILE, on the command line or as vocab_size / "
                     "tokenizer_model in the --config file (the trainer without either trains the built-in corpus's "
                     "tokenizer: --vocab-size 4096 plans that)")


def divisible_by(values: dict) -> int:
    return values.get("make_vocab_size_divisible_by") or MEGATRON_VOCAB_DIVISIBLE_BY


def layout_of(values: dict, config: AgoqConfig) -> Layout:
    """The planner's Layout: the merged values' layout and batch keys over LAYOUT_DEFAULTS."""
    v = {key: values.get(key) if values.get(key) is not None else default for key, default in LAYOUT_DEFAULTS.items()}
    per_chunk = values.get("num_layers_per_virtual_pipeline_stage")
    pp = v["pipeline_model_parallel_size"]
    vpp = values["num_layers"] // pp // per_chunk if per_chunk and values.get("num_layers") else None
    grad_bytes = 0 if config.optimizer.gradient_release else 2 if config.grads.reduce_in_bf16 else 4
    return Layout(tp=v["tensor_model_parallel_size"], pp=pp, vpp=vpp, dp=v["dp"], mbs=v["micro_batch_size"],
                  gbs=v["global_batch_size"], seq=v["seq_length"], distributed_optimizer=v["use_distributed_optimizer"],
                  grad_bytes=grad_bytes, sequence_parallel=bool(values.get("sequence_parallel")))


def config_of(values: dict, policy=None) -> AgoqConfig:
    """The run's AgoqConfig as the trainer builds it (AgoqConfig.from_flags) from the merged values; ``policy``: a
    candidate whose fp8 / default grads sections apply under the flags, as the trainer applies its --agoq-policy's
    (None: no policy section)."""
    return AgoqConfig.from_flags({k: v for k, v in values.items() if k in PLANNED_AGOQ_KEYS}, policy=policy)


def check_run_flags(values: dict, layout: Layout) -> None:
    """The trainer's refusals of flags that would do nothing or cannot run (scripts/pretrain_llama.py stops on each),
    on the merged values: a plan for a run that cannot start, or for a setting the run would not keep, is an error
    naming the flag (2026-11-27 review: each printed a plan)."""
    optimizer = values.get("agoq_optimizer") or "torch"
    for key in ("agoq_moments", "agoq_master"):
        if values.get(key) is not None and optimizer == "torch":
            raise ValueError(torch_optimizer_state_refusal(flag_name(key), values[key]))
    grads = values.get("agoq_grads")
    mismatch = float_grads_mismatch(grads, bf16_buffer=bool(values.get("grad_reduce_in_bf16")))
    if mismatch:
        raise ValueError(f"{flag_for('grads.format')} {grads} {mismatch}")
    if values.get("sequence_parallel"):  # the trainer's refusals (agoq.cli.seqpar_args), on the merged values
        problem = sequence_parallel_problem(tp=layout.tp, seq_length=layout.seq, fp8=config_of(values).fp8)
        if problem:
            raise ValueError(problem)
    if not values.get("agoq_gradient_release"):
        return
    # with --agoq-optimizer torch, --agoq-grads or --grad-reduce-in-bf16 AgoqConfig already refused it (config_of)
    conflicts = [(layout.distributed_optimizer, "the distributed optimizer"), (layout.tp > 1, f"TP={layout.tp}"),
                 (layout.pp > 1, f"PP={layout.pp}"), (layout.dp > 1, f"DP={layout.dp}")]
    found = [what for hit, what in conflicts if hit]
    if found:
        raise ValueError(f"{flag_for('optimizer.gradient_release')} conflicts with {', '.join(found)} (from the flags "
                         "or the --config file): release keeps no gradient buffer and needs one GPU per model, as the "
                         f"trainer refuses; drop {flag_for('optimizer.gradient_release')} or those settings")


def shape_of(values: dict, config: str | None) -> ModelShape:
    """The model shape with its vocabulary before padding (raw_vocab), or a ValueError naming the keys neither the
    flags nor the --config file give. The query groups and the FFN width default as the trainer derives them."""
    missing = [k for k in SHAPE_KEYS if values.get(k) is None and k not in DERIVED]
    if missing:
        flags = ", ".join(flag_name(m) for m in missing)
        raise ValueError(f"--config {config} lacks the model shape's {', '.join(missing)}: add them to the file, or "
                         f"give {flags}" if config else f"give {flags} (or a --config YAML)")
    dims = {k: values.get(k) if values.get(k) is not None else DERIVED[k](values) for k in SHAPE_KEYS}
    return ModelShape(**dims, vocab_size=raw_vocab(values))


# the trainer's derived defaults (agoq.train.args._fill_derived): MHA, and LLaMA's 8/3 x hidden rounded up
# to a multiple of 64
DERIVED = {"num_query_groups": lambda v: v["num_attention_heads"],
           "ffn_hidden_size": lambda v: 64 * -(-int(8 * v["hidden_size"] / 3) // 64)}


def _error(err) -> int:
    print(f"agoq.plan: error: {err}", file=sys.stderr)
    return 2


# flags capacity mode refuses: the presets and the search set them
CAPACITY_REFUSED = ("agoq_optimizer", "agoq_moments", "agoq_master", "agoq_grads", "grad_reduce_in_bf16",
                    "agoq_gradient_release", "recompute_granularity", "use_distributed_optimizer", "policies")


def _check_capacity_request(request: PlanRequest) -> None:
    refused = request.given(CAPACITY_REFUSED)
    if refused:
        flags = ", ".join(flag_name(k) for k in refused)
        raise ValueError(f"--capacity searches {flags} itself (agoq.plan.capacity.PRESETS); drop them")
    if request.max_gpus < 1:
        raise ValueError(f"--max-gpus {request.max_gpus}: need at least 1")


def _capacity_search(request: PlanRequest, values: dict, vocab: int) -> dict:
    """capacity.find_capacity's keywords: the sequence, the vocabulary, the batch and the command line's sizes."""
    per_chunk = request.num_layers_per_virtual_pipeline_stage
    pp = request.pipeline_model_parallel_size
    fixed = {"tp": request.tensor_model_parallel_size, "pp": pp, "dp": request.dp}
    return dict(seq=values.get("seq_length") or LAYOUT_DEFAULTS["seq_length"], vocab=vocab,
                divisible_by=divisible_by(values), base_flags={}, gbs=values.get("global_batch_size"),
                mbs=request.micro_batch_size or 1,
                vpp=values["num_layers"] // pp // per_chunk if per_chunk and pp else None,
                fixed={k: v for k, v in fixed.items() if v is not None})


def run_capacity(request: PlanRequest, cfg: dict) -> int:
    """--capacity: one answer per preset (agoq.plan.capacity), printed and written to --out as JSON."""
    _check_capacity_request(request)
    values = values_of(request, cfg)
    _refuse_te(values, "--capacity")
    _refuse_sequence_parallel_search(values, "--capacity")
    shape = shape_of(values, request.config)
    vocab = shape.vocab_size
    policies = {n: load_policy(POLICY_DIR / f"{n}.yaml") for n in DEFAULT_CANDIDATES}
    budget = budget_of(request)
    kw = _capacity_search(request, values, vocab)
    if kw["vpp"] is not None and not request.pipeline_model_parallel_size:
        raise ValueError("--num-layers-per-virtual-pipeline-stage with --capacity needs "
                         "--pipeline-model-parallel-size on the command line")
    answers = [capacity.find_capacity(shape, preset, policies, budget, max_gpus=request.max_gpus,
                                      max_mbs=request.max_mbs, **kw) for preset in capacity.PRESETS]
    dims = {k: getattr(shape, k) for k in SHAPE_KEYS}
    print(f"model {request.config or '(flags)'}: {dims}, vocabulary {vocab} (padded per TP), seq {kw['seq']}, "
          f"global batch {kw['gbs'] or '2 x PP micro-batches per DP rank'}; up to {request.max_gpus} GPUs"
          + ("; the --config file's layout and agoq_* settings are not read (searched)" if request.config else ""))
    print(capacity.format_table(answers, budget))
    if request.out:
        report = {"model": request.config, "shape": dims, "vocab": vocab, "seq_length": kw["seq"],
                  "global_batch_size": kw["gbs"], "memory_budget_gib": round(budget / GIB, 3),
                  "gpu_memory_gib": round(budget / GIB + OUTSIDE_ALLOCATOR_GIB, 3),
                  "outside_allocator_gib": OUTSIDE_ALLOCATOR_GIB,
                  "max_gpus": request.max_gpus,
                  "answers": [capacity.answer_dict(a, budget, "configs/policy") for a in answers]}
        Path(request.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {request.out}")
    return 0


def run_plan(request: PlanRequest, cfg: dict) -> int:
    """The richest candidate policy whose predicted peak fits every stage; its YAML copied to --out."""
    values = values_of(request, cfg)
    config = config_of(values)
    layout = layout_of(values, config)
    shape = shape_of(values, request.config)
    shape = replace(shape, vocab_size=capacity.padded_vocab(shape.vocab_size, layout.tp, divisible_by(values)))
    check_run_flags(values, layout)
    recipe = recipe_of(config)
    paths = [Path(p) for p in request.policies or [POLICY_DIR / f"{n}.yaml" for n in DEFAULT_CANDIDATES]]
    if te.is_te(values):
        return te_cli.run_te(request, values, shape, layout, lambda pol: recipe_of(config_of(values, pol)), paths,
                             lambda: budget_of(request))
    candidates = [(p.stem, load_policy(p)) for p in paths]  # PolicyError names the file and the fix
    schedule = ScheduleInfo(layout.pp, layout.vpp, layout.num_microbatches)
    for _, policy in candidates:  # as the trainer refuses them: a rule naming a role it cannot change
        check_requests_on_model(policy, shape.num_layers, schedule)
    budget = budget_of(request)
    # a candidate's own fp8 / default grads sections change its run as the trainer would apply them (they were
    # planned as the flags' run: float gradients for a policy that stores them in 8 bits)
    recipes = {name: recipe_of(config_of(values, policy)) for name, policy in candidates}
    chosen, report = choose_by_peak(shape, layout, candidates, budget, recipe, recipes=recipes)
    print(_gradient_line(recipe, layout))
    if layout.sequence_parallel:
        print(sequence_parallel_note(layout.tp))
    for name, own in recipes.items():
        if (own.grads, own.fp8) != (recipe.grads, recipe.fp8):
            print(f"{name}: its own sections apply to its rows (gradients {own.grads or 'float'}, "
                  f"FP8 {own.fp8.recipe})")
    print(format_peak_report(report, budget))
    if chosen is None:
        print("no candidate policy fits: lower --micro-batch-size, raise --pipeline-model-parallel-size / "
              "--tensor-model-parallel-size, or use --use-distributed-optimizer (or --gpus N: the layout search)")
        return 3
    print(f"chosen: {chosen}")
    if request.out:
        shutil.copyfile(paths[[n for n, _ in candidates].index(chosen)], request.out)
        print(f"wrote {request.out}")
    return 0


def _refuse_te(values: dict, mode: str) -> None:
    impl = values.get("transformer_impl")
    if impl is not None:  # the search launches scripts/pretrain_llama.py, which builds agoq's local spec
        raise ValueError(f"{mode} with --transformer-impl {impl}: not modelled (the search plans agoq's local spec; "
                         f"the TE path plans one GPU's fixed layout): drop {mode.split()[0]} or --transformer-impl")


def _refuse_sequence_parallel_search(values: dict, mode: str) -> None:
    if values.get("sequence_parallel"):
        raise ValueError(f"{mode} searches layouts without sequence parallelism (TP=1 layouts cannot take it); plan "
                         "a fixed layout instead: drop " + mode.split()[0] + " and give --tensor-model-parallel-size N "
                         "--sequence-parallel (or drop --sequence-parallel)")


def run_gpus(request: PlanRequest, cfg: dict) -> int:
    """--gpus N: the fastest predicted layout that fits (agoq.plan.launch) and its torchrun command."""
    values = values_of(request, cfg)
    _refuse_sequence_parallel_search(values, "--gpus N")
    _refuse_te(values, "--gpus N")
    check_run_flags(values, Layout())
    shape = shape_of(values, request.config)
    budget = budget_of(request)
    paths = [Path(p) for p in request.policies or [POLICY_DIR / f"{n}.yaml" for n in DEFAULT_CANDIDATES]]
    policies = {p.stem: load_policy(p) for p in paths}
    fixed = {"tp": request.tensor_model_parallel_size, "pp": request.pipeline_model_parallel_size,
             "dp": request.dp}
    search = launch.Search(
        gpus=request.gpus, seq=values.get("seq_length") or LAYOUT_DEFAULTS["seq_length"],
        divisible_by=divisible_by(values), gbs=values.get("global_batch_size"),
        mbs=request.micro_batch_size, max_mbs=request.max_mbs, recompute=request.recompute_granularity,
        distributed_optimizer=True if values.get("use_distributed_optimizer") else None,
        fixed={k: v for k, v in fixed.items() if v is not None},
        per_chunk=request.num_layers_per_virtual_pipeline_stage)
    presets = launch.presets_for(values)
    best, tried = launch.fastest(shape, presets, policies, budget, search)
    print(f"model {request.config or '(flags)'}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
          f"{shape.num_attention_heads} heads / {shape.num_query_groups} query groups, FFN {shape.ffn_hidden_size}, "
          f"vocabulary {shape.vocab_size}; seq {search.seq}, {request.gpus} GPUs; {tried} layouts predicted")
    if best is None:
        print(f"nothing fits {budget / GIB:.2f} GiB (PyTorch's share) per GPU on {request.gpus} GPUs: more GPUs "
              "(python -m agoq.plan "
              "--capacity), a shorter --seq-length, or a larger --memory-budget")
        return 3
    print(launch.describe(best, budget))
    command = launch.command(best, request, paths, values, launch.allocator_env(best, budget))
    print("launch it with:")
    print("  " + command)
    if values.get("tokenizer_model") and not values.get("data_path"):
        print("  (the trainer reads --tokenizer-model only with --data-path: add the data written with it)")
    return 0


def main(argv=None) -> int:
    try:
        request = parse(argv)
        request.memory_budget_bytes  # noqa: B018 - a bad --memory-budget is the first error, before any file is read
        cfg = read_files(request)
        if request.capacity:
            return run_capacity(request, cfg)
        if request.gpus is not None:
            return run_gpus(request, cfg)
        return run_plan(request, cfg)
    except ValueError as err:  # a value the request, the config file, the vocabulary or a policy refuses
        return _error(err)


if __name__ == "__main__":
    sys.exit(main())
