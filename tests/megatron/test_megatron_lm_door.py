"""agoq's zero-edit door to Megatron-LM (``python -m agoq.megatron_lm SCRIPT <flags>``,
agoq/train/megatron_lm_door.py) on the CPU, through megatron.training's real ``pretrain``
(tests/megatron/_megatron_lm_cpu.py), on a ``pretrain_gpt.py`` of megatron.training 0.19's shapes
(tests/megatron/_pretrain_gpt_shapes.py, no agoq import):

* both construction paths (the config container with a model config, Megatron-LM core_r0.19.0's way, and a model
  provider) with ``--agoq-grads int8_b256 --agoq-optimizer adamw`` build agoq's layers, 8-bit gradient DDP and
  optimizer (the door's start-up report names the classes built) and train bit-identically to pretrain_llama.py;
* on two gloo ranks (DP=2 with the distributed optimizer and overlapped reduction; PP=2) the door's record holds the
  global batch's loss, bit for bit pretrain_llama.py's, and Megatron's printed line beside it;
* the old hooks without the door (agoq's DDP and optimizer, Megatron's layers) stop before the first step, naming what
  is missing;
* Megatron-LM's LLaMA recipe flags (Megatron's defaults: fusions, --persist-layer-norm,
  --gradient-accumulation-fusion, the loader's attention mask, --eval-iters 0) train with no agoq-specific flag;
* refusals are one line each, before Megatron's argument dump, in Megatron-LM's spelling; ``--agoq-disable`` takes
  Transformer Engine's flag (the door changes nothing).
GPU twin: tests/gpu/test_megatron_lm_gpu.py::test_zero_edit_door_on_one_gpu.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from agoq.testing.procs import REPO_ROOT
from tests.megatron._megatron_lm_runs import (
    BENCH,
    LLAMA_RECIPE_FLAGS,
    SCRIPT,
    SHAPES,
    Run,
    launch,
    launch_ranks,
    megatron_cpu_command,
    ok,
    pretrain_llama_command,
)

pytestmark = pytest.mark.megatron

ITERS = 3
FULL = ["--agoq-grads", "int8_b256", "--agoq-optimizer", "adamw"]
BUILT = ("built as asked on every rank", "AgoqTransformerLayer", "SDPACoreAttention", "AgoqMegatronTrainingDDP",
         "AgoqDistributedDataParallel", "AgoqMegatronOptimizer")


@pytest.fixture(scope="module")
def default_data(agoq_cache):
    from agoq.train.data import ensure_default_dataset

    paths = ensure_default_dataset(agoq_cache)
    return {"prefix": str(paths.prefix), "tokenizer": str(paths.tokenizer_model)}


@pytest.fixture(scope="module")
def runs(default_data, tmp_path_factory):
    """One run each (shared by the tests below): pretrain_llama.py, the door on the builder and provider shapes
    (pretrain_llama.py's equivalent flags), the old hooks without the door, and the door with the recipe flags."""
    tmp = tmp_path_factory.mktemp("door")
    iters = ["--train-iters", str(ITERS)]
    jobs = {
        "pretrain_llama": (pretrain_llama_command(default_data, tmp, "own.jsonl", [*FULL, *iters]), "own.jsonl", {}),
        "builder": (megatron_cpu_command(default_data, tmp, "builder.jsonl", [*FULL, *iters], script=SHAPES,
                                         door=True), "builder.jsonl", {"AGOQ_TEST_SHAPE": "builder"}),
        "provider": (megatron_cpu_command(default_data, tmp, "provider.jsonl", [*FULL, *iters], script=SHAPES,
                                          door=True), "provider.jsonl", {"AGOQ_TEST_SHAPE": "provider"}),
        "hooks": (megatron_cpu_command(default_data, tmp, None, [*FULL, *iters], script=SHAPES), None,
                  {"AGOQ_TEST_SHAPE": "hooks"}),
        "recipe": (megatron_cpu_command(default_data, tmp, "recipe.jsonl", [*FULL, "--train-iters", "2"],
                                        script=SHAPES, door=True, equivalence=False), "recipe.jsonl",
                   {"AGOQ_TEST_SHAPE": "builder"}),
    }
    with ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda job: launch(job[0], tmp, job[1], env=job[2]), jobs.values())
        return dict(zip(jobs, done, strict=True))


@pytest.mark.parametrize("shape", ["builder", "provider"])
def test_both_construction_paths_build_agoq_and_train_as_pretrain_llama(runs, shape):
    run = ok(runs[shape])
    own = ok(runs["pretrain_llama"])
    report = next((line for line in run.output.splitlines() if "built as asked" in line), "")
    for word in BUILT:
        assert word in report, (word, report)
    assert "--spec agoq.megatron.megatron_lm MEGATRON_LM_LAYER_SPEC" in run.output
    assert len(run.losses) == ITERS and run.losses == own.losses, (run.losses, own.losses)  # bit for bit


def test_the_old_hooks_without_the_door_stop_before_the_first_step(runs):
    run = runs["hooks"]
    assert run.returncode != 0
    assert "iteration        1/" not in run.output, "a step ran"
    for words in ("BuiltMismatch", "stopping before the first step",
                  "layers 1-2 are megatron.core.transformer.transformer_layer.TransformerLayer, not agoq's "
                  "AgoqTransformerLayer", "python -m agoq.megatron_lm"):
        assert words in run.output, (words, run.output[-3000:])
    assert "8-bit gradient DDP" not in run.output.split("BuiltMismatch")[-1]  # the hooks did bring agoq's DDP


def test_megatron_lm_recipe_flags_run_without_agoq_specific_flags(runs):
    run = ok(runs["recipe"])
    assert len(run.losses) == 2
    for words in ("agoq: --persist-layer-norm (Megatron-LM's default)",
                  "agoq: --gradient-accumulation-fusion (Megatron-LM's default) taken over", *BUILT):
        assert words in run.output, words
    # Megatron's defaults differ from pretrain_llama.py's (decay style, Adam beta2): the first loss is the same
    assert run.losses[0] == ok(runs["pretrain_llama"]).losses[0]


def _one_line(run) -> str:
    """The refusal line; asserts there is no traceback and no argument dump."""
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output and "------------------------ arguments" not in run.output, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if line.startswith("agoq: ")]
    assert len(lines) == 1, lines
    return lines[0]


REFUSALS = {  # case -> (entry script, flags taken out of Megatron-LM's recipe, flags added, words of the line)
    "transformer_engine": (SHAPES, ["--transformer-impl", "local"], [],  # this machine has no TE (asserted below)
                           ["--transformer-impl transformer_engine", "Transformer Engine is not installed",
                            "pip install", "--transformer-impl local"]),
    "attention_dropout": (SHAPES, ["--attention-dropout", "0"], [],
                          ["--attention-dropout 0.1", "add --attention-dropout 0", "--agoq-attention megatron"]),
    "fp16": (SHAPES, ["--bf16"], ["--fp16"], ["--fp16", "use --bf16"]),
    "script_attention_dropout": (SCRIPT, ["--attention-dropout", "0"], ["--agoq-disable"],
                                 ["--attention-dropout 0.1", "--agoq-attention megatron"]),
    "script_transformer_engine": (SCRIPT, ["--transformer-impl", "local"], ["--agoq-disable"],
                                  ["scripts/pretrain_gpt_agoq.py builds Megatron's local spec",
                                   "python -m agoq.megatron_lm"]),
}


def _without(flags: list[str], taken: list[str]) -> list[str]:
    if not taken:
        return flags
    at = flags.index(taken[0])
    return flags[:at] + flags[at + len(taken):]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_are_one_line_before_the_argument_dump(default_data, tmp_path, case):
    script, taken, added, words = REFUSALS[case]
    if case == "transformer_engine":
        from agoq.megatron.te import te_available

        assert not te_available(), "this case needs a machine without Transformer Engine"
    command = megatron_cpu_command(default_data, tmp_path, None, ["--train-iters", "1", *added], script=script,
                                   door=script == SHAPES, equivalence=False)
    command = _without(command, taken)
    line = _one_line(launch(command, tmp_path, None))
    for word in words:
        assert word in line, (word, line)
    assert "--attention-backend megatron" not in line


def test_no_cuda_is_one_line_through_the_door_and_the_script(tmp_path):
    """Without the CPU test driver: megatron.training needs CUDA; the door says so in one line (issue 43 item 5)."""
    for entry in (["-m", "agoq.megatron_lm", str(SHAPES)], [str(SCRIPT)]):
        line = _one_line(launch([sys.executable, *entry, *LLAMA_RECIPE_FLAGS, "--num-layers", "2", "--hidden-size",
                                 "64", "--num-attention-heads", "4", "--seq-length", "64",
                                 "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1",
                                 "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"],
                                tmp_path, None))
        assert "needs a CUDA GPU" in line and "scripts/pretrain_llama.py" in line, line


def test_the_baseline_takes_transformer_engine_and_the_door_changes_nothing(default_data, tmp_path):
    """--agoq-disable with Megatron-LM's default --transformer-impl transformer_engine: the door does not refuse it;
    Megatron builds its own model (here it stops on its own: this CPU has no Transformer Engine)."""
    command = megatron_cpu_command(default_data, tmp_path, None, ["--train-iters", "1", "--agoq-disable"],
                                   script=SHAPES, door=True, equivalence=False)
    command = _without(command, ["--transformer-impl", "local"])
    run = launch(command, tmp_path, None)
    assert "agoq: disabled (--agoq-disable)" in run.output, run.output[-3000:]
    assert "agoq: --transformer-impl" not in run.output and "--spec agoq" not in run.output
    if run.returncode != 0:  # Megatron's own stop (no TE on this machine), after the door let it through
        assert "TE" in run.output.splitlines()[-1] or "transformer_engine" in run.output.splitlines()[-1], \
            run.output[-2000:]


def test_the_door_without_a_script_says_how_to_call_it(tmp_path):
    run = launch([sys.executable, "-m", "agoq.megatron_lm", str(REPO_ROOT / "no_such_pretrain_gpt.py")], tmp_path,
                 None)
    assert run.returncode == 2 and "no such script" in run.output and "usage:" in run.output


def test_recipe_flags_are_megatron_lms_own(monkeypatch):
    """The recipe flags above are Megatron-LM flags (its parser takes them with no agoq flag) and leave Megatron's
    defaults for what agoq takes over."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *LLAMA_RECIPE_FLAGS])
    args = parse_args()
    assert args.gradient_accumulation_fusion and not args.no_persist_layer_norm
    assert args.create_attention_mask_in_dataloader and args.apply_rope_fusion and args.bias_swiglu_fusion
    assert not any(flag.startswith("--agoq") for flag in LLAMA_RECIPE_FLAGS)
    assert set(BENCH.MEGATRON_EQUIVALENCE_FLAGS) > {"--no-persist-layer-norm"}  # the bit-identity runs turn them off


TWO_RANK_LAYOUTS = {  # name -> (flags, the optimizer class the door's report names)
    "dp2_distopt_overlap": (["--use-distributed-optimizer", "--overlap-grad-reduce"], "AgoqDistributedOptimizer"),
    "pp2": (["--pipeline-model-parallel-size", "2"], "AgoqMegatronOptimizer"),
}


@pytest.mark.parametrize("layout", sorted(TWO_RANK_LAYOUTS))
def test_the_door_trains_as_pretrain_llama_on_two_ranks(default_data, tmp_path, layout):
    """Two gloo ranks, data parallelism as Megatron-LM users run it (distributed optimizer, overlapped reduction) and
    PP=2: the door's --agoq-log-json records the global batch's loss, bit for bit pretrain_llama.py's, although the
    2-tuple loss function's report that Megatron returns on each rank is that rank's own at DP=2; and each
    recorded ``megatron_log_lm_loss`` is what Megatron's line prints (the last rank's). The CPU twin of
    tests/e2e/test_megatron_lm_door_multigpu.py."""
    door = _door_against_pretrain_llama_on_two_ranks(default_data, tmp_path, layout, SHAPES)
    if layout.startswith("dp2"):  # the ranks' own losses differ: the printed line is not the global batch's
        assert f"{door.losses[0]:.6E}" != door.megatron_log_lines()[1]


def _door_against_pretrain_llama_on_two_ranks(default_data, tmp_path, layout: str, script) -> Run:
    layout_flags, optimizer = TWO_RANK_LAYOUTS[layout]
    flags = [*FULL, *layout_flags, "--train-iters", str(ITERS)]
    door_command = megatron_cpu_command(default_data, tmp_path, "door.jsonl", flags, script=script, door=True)
    door = ok(launch_ranks(2, door_command, tmp_path, "door.jsonl", env={"AGOQ_TEST_SHAPE": "builder"}))
    own = ok(launch_ranks(2, pretrain_llama_command(default_data, tmp_path, "own.jsonl", flags), tmp_path, "own.jsonl"))
    assert len(door.losses) == ITERS and door.losses == own.losses, (door.losses, own.losses)
    printed = door.megatron_log_lines()
    recorded = {r["iteration"]: r for r in door.records if "iteration" in r}
    assert sorted(printed) == sorted(recorded) == list(range(1, ITERS + 1)), (printed, recorded)
    for iteration, text in printed.items():
        assert f"{recorded[iteration]['megatron_log_lm_loss']:.6E}" == text, (iteration, text, recorded[iteration])
    built = next((line for line in door.output.splitlines() if "built as asked on every rank" in line), "")
    for name in ("AgoqTransformerLayer", "AgoqDistributedDataParallel", optimizer):
        assert name in built, (name, built)
    return door


@pytest.mark.skipif(not __import__("os").environ.get("AGOQ_MEGATRON_LM"),
                    reason="set AGOQ_MEGATRON_LM to a Megatron-LM checkout at core_r0.19.x (its pretrain_gpt.py)")
def test_megatron_lms_own_pretrain_gpt_through_the_door(runs, default_data, tmp_path):
    """Megatron-LM's own pretrain_gpt.py (your checkout, unmodified; not part of this repository): through the door,
    agoq's classes are built and the losses are pretrain_llama.py's (its 3-tuple per-token loss included)."""
    import os
    from pathlib import Path

    script = Path(os.environ["AGOQ_MEGATRON_LM"]) / "pretrain_gpt.py"
    run = ok(launch(megatron_cpu_command(default_data, tmp_path, "mlm.jsonl", [*FULL, "--train-iters", str(ITERS)],
                                        script=script, door=True), tmp_path, "mlm.jsonl"))
    assert all(word in run.output for word in BUILT)
    assert run.losses == ok(runs["pretrain_llama"]).losses


@pytest.mark.skipif(not __import__("os").environ.get("AGOQ_MEGATRON_LM"),
                    reason="set AGOQ_MEGATRON_LM to a Megatron-LM checkout at core_r0.19.x (its pretrain_gpt.py)")
def test_megatron_lms_own_pretrain_gpt_saves_and_resumes_through_the_door(default_data, tmp_path):
    """The same script with Megatron's own --save / --exit-interval / --load and the distributed optimizer: the
    checkpoint writers' results go through agoq's queue server (agoq/megatron/ckpt/queue_server.py, which the door
    installs), and the resumed iterations equal the uninterrupted run's (--no-load-rng: no CUDA RNG on the CPU)."""
    import os
    from pathlib import Path

    script = Path(os.environ["AGOQ_MEGATRON_LM"]) / "pretrain_gpt.py"
    flags = [*FULL, "--use-distributed-optimizer", "--train-iters", "4"]
    ckpt = str(tmp_path / "ckpt")

    def losses(name: str, extra: list[str]) -> list[float]:
        command = megatron_cpu_command(default_data, tmp_path, name, [*flags, *extra], script=script, door=True)
        return ok(launch(command, tmp_path, name)).losses

    straight = losses("a.jsonl", [])
    first = losses("b.jsonl", ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"])
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = losses("c.jsonl", ["--load", ckpt, "--no-load-rng"])
    assert len(straight) == 4 and first == straight[:2] and resumed == straight[2:], (straight, first, resumed)


@pytest.mark.skipif(not __import__("os").environ.get("AGOQ_MEGATRON_LM"),
                    reason="set AGOQ_MEGATRON_LM to a Megatron-LM checkout at core_r0.19.x (its pretrain_gpt.py)")
@pytest.mark.parametrize("layout", sorted(TWO_RANK_LAYOUTS))
def test_megatron_lms_own_pretrain_gpt_on_two_ranks(default_data, tmp_path, layout):
    """The same script on two ranks (its 3-tuple loss, which Megatron reduces over data-parallel ranks itself)."""
    import os
    from pathlib import Path

    _door_against_pretrain_llama_on_two_ranks(default_data, tmp_path, layout,
                                              Path(os.environ["AGOQ_MEGATRON_LM"]) / "pretrain_gpt.py")


def _documented_door_command() -> list[str]:
    """The flags of docs/megatron_lm.md's zero-edit command (after the script path); its block is skipped by the
    docs check (the script is your Megatron-LM checkout's), so this test checks it."""
    import re
    import shlex

    text = (REPO_ROOT / "docs" / "megatron_lm.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
             if "-m agoq.megatron_lm" in line and not line.lstrip().startswith("#")]
    assert len(lines) == 1, lines
    tokens = shlex.split(lines[0])
    return tokens[tokens.index("$MEGATRON_LM/pretrain_gpt.py") + 1:]


def test_documented_zero_edit_command_passes_megatrons_and_agoqs_checks(monkeypatch):
    import contextlib
    import io

    from megatron.training.arguments import parse_args, validate_args

    from agoq.train.megatron_lm import add_agoq_args, agoq_config_from_megatron_args, take_over_recipe_flags

    argv = _documented_door_command()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = parse_args(extra_args_provider=add_agoq_args)
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args)
    config = agoq_config_from_megatron_args(args)
    assert config.enabled and config.grads.quantized and config.optimizer.agoq
    assert len(take_over_recipe_flags(args)) == 2  # Megatron-LM's defaults, no agoq-specific flag beside --agoq-*
    assert not [flag for flag in argv if flag.startswith("--no-")], argv


def test_agoqs_spec_name_is_the_slot_the_door_fills():
    """A checkpoint saved through the door records agoq's --spec in its args; loading those args back must not be
    refused as a user's --spec (agoq.train.megatron_lm.AGOQ_SPEC)."""
    from agoq.megatron import megatron_lm
    from agoq.train.megatron_lm import AGOQ_SPEC

    assert AGOQ_SPEC == [megatron_lm.__name__, megatron_lm.LAYER_SPEC_SLOT]


def test_a_script_the_door_never_got_into_is_not_silent(tmp_path):
    script = tmp_path / "pretrain_other.py"
    script.write_text("print('parsed nothing through megatron.training.arguments')\n")
    line = _one_line(launch([sys.executable, "-m", "agoq.megatron_lm", str(script)], tmp_path, None))
    assert "without calling megatron.training.arguments.parse_and_validate_args" in line, line
