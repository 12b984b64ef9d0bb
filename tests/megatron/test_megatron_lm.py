"""agoq in Megatron-LM's trainer (agoq/train/megatron_lm.py, agoq/megatron/megatron_lm.py,
scripts/pretrain_gpt_agoq.py)
on the CPU.

* flags: ``add_agoq_args`` on Megatron's own parser (no clash with its ~1000 flags) offers every ``--agoq-*``
  flag of scripts/pretrain_llama.py with the same choices;
* config: Megatron's parsed args give the same ``AgoqConfig`` as pretrain_llama.py's for every benchmark
  variant, and the documented Megatron flags give pretrain_llama.py's ``TransformerConfig``;
* errors: combinations agoq cannot run raise, naming the flag and the fix;
* patches: the handle's ``undo()`` puts Megatron's own objects back (identical), installing twice is refused;
* end to end: ``megatron.training.pretrain`` runs on the CPU (tests/megatron/_megatron_lm_cpu.py) and its
  losses are the same bits as pretrain_llama.py's, for the baseline and agoq's presets (GPU twin:
  tests/gpu/test_megatron_lm_gpu.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from agoq.testing.procs import REPO_ROOT
from tests.megatron._megatron_lm_runs import BENCH, launch, megatron_cpu_command, ok, pretrain_llama_command

DATA = {"prefix": "/data/text_document", "tokenizer": str(REPO_ROOT / "pyproject.toml")}  # parsing only


def _megatron_args(monkeypatch, argv: list[str]) -> argparse.Namespace:
    """Megatron's parse_args + validate_args with agoq's flags (no global state: no tokenizer, no timers)."""
    from megatron.training.arguments import parse_args, validate_args

    from agoq.train.megatron_lm import add_agoq_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_agoq.py", *argv])
    args = parse_args(extra_args_provider=add_agoq_args)
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args)
    return args


def _bench_megatron_argv(variant: str, extra: tuple[str, ...] = ()) -> list[str]:
    command = BENCH.megatron_command("tiny", 20, BENCH.VARIANTS[variant], DATA, REPO_ROOT / "x.jsonl", 1)
    argv = command[command.index(str(BENCH.MEGATRON_SCRIPT)) + 1:]
    at = argv.index("--agoq-log-json")
    return argv[:at] + argv[at + 2:] + list(extra)


# -- flags ------------------------------------------------------------------------------------------

def test_agoq_flags_join_megatron_parser_and_cover_the_trainer_flags():
    from megatron.training.arguments import add_megatron_arguments

    from agoq.train.args import build_parser
    from agoq.train.megatron_lm import add_agoq_args

    parser = add_agoq_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))  # raises on a clash
    ours = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--agoq-")}
    trainer = {o: a for a in build_parser()._actions for o in a.option_strings if o.startswith("--agoq-")}
    # --agoq-device: megatron.training is CUDA-only; --agoq-attention is the trainer's --attention-backend
    assert set(trainer) - {"--agoq-device"} <= set(ours), set(trainer) - set(ours)
    for flag in set(trainer) - {"--agoq-device"}:
        assert ours[flag].dest == trainer[flag].dest, flag
        assert ours[flag].choices == trainer[flag].choices, flag
    assert ours["--agoq-attention"].choices == ("sdpa", "megatron")


# -- config -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(BENCH.VARIANTS))
def test_config_equals_the_trainers_for_the_same_flags(monkeypatch, variant):
    from agoq.train.args import parse_args as trainer_parse_args
    from agoq.train.megatron_lm import agoq_config_from_megatron_args

    ours = agoq_config_from_megatron_args(_megatron_args(monkeypatch, _bench_megatron_argv(variant)))
    trainer = trainer_parse_args([*BENCH.common_flags("tiny", 20), *BENCH.TRAINER_EQUIVALENCE_FLAGS,
                                  *BENCH.VARIANTS[variant]]).agoq_config
    assert ours.device == "cuda"
    assert dataclasses.replace(ours, device=trainer.device) == trainer


# fields whose difference cannot change a single-GPU run's numbers (pretrain_llama.py vs Megatron's flags)
NEUTRAL_FIELDS = {
    "use_cpu_initialization": "False vs None (falsy both)",
    "batch_p2p_sync": "pipeline-parallel p2p only",
    "deallocate_pipeline_outputs": "pipeline-parallel only",
    "cp_comm_type": "context parallelism only",
    "inference_sampling_seed": "inference only",
    "transformer_impl": "the layer spec is built by agoq, not from this field",
    "tensor_parallel_num_weight_shards": "None vs 1: one shard",
    "expert_tensor_parallel_num_weight_shards": "None vs 1: one shard",
    "init_method": "compared by its keywords below",
    "output_layer_init_method": "compared by its keywords below",
    "embedding_init_method": "compared by its keywords below",
}


def test_documented_megatron_flags_give_the_trainers_transformer_config(monkeypatch):
    from megatron.training.argument_utils import core_transformer_config_from_args

    from agoq.megatron.model import LlamaShape, ParallelLayout, llama_transformer_config

    layers, hidden, heads, groups, ffn, seq, _, _ = BENCH.SIZES["tiny"]
    ours = core_transformer_config_from_args(_megatron_args(monkeypatch, _bench_megatron_argv("agoq_default")))
    shape = LlamaShape(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                       ffn_hidden_size=ffn, seq_length=seq, vocab_size=4096)
    trainer = llama_transformer_config(shape, ParallelLayout(), params_dtype=torch.bfloat16,
                                       use_cpu_initialization=False)
    differ = [f.name for f in dataclasses.fields(trainer)
              if f.name not in NEUTRAL_FIELDS and getattr(trainer, f.name) != getattr(ours, f.name)]
    assert differ == [], {name: (getattr(trainer, name), getattr(ours, name)) for name in differ}
    for name in ("init_method", "output_layer_init_method", "embedding_init_method"):
        assert getattr(trainer, name).func is getattr(ours, name).func, name
        assert getattr(trainer, name).keywords == getattr(ours, name).keywords, name


# -- errors -----------------------------------------------------------------------------------------

REFUSED = [  # (flags added to the agoq_default command, error type, words the message must hold)
    (["--transformer-impl", "transformer_engine", "--agoq-fp8", "delayed"], ValueError,
     ["--agoq-fp8", "--fp8-format hybrid --fp8-recipe delayed", "--transformer-impl local"]),
    (["--transformer-impl", "inference_optimized"], ValueError, ["--transformer-impl inference_optimized",
                                                                 "local or transformer_engine"]),
    (["--reset-attention-mask"], ValueError, ["--reset-attention-mask", "--agoq-attention megatron"]),
    (["--spec", "local"], ValueError, ["--spec local", "drop --spec"]),
    (["--agoq-gradient-release"], NotImplementedError, ["--agoq-gradient-release", "scripts/pretrain_llama.py"]),
    (["--agoq-disable", "--agoq-grads", "int8_b256"], ValueError, ["--agoq-disable", "drop --agoq-grads"]),
    (["--agoq-disable", "--agoq-optimizer", "adamw"], ValueError, ["--agoq-disable", "--agoq-optimizer"]),
    (["--agoq-moments", "fp8"], ValueError, ["--agoq-moments", "--agoq-optimizer adamw"]),
    (["--agoq-optimizer", "adamw", "--optimizer", "sgd"], ValueError, ["--optimizer sgd", "drop --optimizer"]),
    (["--agoq-optimizer", "adamw", "--use-precision-aware-optimizer"], ValueError,
     ["--use-precision-aware-optimizer", "drop one"]),
    (["--agoq-optimizer", "adamw", "--decoupled-lr", "1e-3"], ValueError, ["--decoupled-lr", "drop one"]),
    (["--agoq-optimizer", "adamw", "--use-mup"], ValueError, ["--use-mup", "drop one"]),
    (["--agoq-optimizer", "adamw", "--apply-wd-to-qk-layernorm"], ValueError,
     ["--apply-wd-to-qk-layernorm", "drop one"]),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"], ValueError,
     ["--recompute-modules core_attn mlp", "--recompute-modules core_attn"]),
    (["--attention-dropout", "0.1"], ValueError, ["--attention-dropout", "--agoq-attention megatron"]),
    (["--fp16"], ValueError, ["--fp16", "--bf16"]),
    (["--agoq-grads", "uint8_b256"], ValueError, ["--agoq-grads uint8_b256", "signed"]),
]


def test_transformer_engine_with_agoq_on_is_taken(monkeypatch):
    """Megatron-LM's default --transformer-impl transformer_engine with agoq on: TE's layers with agoq's scopes,
    gradients and optimizer (agoq.megatron.te); the local spec's attention checks do not apply."""
    from agoq.megatron import te
    from agoq.train.megatron_lm import agoq_config_from_megatron_args, uses_transformer_engine

    monkeypatch.setattr(te, "te_available", lambda: True)  # the checks of the flags, as on a machine with TE
    argv = _without(_bench_megatron_argv("agoq_full"), "--transformer-impl", 1)
    args = _megatron_args(monkeypatch, argv + ["--transformer-impl", "transformer_engine", "--attention-dropout",
                                               "0.1"])
    assert uses_transformer_engine(args) and agoq_config_from_megatron_args(args).enabled


def _without(argv: list[str], flag: str, nargs: int) -> list[str]:
    at = argv.index(flag)
    return argv[:at] + argv[at + 1 + nargs:]


@pytest.mark.parametrize(("extra", "error", "words"), REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_unsupported_combinations_name_the_flag_and_the_fix(monkeypatch, extra, error, words):
    from agoq.train.megatron_lm import MegatronLMRefusal, agoq_config_from_megatron_args

    argv = _bench_megatron_argv("agoq_default")
    if "--fp16" in extra:
        argv = _without(argv, "--bf16", 0)
    if "--transformer-impl" in extra:
        argv = _without(argv, "--transformer-impl", 1)
    args = _megatron_args(monkeypatch, argv + extra)
    with pytest.raises(error) as info:
        agoq_config_from_megatron_args(args)
    assert isinstance(info.value, MegatronLMRefusal)  # the door prints it as one line (no traceback)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert "--attention-backend megatron" not in str(info.value)  # agoq's trainer's flag, not Megatron-LM's


def test_the_baseline_takes_transformer_engine_and_recipe_flags_are_taken_over_with_a_line(monkeypatch):
    """--agoq-disable runs Megatron as the flags say (Transformer Engine included; nothing taken over); with agoq on,
    Megatron-LM's default --persist-layer-norm and --gradient-accumulation-fusion are turned off, one line each."""
    from agoq.train.megatron_lm import agoq_config_from_megatron_args, take_over_recipe_flags

    recipe = [w for w in _bench_megatron_argv("agoq_default")
              if w not in ("--no-persist-layer-norm", "--no-gradient-accumulation-fusion")]
    base = _megatron_args(monkeypatch, _without(recipe, "--transformer-impl", 1) + ["--agoq-disable"])
    assert base.transformer_impl == "transformer_engine" and not agoq_config_from_megatron_args(base).enabled
    assert take_over_recipe_flags(base) == [] and base.gradient_accumulation_fusion and not base.no_persist_layer_norm
    args = _megatron_args(monkeypatch, recipe)
    assert args.gradient_accumulation_fusion and not args.no_persist_layer_norm  # Megatron-LM's defaults
    notes = take_over_recipe_flags(args)
    assert len(notes) == 2 and "--persist-layer-norm" in notes[0] and "--gradient-accumulation-fusion" in notes[1]
    assert not args.gradient_accumulation_fusion and args.no_persist_layer_norm
    assert take_over_recipe_flags(args) == []  # nothing left to take over


@pytest.mark.parametrize(("dest", "flag"), [("swiglu", "--swiglu"), ("normalization", "--normalization RMSNorm"),
                                            ("add_bias_linear", "--disable-bias-linear")])
def test_non_llama_model_flags_are_refused_with_agoq_on(monkeypatch, dest, flag):
    from agoq.train.megatron_lm import agoq_config_from_megatron_args

    args = _megatron_args(monkeypatch, _bench_megatron_argv("agoq_default"))
    setattr(args, dest, {"swiglu": False, "normalization": "LayerNorm", "add_bias_linear": True}[dest])
    with pytest.raises(ValueError, match=flag):
        agoq_config_from_megatron_args(args)
    args.agoq_disable = True  # the plain Megatron model takes any of Megatron's architectures
    assert not agoq_config_from_megatron_args(args).enabled


# -- patches ----------------------------------------------------------------------------------------

def _patchable():
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.models.dist_utils as dist_utils
    import megatron.training.training as mtt

    return (mtt.DDP, mtt.get_megatron_optimizer, dataset_utils.compile_helpers, dist_utils.DistributedDataParallel,
            mtt.setup_model_and_optimizer, mtt.build_train_valid_test_datasets)


@pytest.fixture
def training_module():
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.training as mtt

    originals = _patchable()
    yield mtt, dataset_utils, originals
    assert _patchable() == originals, "a test left a patch"


def test_the_model_provider_refuses_the_policies_the_trainer_refuses():
    """Megatron-LM's door checks the policy as scripts/pretrain_llama.py does: a rule deciding no site, and a rule
    naming a role it cannot change (agoq.megatron.megatron_lm._check_policy, called by the model provider)."""
    from agoq.megatron.megatron_lm import _check_policy
    from agoq.policy import ScheduleInfo, policy_from_dict

    def spec(when: dict, fmt: str):
        return policy_from_dict({"version": 1, "default": {"activations": "int8_b128"},
                                 "rules": [{"when": when, "set": {"activations": fmt}}]}, source="p.yaml")

    schedule = ScheduleInfo(pp_size=2, vp_size=None, num_microbatches=4)
    with pytest.raises(ValueError, match=r"p.yaml: rules\[0\] sets activations: bf16 for mlp.fc1_input"):
        _check_policy(spec({"role": "mlp.fc1_input"}, "bf16"), 4, schedule)
    with pytest.raises(ValueError, match=r"p.yaml: rules\[0\] decide no site of this model"):
        _check_policy(spec({"layers": 9}, "bf16"), 4, schedule)
    _check_policy(spec({"role": "attn.proj_input"}, "bf16"), 4, schedule)  # takes effect: fine


@pytest.mark.parametrize("variant", ["baseline", "agoq_default", "agoq_full"])
def test_install_patches_what_the_config_needs_and_undo_restores_megatron(monkeypatch, training_module, variant):
    import megatron.training.models.dist_utils as dist_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.distributed import DistributedDataParallel

    from agoq.megatron.ckpt.queue_server import PicklingQueueProxy
    from agoq.megatron.install import marked_seam
    from agoq.megatron.megatron_lm import install_for_megatron_training
    from agoq.train.megatron_lm import agoq_config_from_megatron_args

    mtt, dataset_utils, originals = training_module
    ddp, factory, compile_helpers, builder_ddp, setup, datasets = originals
    config = agoq_config_from_megatron_args(_megatron_args(monkeypatch, _bench_megatron_argv(variant)))
    queue_before = filesystem_async._results_queue
    handle = install_for_megatron_training(config)
    try:
        # every variant, agoq off too: Megatron-LM's saves report through agoq's queue server
        assert isinstance(filesystem_async._results_queue, PicklingQueueProxy)
        assert marked_seam(dataset_utils.compile_helpers) == "megatron_training.dataset_helpers"
        assert marked_seam(mtt.build_train_valid_test_datasets) == "megatron_training.empty_splits"
        if variant == "agoq_full":
            assert marked_seam(mtt.DDP) == "megatron_training.ddp"
            assert issubclass(mtt.DDP, DistributedDataParallel)  # train() checks isinstance(chunk, DDP)
            assert dist_utils.DistributedDataParallel is mtt.DDP  # the model builder's path: the same class
            assert marked_seam(mtt.get_megatron_optimizer) == "megatron_training.optimizer"
        else:
            assert mtt.DDP is ddp and mtt.get_megatron_optimizer is factory
            assert dist_utils.DistributedDataParallel is builder_ddp
        assert (marked_seam(mtt.setup_model_and_optimizer) == "megatron_training.built_check") == (
            variant != "baseline")
        with pytest.raises(RuntimeError, match="already patched"):
            install_for_megatron_training(config)
    finally:
        handle.undo()
    assert (mtt.DDP, mtt.get_megatron_optimizer, dataset_utils.compile_helpers, dist_utils.DistributedDataParallel,
            mtt.setup_model_and_optimizer, mtt.build_train_valid_test_datasets) == originals
    assert filesystem_async._results_queue is queue_before


@pytest.mark.parametrize("agoq_on", [True, False])
def test_install_fills_the_rope_slot_for_megatron_lms_rope_fusion_with_agoq_on(monkeypatch, training_module, agoq_on):
    """Megatron-LM's --rope-fusion is on by default and needs a fused RoPE (TransformerConfig refuses it with an empty
    slot): with agoq on the door fills the slot with agoq's RoPE, undone with the handle; --agoq-disable leaves
    Megatron as it is; --no-rope-fusion leaves the slot empty."""
    from megatron.core.models.common.embeddings import rope_utils

    from agoq.megatron.megatron_lm import install_for_megatron_training
    from agoq.megatron.rope import agoq_fused_apply_rotary_pos_emb, rope_fusion_provider
    from agoq.train.megatron_lm import agoq_config_from_megatron_args

    argv = [w for w in _bench_megatron_argv("agoq_default" if agoq_on else "baseline") if w != "--no-rope-fusion"]
    config = agoq_config_from_megatron_args(_megatron_args(monkeypatch, argv))
    assert config.rope_fusion == "agoq" and rope_fusion_provider() == "none"
    handle = install_for_megatron_training(config)
    try:
        expected = agoq_fused_apply_rotary_pos_emb if agoq_on else None
        assert rope_utils.fused_apply_rotary_pos_emb is expected
    finally:
        handle.undo()
    assert rope_fusion_provider() == "none"
    plain = agoq_config_from_megatron_args(_megatron_args(monkeypatch, _bench_megatron_argv("agoq_default")))
    handle = install_for_megatron_training(plain)  # --no-rope-fusion: nothing to serve
    try:
        assert plain.rope_fusion == "off" and rope_fusion_provider() == "none"
    finally:
        handle.undo()


def test_compile_helpers_runs_no_make_when_the_wheels_module_imports(monkeypatch, training_module):
    """The 0.19.2 wheel has helpers_cpp but no Makefile: Megatron's compile_helpers runs make, which fails, and
    exits the process. agoq's replacement skips make when the compiled module imports."""
    from agoq.megatron.megatron_lm import _compile_helpers_if_missing

    _, dataset_utils, _ = training_module
    from megatron.core.datasets import helpers_cpp  # noqa: F401 (the wheel's compiled module)

    ran = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: ran.append(a) or subprocess.CompletedProcess(a, 2))
    with pytest.raises(SystemExit):
        dataset_utils.compile_helpers()  # Megatron's own: make fails -> sys.exit(1)
    ran.clear()
    _compile_helpers_if_missing(dataset_utils.compile_helpers)()
    assert ran == []


def test_megatron_training_contract_holds():
    from agoq.megatron import compat
    from agoq.megatron.megatron_lm import MEGATRON_TRAINING_CONTRACT

    assert compat.contract_problems(MEGATRON_TRAINING_CONTRACT) == []


# -- end to end on the CPU --------------------------------------------------------------------------

CPU_ITERS = 3


@pytest.fixture(scope="module")
def default_data(agoq_cache):
    from agoq.train.data import ensure_default_dataset

    paths = ensure_default_dataset(agoq_cache)
    return {"prefix": str(paths.prefix), "tokenizer": str(paths.tokenizer_model)}


def _run(command: list[str], tmp_path, log_name: str) -> list[float]:
    return ok(launch(command, tmp_path, log_name)).losses


# case -> (flags for megatron.training, flags for pretrain_llama.py[, equivalence flags left out of the first]);
# Megatron's full recompute names its method; "agoq_rope": Megatron-LM's default rope fusion, which the door serves
# with agoq's RoPE (the reference on the CPU) as pretrain_llama.py --rope-fusion agoq does
CPU_CASES = {
    "baseline": (BENCH.VARIANTS["baseline"], BENCH.VARIANTS["baseline"]),
    "agoq_default": (BENCH.VARIANTS["agoq_default"], BENCH.VARIANTS["agoq_default"]),
    "agoq_full_distopt": (BENCH.VARIANTS["agoq_full_distopt"], BENCH.VARIANTS["agoq_full_distopt"]),
    "agoq_recompute_full": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                             "--recompute-num-layers", "1"], ["--recompute-granularity", "full"]),
    "agoq_rope": (BENCH.VARIANTS["agoq_default"], [*BENCH.VARIANTS["agoq_default"], "--rope-fusion", "agoq"],
                  ("--no-rope-fusion",)),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_megatron_training_on_cpu_trains_as_pretrain_llama(default_data, tmp_path, case):
    """scripts/pretrain_gpt_agoq.py (the door's reference script) trains as pretrain_llama.py, bit for bit; and its
    --agoq-log-json agrees with Megatron's log line at every iteration (issue 42: the record of iteration 2 said
    8.322104 and the log line 8.327531). Both were right about different things: Megatron's training_log prints the
    first iteration without resetting its sum, so with --log-interval 1 the line of iteration 2 shows the mean of
    iterations 1 and 2; the record keeps each iteration's own loss (lm_loss, equal to pretrain_llama.py's) and, where
    Megatron prints a line, the value it prints (megatron_log_lm_loss)."""
    megatron_flags, own_flags, *dropped = CPU_CASES[case]
    iters = ["--train-iters", str(CPU_ITERS)]
    megatron = megatron_cpu_command(default_data, tmp_path, "m.jsonl", [*megatron_flags, *iters])
    megatron = [word for word in megatron if word not in (dropped[0] if dropped else ())]
    assert ("--no-rope-fusion" in megatron) != (case == "agoq_rope")
    own = pretrain_llama_command(default_data, tmp_path, "a.jsonl", [*own_flags, *iters])
    with ThreadPoolExecutor(2) as pool:
        ours, theirs = pool.map(lambda job: ok(launch(job[0], tmp_path, job[1])), [(megatron, "m.jsonl"),
                                                                                      (own, "a.jsonl")])
    assert len(ours.losses) == CPU_ITERS and ours.losses == theirs.losses, (ours.losses, theirs.losses)
    printed = ours.megatron_log_lines()
    recorded = {r["iteration"]: r for r in ours.records if "iteration" in r}
    assert sorted(printed) == sorted(recorded) == list(range(1, CPU_ITERS + 1)), (printed, recorded)
    for iteration, text in printed.items():  # --log-interval 1: a line every iteration
        assert f"{recorded[iteration]['megatron_log_lm_loss']:.6E}" == text, (iteration, text, recorded[iteration])
    first, second = ours.losses[:2]
    assert recorded[2]["megatron_log_lm_loss"] == pytest.approx((first + second) / 2, rel=1e-6)
    assert recorded[1]["megatron_log_lm_loss"] == first and recorded[3]["megatron_log_lm_loss"] == ours.losses[2]


OVERLAP_FLAGS = {"agoq_full_distopt": ("--overlap-grad-reduce", "--overlap-param-gather")}


# agoq_full (no distributed optimizer) runs in the extended tier (pyproject.toml): megatron.training's save and load of
# agoq's states is CI's in agoq_full_distopt (the layout Megatron-LM users run), and the unsharded optimizer's
# checkpoint in tests/megatron/test_resume.py
@pytest.mark.parametrize("variant", [pytest.param("agoq_full", marks=pytest.mark.extended), "agoq_full_distopt"])
def test_megatron_save_and_load_resume_bit_identically(default_data, tmp_path, variant):
    """Megatron's own --save / --exit-interval / --load with agoq's optimizer states (compressed, through
    sharded_state_dict) and 8-bit gradients: the resumed iterations equal the uninterrupted run's. On the CPU
    --no-load-rng: the test driver has no CUDA RNG state to restore (dropout is 0, nothing draws from it).
    The distributed-optimizer variant adds Megatron-LM's own --overlap-grad-reduce --overlap-param-gather: agoq
    neither refuses nor drops them (Megatron-LM's loop toggles the DDP forward pre-hooks around the first step
    and the saves and asserts they exist; one rank, so the gathers move nothing)."""
    flags = [*BENCH.VARIANTS[variant], *OVERLAP_FLAGS.get(variant, ()), "--train-iters", "4"]
    ckpt = str(tmp_path / "ckpt")
    straight = _run(megatron_cpu_command(default_data, tmp_path, "a.jsonl", flags), tmp_path, "a.jsonl")
    first = _run(megatron_cpu_command(default_data, tmp_path, "b.jsonl", [*flags, "--save", ckpt, "--save-interval",
                                                                           "2", "--exit-interval", "2"]),
                 tmp_path, "b.jsonl")
    resumed = _run(megatron_cpu_command(default_data, tmp_path, "c.jsonl", [*flags, "--load", ckpt, "--no-load-rng"]),
                   tmp_path, "c.jsonl")
    assert len(straight) == 4 and first == straight[:2] and resumed == straight[2:], (straight, first, resumed)


# -- the documented commands --------------------------------------------------------------------------

def _documented_command() -> list[str]:
    import re
    import shlex

    text = (REPO_ROOT / "docs" / "megatron_lm.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
             if "pretrain_gpt_agoq.py" in line and not line.lstrip().startswith("#")]
    assert len(lines) == 1, lines
    tokens = shlex.split(lines[0])
    return tokens[tokens.index("scripts/pretrain_gpt_agoq.py") + 1:]


@pytest.mark.parametrize("preset", [["--agoq-disable"], [], ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256"],
                                    ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256",
                                     "--use-distributed-optimizer"]], ids=["baseline", "default", "full", "distopt"])
def test_documented_command_and_presets_pass_megatrons_and_agoqs_checks(monkeypatch, preset):
    """docs/megatron_lm.md's command (with each preset of its table) through Megatron's parse + validate and
    agoq's config; the docs check (tests/unit/test_docs_commands.py) only parses it."""
    from agoq.train.megatron_lm import agoq_config_from_megatron_args

    argv = _documented_command() + preset
    config = agoq_config_from_megatron_args(_megatron_args(monkeypatch, argv))
    assert config.enabled == ("--agoq-disable" not in preset)
    missing = {f for f in BENCH.MEGATRON_EQUIVALENCE_FLAGS if f.startswith("--")} - set(argv)
    assert missing == set(), f"docs/megatron_lm.md's command lacks the reproducing flags {sorted(missing)}"
