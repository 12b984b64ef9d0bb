"""``pretrain_llama.py --help``: every flag explains itself and shows its default (issue 21, "First run")."""

from __future__ import annotations

import argparse

from agoq.train.args import build_parser


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def test_every_option_has_help():
    missing = [a.option_strings[0] for a in _options(build_parser()) if not (a.help or "").strip()]
    assert missing == [], f"flags without help text: {missing}"


def test_help_shows_defaults():
    parser = build_parser()
    formatter = parser._get_formatter()
    actions = {a.option_strings[0]: a for a in _options(parser)}
    for flag, default in [("--num-layers", "4"), ("--lr", "0.003"), ("--split", "969,30,1"),
                          ("--agoq-optimizer", "torch"), ("--agoq-grads-mode", "store"),
                          ("--agoq-sgd-momentum", "0.9"), ("--log-interval", "1")]:
        text = formatter._expand_help(actions[flag])
        assert f"default: {default}" in text, (flag, text)
    assert "default: None" not in parser.format_help()  # "not given" is said in words, or not at all


def test_every_option_names_a_default_or_is_a_switch():
    """A flag's help says its default (argparse's '(default: X)' or the help's own 'default ...'), except
    switches (store_true: off unless given) and flags whose default is 'not given'."""
    parser = build_parser()
    formatter = parser._get_formatter()
    silent = []
    for action in _options(parser):
        if isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction)) or action.default is None:
            continue
        text = formatter._expand_help(action)
        if "default" not in text:
            silent.append(action.option_strings[0])
    assert silent == [], f"flags whose help names no default: {silent}"
