"""scripts/pretrain_llama.py's LLaMA-3.x model flags (issue 42), in Megatron-LM's spellings: --use-rope-scaling /
--rope-scaling-factor, --untie-embeddings-and-output-weights (the default here) / --tie-embeddings-and-output-weights,
and their YAML keys as hf-to-agoq writes them."""

from __future__ import annotations

import re

import pytest

from agoq.train.args import parse_args


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_defaults_are_plain_rope_and_untied():
    args = parse_args([])
    assert (args.use_rope_scaling, args.rope_scaling_factor, args.untie_embeddings_and_output_weights) == (
        False, 8.0, True)


def test_flags_and_yaml_keys(tmp_path):
    args = parse_args(["--use-rope-scaling", "--rope-scaling-factor", "32", "--tie-embeddings-and-output-weights"])
    assert (args.use_rope_scaling, args.rope_scaling_factor, args.untie_embeddings_and_output_weights) == (
        True, 32.0, False)
    assert parse_args(["--untie-embeddings-and-output-weights"]).untie_embeddings_and_output_weights
    yaml = tmp_path / "model.yaml"  # as python -m agoq.convert hf-to-agoq writes a LLaMA-3.2-1B-like config
    yaml.write_text("use_rope_scaling: true\nrope_scaling_factor: 32.0\nuntie_embeddings_and_output_weights: false\n")
    args = parse_args(["--config", str(yaml)])
    assert (args.use_rope_scaling, args.rope_scaling_factor, args.untie_embeddings_and_output_weights) == (
        True, 32.0, False)
    # the command line wins over the file, as for every flag
    untied = parse_args(["--config", str(yaml), "--untie-embeddings-and-output-weights"])
    assert untied.untie_embeddings_and_output_weights


def test_mistakes_are_errors(tmp_path, capsys):
    assert ("--rope-scaling-factor 32.0 scales RoPE only with --use-rope-scaling, which is not given (plain RoPE); "
            "add --use-rope-scaling, or drop --rope-scaling-factor") in _error(["--rope-scaling-factor", "32"], capsys)
    yaml = tmp_path / "model.yaml"
    yaml.write_text("rope_scaling_factor: 32.0\n")
    assert "--rope-scaling-factor 32.0 scales RoPE only with --use-rope-scaling" in _error(["--config", str(yaml)],
                                                                                          capsys)
    assert "not allowed with argument" in _error(["--tie-embeddings-and-output-weights",
                                                  "--untie-embeddings-and-output-weights"], capsys)
    yaml.write_text("untie_embeddings_and_output_weights: 'no'\n")
    assert "is a switch: write untie_embeddings_and_output_weights: true or" in _error(["--config", str(yaml)], capsys)


def test_the_planner_refuses_a_tied_model_file_it_would_plan_as_untied(tmp_path, capsys):
    from agoq.plan.__main__ import main, read_model_file

    model = tmp_path / "model.yaml"
    model.write_text("use_rope_scaling: true\nrope_scaling_factor: 32.0\n")
    assert read_model_file(str(model))["use_rope_scaling"]  # RoPE scaling changes no memory
    model.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\nseq_length: 32\n"
                     "vocab_size: 128\nuntie_embeddings_and_output_weights: false\n")
    assert main(["--config", str(model), "--memory-budget", "80GiB"]) == 2
    assert re.search(r"untie_embeddings_and_output_weights: False is not something the planner models .tied "
                     r"embeddings", capsys.readouterr().err)
