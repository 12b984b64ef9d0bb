"""A Megatron user's common mistakes with pretrain_llama.py's command line and config files: each stops at parse
time (before torch loads) with one line naming the file or flag, the rule and the allowed values or the fix,
instead of being ignored or failing later (house rule: clear errors)."""

from __future__ import annotations

import pytest

from agoq.megatron.train.args import parse_args


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, expected", [
    ("num_layers: four\n", "num_layers (--num-layers) takes an integer; got 'four'"),  # named no file before
    ("num_layers: 4.5\n", "num_layers (--num-layers) takes an integer; got 4.5"),  # was kept as a float
    ("num_layers: [4]\n", "num_layers (--num-layers) takes one value; got [4]"),  # was a TypeError traceback
    ("lr: fast\n", "lr (--lr) takes a number; got 'fast'"),
    ("fp32: 'no'\n", "fp32 (--fp32) is a switch: write fp32: true or fp32: false"),  # 'no' turned fp32 on
    ("attention_backend: flash\n",  # was refused only after torch, megatron and the data had loaded
     "attention_backend (--attention-backend): invalid choice; got 'flash'; allowed: sdpa, megatron"),
    ("agoq_fp8: off\n", "agoq_fp8 (--agoq-fp8) takes one of the choices; got False (YAML reads unquoted"),
    ("agoq_optimizer: adam\n", "agoq_optimizer (--agoq-optimizer): invalid choice; got 'adam'; allowed: torch, adamw"),
])  # fmt: skip
def test_config_value_of_the_wrong_type_or_choice_names_file_key_and_flag(tmp_path, capsys, text, expected):
    path = _config(tmp_path, text)
    err = _error(capsys, ["--config", path])
    assert f"--config {path}: {expected}" in err, err


def test_config_values_are_typed_as_on_the_command_line(tmp_path):
    path = _config(tmp_path, "lr: 3e-3\nmin_lr: 0\nnum_query_groups: null\nfp32: true\ndata_path: data/x\n"
                             "tokenizer_model: " + __file__ + "\ndebug_nonfinite_at_iteration: 3\n")
    args = parse_args(["--config", path])
    assert (args.lr, args.min_lr, args.num_query_groups, args.fp32) == (3e-3, 0.0, 4, True)
    assert args.data_path == ["data/x"]  # one prefix; it used to become a list of characters
    assert args.debug_nonfinite_at_iteration == [3]
    blend = _config(tmp_path, "data_path: [0.3, data/a, 0.7, data/b]\ntokenizer_model: " + __file__ + "\n")
    assert parse_args(["--config", blend]).data_path == ["0.3", "data/a", "0.7", "data/b"]
