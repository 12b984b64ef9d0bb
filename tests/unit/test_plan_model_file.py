"""python -m agoq.plan --model FILE: the model file's layout (tensor / pipeline / virtual-pipeline sizes, the
distributed optimizer), batch, vocabulary and agoq settings are the planner's input, as the trainer reads the
same file; flags given to the planner override it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agoq.plan import __main__ as plan
from agoq.plan.memory import Layout
from agoq.plan.peak import predict_peaks
from agoq.plan.recipe import recipe_of
from agoq.plan.shape import ModelShape
from agoq.policy import load_policy

MODEL = """num_layers: 8
hidden_size: 256
num_attention_heads: 4
num_query_groups: 2
ffn_hidden_size: 704
seq_length: 512
micro_batch_size: 2
global_batch_size: 16
tensor_model_parallel_size: 2
pipeline_model_parallel_size: 2
num_layers_per_virtual_pipeline_stage: 2
use_distributed_optimizer: true
tokenizer_model: fake.model
make_vocab_size_divisible_by: 128
agoq_optimizer: adamw
"""


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    import agoq.data.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer.Tokenizer, "load", classmethod(lambda cls, path: SimpleNamespace(vocab_size=4000)))
    path = tmp_path / "model.yaml"
    path.write_text(MODEL)
    return path


def _stages(out: str) -> list[str]:
    return [line.split("stage")[1].split()[0] for line in out.splitlines() if " stage " in line]


def test_planner_honours_the_model_files_layout(model_file, capsys):
    argv = ["--config", str(model_file), "--dp", "2", "--memory-budget", "1000GiB", "--policies",
            str(plan.POLICY_DIR / "bf16.yaml")]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert _stages(out) == ["0", "1"]  # pipeline_model_parallel_size 2
    assert "agoq's optimizer, distributed over 2 ranks" in out  # use_distributed_optimizer, agoq_optimizer

    cfg = plan.read_model_file(str(model_file))
    values = plan.values_of(plan.parse(argv), cfg)
    config = plan.config_of(values)
    layout = plan.layout_of(values, config)
    assert layout == Layout(tp=2, pp=2, vpp=2, dp=2, mbs=2, gbs=16, seq=512, distributed_optimizer=True)
    assert config.optimizer.kind == "adamw"
    # vocabulary: the tokenizer's 4000 padded to a multiple of 128 x TP 2, as the trainer pads it
    assert plan.raw_vocab(values) == 4000
    assert plan.capacity.padded_vocab(4000, layout.tp, plan.divisible_by(values)) == 4096
    expected = predict_peaks(ModelShape(8, 256, 4, 2, 704, 4096), layout, load_policy(plan.POLICY_DIR / "bf16.yaml"),
                             recipe_of(config))
    peaks = [line.split("peak")[1].split()[0] for line in out.splitlines() if " stage " in line]
    assert peaks == [f"{p.peak / 2**30:7.2f}".strip() for p in expected]


def test_flags_override_the_model_file(model_file, capsys):
    argv = ["--config", str(model_file), "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "1",
            "--num-layers-per-virtual-pipeline-stage", "1", "--agoq-optimizer", "torch", "--memory-budget", "1000GiB",
            "--policies", str(plan.POLICY_DIR / "bf16.yaml")]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert _stages(out) == ["0", "1", "2", "3"] and "Megatron's Adam, distributed over 1 rank)" in out


def test_model_file_values_are_validated_as_the_trainers(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(MODEL.replace("tokenizer_model: fake.model\n", "") + "agoq_grads: uint8_b256\n")
    assert plan.main(["--config", str(path), "--memory-budget", "80GiB"]) == 2
    assert "--agoq-grads uint8_b256" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    (None, "--config {path}: file not found"),  # was a FileNotFoundError traceback
    (MODEL.replace("num_layers:", "num_layer:"),  # was skipped: "give --num-layers ... (or a --model YAML)"
     "--config {path}: unknown key 'num_layer' (did you mean 'num_layers'?)"),
    (MODEL.replace("num_layers: 8", "num_layers: eight"),  # was read as a string
     "--config {path}: num_layers (--num-layers) takes an integer; got 'eight'"),
])  # fmt: skip
@pytest.mark.parametrize("capacity", [[], ["--capacity"]])
def test_model_file_is_read_by_the_trainers_loader(tmp_path, capsys, text, expected, capacity):
    path = tmp_path / "m.yaml"
    if text is not None:
        path.write_text(text)
    assert plan.main([*capacity, "--config", str(path), "--memory-budget", "80GiB"]) == 2
    assert expected.format(path=path) in capsys.readouterr().err


@pytest.mark.parametrize("line, expected", [
    ("attention_backend: megatron\n", "attention_backend: megatron is not something the planner models"),
    ("fp32: true\n", "fp32: True is not something the planner models"),
    ("recompute_granularity: full\nrecompute_num_layers: 4\n", "recompute_num_layers: 4 is not something"),
    ("agoq_disable: true\n", "agoq_disable: True is not something the planner models"),
    ("agoq_policy: configs/policy/int4.yaml\n", "pass --policies FILE to plan this one"),
])  # fmt: skip
@pytest.mark.parametrize("capacity", [[], ["--capacity"]])
def test_a_model_file_key_the_planner_does_not_model_is_refused(tmp_path, capsys, line, expected, capacity):
    """2026-11-27 review: each of these printed the same prediction as without the key."""
    path = tmp_path / "m.yaml"
    path.write_text(MODEL.replace("tokenizer_model: fake.model\n", "") + line)
    assert plan.main([*capacity, "--config", str(path), "--memory-budget", "80GiB"]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: " in err and expected in err, err


@pytest.mark.parametrize("flags, expected", [
    (["--agoq-gradient-release"], "--agoq-gradient-release conflicts with the distributed optimizer, TP=2, PP=2"),
    (["--agoq-grads", "bf16"], "--agoq-grads bf16 names Megatron's float gradients in bf16, but this run keeps them"),
    (["--agoq-optimizer", "torch", "--agoq-master", "split32"],
     "--agoq-master split32 sets a state format of agoq's optimizer, but --agoq-optimizer is torch"),
    (["--dp", "0"], "--dp 0: use a positive integer"),  # was a ZeroDivisionError traceback
])  # fmt: skip
def test_a_run_the_trainer_refuses_is_not_planned(model_file, capsys, flags, expected):
    """2026-11-27 review: each printed a plan for a run scripts/pretrain_llama.py refuses (or keeps otherwise)."""
    assert plan.main(["--config", str(model_file), "--memory-budget", "80GiB", *flags]) == 2
    assert expected in capsys.readouterr().err


def test_a_candidates_own_grads_section_is_planned_as_the_trainer_runs_it(model_file, tmp_path, capsys):
    """A candidate policy with default: {grads: int8_b256} runs the 8-bit store in the trainer (AgoqConfig.from_flags
    applies it); the planner planned it with float gradients (2026-11-27 review). Its rows now equal the bf16
    policy's under --agoq-grads int8_b256."""
    own = tmp_path / "own.yaml"
    own.write_text("version: 1\ndefault: {activations: bf16, grads: int8_b256}\nrules: []\n")
    bf16 = str(plan.POLICY_DIR / "bf16.yaml")
    base = ["--config", str(model_file), "--memory-budget", "80GiB"]
    assert plan.main([*base, "--policies", str(own)]) == 0
    planned = capsys.readouterr().out
    assert "own: its own sections apply to its rows (gradients int8_b256, FP8 off)" in planned
    assert plan.main([*base, "--agoq-grads", "int8_b256", "--policies", bf16]) == 0
    flagged = capsys.readouterr().out
    def rows(out: str) -> list[str]:  # each stage's numbers, without the candidate's name
        return [line.split(" stage ", 1)[1] for line in out.splitlines() if " stage " in line]

    assert rows(planned) == rows(flagged) and len(rows(planned)) == 2
    assert plan.main([*base, "--policies", bf16]) == 0
    assert rows(capsys.readouterr().out) != rows(flagged)  # the float-gradient plan differs


def test_model_file_may_give_the_vocab_size(tmp_path):
    """vocab_size is the trainer's --vocab-size (Megatron-LM's), so the same file trains and plans."""
    path = tmp_path / "m.yaml"
    path.write_text(MODEL.replace("tokenizer_model: fake.model\n", "vocab_size: 32000\n"))
    assert plan.read_model_file(str(path))["vocab_size"] == 32000


def test_a_missing_candidate_policy_is_one_error_line(model_file, capsys):
    argv = ["--config", str(model_file), "--memory-budget", "80GiB", "--policies", str(model_file.parent / "no.yaml")]
    assert plan.main(argv) == 2  # was a PolicyError traceback
    assert "no.yaml: cannot read policy file" in capsys.readouterr().err


@pytest.mark.parametrize("capacity", [[], ["--capacity"]])
def test_a_model_file_without_the_shape_names_the_file_and_the_missing_keys(tmp_path, capsys, capacity):
    """It said 'give --hidden-size, ... (or a --model YAML)', as if no file had been given."""
    path = tmp_path / "m.yaml"
    path.write_text("num_layers: 4\nhidden_size: 256\nseq_length: 512\n")
    assert plan.main([*capacity, "--config", str(path), "--memory-budget", "80GiB", "--ffn-hidden-size", "704"]) == 2
    err = capsys.readouterr().err
    assert (f"--config {path} lacks the model shape's num_attention_heads: add them to the file, "
            "or give --num-attention-heads") in err, err  # the query groups default to the heads, as in the trainer
    assert "(or a --model YAML)" not in err
    # without a file, the flags (or a file) are what to give, as before
    assert plan.main([*capacity, "--memory-budget", "80GiB"]) == 2
    assert "give --num-layers, --hidden-size, --num-attention-heads" in capsys.readouterr().err
