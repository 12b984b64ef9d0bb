"""configs/presets/*.yaml: each preset is a file of ``--agoq-*`` values that ``--agoq-preset NAME_OR_FILE`` takes in
the trainer, the planner and the Megatron-LM door, and yields the AgoqConfig of the flags its header names; explicit
flags win over it, a key it shares with the --config file is an error, and a key that is no --agoq-* setting is refused
with the file, the key and the allowed keys."""

from __future__ import annotations

import argparse

import pytest
import yaml

from agoq.cli.agoq_flags import PRESET_DIR, load_preset, preset_names
from agoq.config import AgoqConfig
from agoq.testing.procs import TINY_CONFIG
from agoq.train.args import parse_args

# name -> the flags the preset stands for (its header's "Same as the flags: ..."; the benchmarks' settings)
PRESETS = {
    "baseline": ["--agoq-disable"],
    "agoq": [],
    "agoq-full": ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256"],
    "agoq-full-fp8": ["--agoq-optimizer", "adamw", "--agoq-grads", "int8_b256", "--agoq-fp8", "delayed",
                      "--agoq-smooth-swiglu", "per-token"],
}


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_every_preset_file_is_listed_here():
    assert preset_names() == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_gives_the_config_of_its_flags(name):
    tiny = ["--config", str(TINY_CONFIG)]
    by_preset = parse_args([*tiny, "--agoq-preset", name]).agoq_config
    by_flags = parse_args([*tiny, *PRESETS[name]]).agoq_config
    assert by_preset == by_flags
    header = (PRESET_DIR / f"{name}.yaml").read_text()
    assert (" ".join(PRESETS[name]) in header) if PRESETS[name] else "it sets nothing" in header


def test_preset_differs_from_the_default_where_it_says():
    """Not vacuous: the presets give different configs (the comparison above could not pass by accident)."""
    tiny = ["--config", str(TINY_CONFIG)]
    configs = {name: parse_args([*tiny, "--agoq-preset", name]).agoq_config for name in PRESETS}
    assert len({repr(c) for c in configs.values()}) == len(PRESETS)
    assert not configs["baseline"].enabled and configs["agoq-full"].optimizer.kind == "adamw"
    assert configs["agoq-full-fp8"].fp8.recipe == "delayed" and configs["agoq"] == parse_args(tiny).agoq_config


def test_a_file_path_works_like_a_name_and_the_command_line_wins(tmp_path):
    tiny = ["--config", str(TINY_CONFIG)]
    path = tmp_path / "mine.yaml"
    path.write_text("agoq_optimizer: lion\nagoq_moments: 4bit\n")
    config = parse_args([*tiny, "--agoq-preset", str(path), "--agoq-optimizer", "sgd"]).agoq_config
    assert (config.optimizer.kind, config.optimizer.moments) == ("sgd", "4bit")
    full = parse_args([*tiny, "--agoq-preset", "agoq-full", "--agoq-grads-mode", "reduce"]).agoq_config
    assert (full.grads.format_name, full.grads.mode) == ("int8_b256", "reduce")


def test_a_key_in_both_the_config_file_and_the_preset_is_an_error(tmp_path, capsys):
    model = tmp_path / "m.yaml"
    model.write_text(TINY_CONFIG.read_text() + "agoq_optimizer: lion\n")
    err = _error(capsys, ["--config", str(model), "--agoq-preset", "agoq-full"])
    assert "--agoq-preset agoq-full and --config" in err and "both set agoq_optimizer" in err


def test_a_model_key_in_a_preset_is_refused_naming_file_key_and_allowed_keys(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("agoq_optimizer: adamw\nnum_layers: 8\n")
    err = _error(capsys, ["--config", str(TINY_CONFIG), "--agoq-preset", str(path)])
    assert f"--agoq-preset {path}: key 'num_layers' is not one of --agoq-* settings" in err
    assert "Allowed keys: agoq_device, agoq_disable, agoq_fp8" in err


def test_a_bad_value_and_an_unknown_name_are_refused(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("agoq_fp8: te\n")
    err = _error(capsys, ["--config", str(TINY_CONFIG), "--agoq-preset", str(path)])
    assert "agoq_fp8 (--agoq-fp8): invalid choice; got 'te'; allowed: off, current, delayed, rowwise" in err
    err = _error(capsys, ["--config", str(TINY_CONFIG), "--agoq-preset", "agoq-fulll"])
    assert "--agoq-preset agoq-fulll: neither a file nor a preset name; the presets are agoq, agoq-full" in err


def test_a_config_file_cannot_name_a_preset(tmp_path, capsys):
    """--agoq-preset is read from the command line; in a --config file it would do nothing, so it is refused."""
    model = tmp_path / "m.yaml"
    model.write_text(TINY_CONFIG.read_text() + "agoq_preset: agoq-full\n")
    assert "unknown key 'agoq_preset'" in _error(capsys, ["--config", str(model)])


# -- the Megatron-LM door (Megatron's parser has no --config: the door expands the preset itself) -------------------

def _door_args(argv):
    from agoq.train.megatron_lm import add_agoq_args, apply_agoq_preset

    args = add_agoq_args(argparse.ArgumentParser()).parse_args(argv)
    apply_agoq_preset(args)
    return args


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_door_preset_gives_the_config_of_its_flags(name):
    by_preset = AgoqConfig.from_flags(vars(_door_args(["--agoq-preset", name])))
    assert by_preset == AgoqConfig.from_flags(vars(_door_args(PRESETS[name])))


def test_door_explicit_flags_win_and_foreign_keys_are_refused(tmp_path):
    from agoq.train.megatron_lm import RefusedFlags

    args = _door_args(["--agoq-preset", "agoq-full-fp8", "--agoq-smooth-swiglu", "per-channel"])
    assert (args.agoq_optimizer, args.agoq_fp8, args.agoq_smooth_swiglu) == ("adamw", "delayed", "per-channel")
    for text, key in (("agoq_grads: int8_b256\nlr: 0.1\n", "lr"), ("agoq_device: cpu\n", "agoq_device")):
        path = tmp_path / "p.yaml"
        path.write_text(text)
        with pytest.raises(RefusedFlags, match=rf"--agoq-preset {path}: key '{key}' is not one of the Megatron-LM "
                                               r"door's --agoq-\* settings .*Allowed keys: agoq_disable, agoq_fp8"):
            _door_args(["--agoq-preset", str(path)])


def test_door_baseline_preset_with_an_agoq_flag_is_refused():
    from agoq.train.megatron_lm import AGOQ_SWITCHES, RefusedFlags, _given

    args = _door_args(["--agoq-preset", "baseline", "--agoq-grads", "int8_b256"])
    assert args.agoq_disable and [d for d in AGOQ_SWITCHES if _given(args, d)] == ["agoq_grads"]
    with pytest.raises(RefusedFlags, match="--agoq-disable runs the plain Megatron baseline; drop --agoq-grads"):
        from agoq.train.megatron_lm import check_megatron_args

        args.load = None
        check_megatron_args(args)


# -- the planner -----------------------------------------------------------------------------------------------------

def test_planner_preset_plans_as_its_flags(capsys):
    from agoq.plan.__main__ import main

    model = ["--config", "configs/model/llama3-8b.yaml", "--memory-budget", "80GiB"]
    assert main([*model, "--agoq-preset", "agoq-full"]) in (0, 3)
    by_preset = capsys.readouterr().out
    assert main([*model, *PRESETS["agoq-full"]]) in (0, 3)
    assert by_preset == capsys.readouterr().out and "int8_b256" in by_preset


def test_planner_refuses_the_baseline_preset_naming_it(capsys):
    from agoq.plan.__main__ import main

    assert main(["--config", "configs/model/llama3-8b.yaml", "--agoq-preset", "baseline"]) == 2
    err = capsys.readouterr().err
    assert "--agoq-preset baseline: agoq_disable: True is not something the planner models" in err
    assert "Plan another preset" in err


def test_presets_are_plain_agoq_keys():
    for name in PRESETS:
        values = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
        assert isinstance(values, dict) and all(k.startswith("agoq_") for k in values)
        assert load_preset(name) == values
