"""``--config FILE.yaml`` of ``scripts/pretrain_llama.py`` (also ``python -m agoq.plan --model``): flag values in a
YAML file, keys in snake_case (``num_layers: 4``), each value typed and checked as its flag would be on the command
line. An unknown key stops the run with the file, the key and the allowed keys. Torch-free: argparse and yaml only
(``agoq.plan`` reads model files with it).
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

import yaml


def load_config_file(path: str, parser: argparse.ArgumentParser, *, flag: str = "--config") -> dict:
    """Read a YAML config of flag values; every key must be a flag's snake_case name, every value one its flag
    takes. ``flag``: the option that named the file, for the messages (the planner reads the same files as
    ``--model``)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag} {path}: file not found")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{flag} {path}: YAML syntax error: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{flag} {path}: expected a mapping of flag names to values")
    allowed = {a.dest for a in parser._actions if a.dest not in ("help", "config", "agoq_preset")}
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{flag} {path}: unknown key {key!r}{hint}. Allowed keys: {', '.join(sorted(allowed))}"
            )
    actions = {a.dest: a for a in parser._actions}
    return {key: _config_value(f"{flag} {path}", key, value, actions[key]) for key, value in values.items()}


_TYPE_WORDS = {int: "an integer", float: "a number"}


def _config_value(source: str, key: str, value, action: argparse.Action):
    """A config file's ``value`` for ``key`` as the command line would give it (typed, within the choices), or a
    ValueError naming the file, the key, its flag and what it takes. set_defaults alone would keep a YAML list,
    a quoted boolean or a float for an integer flag as they are (``fp32: "no"`` turned fp32 on)."""
    flag = max(action.option_strings, key=len)
    where = f"{source}: {key} ({flag})"
    if value is None and action.default is None:
        return None  # as if the key were left out
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: write {key}: true or {key}: false (YAML booleans, unquoted); "
                             f"got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise ValueError(f"{where} takes one or more values (a YAML list, or one value); got []")
        return [_config_item(where, item, action) for item in items]
    if isinstance(value, (list, dict)):
        raise ValueError(f"{where} takes one value; got {value!r}")
    return _config_item(where, value, action)


def _config_item(where: str, value, action: argparse.Action):
    kind = action.type
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        wanted = _TYPE_WORDS.get(kind, "a string" if not action.choices else "one of the choices")
        hint = " (YAML reads unquoted yes / no / on / off as booleans: quote the value)" * isinstance(value, bool)
        raise ValueError(f"{where} takes {wanted}; got {value!r}{hint}" + _choices_text(action))
    if kind in (int, float):
        if isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                raise ValueError(f"{where} takes {_TYPE_WORDS[kind]}; got {value!r}") from None
        elif kind is int and not isinstance(value, int):
            raise ValueError(f"{where} takes {_TYPE_WORDS[kind]}; got {value!r}")
        else:
            value = kind(value)
    elif kind is None:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: invalid choice; got {value!r}" + _choices_text(action))
    return value


def _choices_text(action: argparse.Action) -> str:
    return f"; allowed: {', '.join(map(str, action.choices))}" if action.choices else ""
