"""Bad input to pretrain_llama.py stops before any work, with one message naming the flag/file and fix."""

from __future__ import annotations

import pytest

from agoq.megatron.args import parse_args
from agoq.testing.procs import TINY_CONFIG


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_config_file_then_command_line_precedence(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("num_layers: 6\nhidden_size: 96\nnum_attention_heads: 6\nlr: 0.5\n")
    args = parse_args(["--config", str(cfg), "--lr", "0.25"])
    assert (args.num_layers, args.hidden_size, args.lr) == (6, 96, 0.25)  # CLI beats file beats default
    assert args.num_query_groups == 6  # derived: MHA when not given
    assert args.ffn_hidden_size == 256  # 8/3 * 96 = 256, already a multiple of 64


def test_tiny_config_loads():
    args = parse_args(["--config", str(TINY_CONFIG)])
    assert args.num_layers == 4 and args.num_query_groups == 2


def test_unknown_config_key_names_file_key_and_suggestion(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("num_layer: 4\n")
    err = _error(capsys, ["--config", str(cfg)])
    assert str(cfg) in err and "num_layer" in err and "did you mean 'num_layers'" in err


def test_yaml_syntax_error_names_file(tmp_path, capsys):
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("num_layers: [4\n")
    err = _error(capsys, ["--config", str(cfg)])
    assert str(cfg) in err and "YAML syntax error" in err


@pytest.mark.parametrize("flag", ["--config", "--agoq-policy", "--tokenizer-model"])
def test_missing_file_names_the_flag(flag, capsys):
    err = _error(capsys, [flag, "/no/such/file.yaml"])
    assert f"{flag} /no/such/file.yaml" in err and "not found" in err


def test_unknown_and_abbreviated_flags_are_errors(capsys):
    assert "unrecognized arguments: --num-layer" in _error(capsys, ["--num-layer", "4"])
    assert "unrecognized arguments: --num-lay" in _error(capsys, ["--num-lay", "4"])


def test_virtual_pipeline_that_does_not_divide(capsys):
    err = _error(capsys, ["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "2"])
    assert "--num-layers-per-virtual-pipeline-stage 2" in err


def test_warmup_longer_than_decay(capsys):
    err = _error(capsys, ["--train-iters", "3", "--lr-warmup-iters", "5"])
    assert "--lr-warmup-iters 5" in err and "--lr-decay-iters 3" in err


def test_data_path_needs_tokenizer(capsys):
    assert "--tokenizer-model" in _error(capsys, ["--data-path", "data/x"])


def test_recompute_flags(capsys):
    args = parse_args(["--recompute-granularity", "full", "--agoq-disable", "--recompute-num-layers", "2"])
    assert (args.recompute_granularity, args.recompute_num_layers) == ("full", 2)
    assert "--recompute-num-layers must be >= 1" in _error(capsys, ["--agoq-disable", "--recompute-granularity",
                                                                   "full", "--recompute-num-layers", "0"])


def test_grad_reduce_in_bf16_sets_megatron_ddp_and_refuses_unvalidated_combos(capsys):
    from agoq.megatron.pretrain import ddp_config

    args = parse_args(["--grad-reduce-in-bf16"])
    import torch

    assert ddp_config(args, torch.bfloat16).grad_reduce_in_fp32 is False
    assert ddp_config(parse_args([]), torch.bfloat16).grad_reduce_in_fp32 is True  # Megatron's bf16 default
    assert "needs bf16 parameters" in _error(capsys, ["--grad-reduce-in-bf16", "--fp32"])
    err = _error(capsys, ["--grad-reduce-in-bf16", "--agoq-grads", "int8_b256"])
    assert "--grad-reduce-in-bf16 with --agoq-grads int8_b256" in err
