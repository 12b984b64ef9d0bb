"""The ``--agoq-*`` flags, generated from AgoqConfig for every command line that takes them:
``scripts/pretrain_llama.py`` (agoq.cli.flags), ``python -m agoq.plan`` (the trainer's parser) and the Megatron-LM door
(agoq.train.megatron_lm.add_agoq_args), plus ``--agoq-preset`` (a preset file of ``--agoq-*`` values).

Each flag is one ``agoq.config.AGOQ_FLAGS`` entry (its name and the field it sets); this module turns the field into
the argparse argument: a ``bool`` field is a switch, ``int`` / ``float`` fields are typed, a ``Literal`` annotation
gives the choices, the dataclass default is the default, and the field's attribute docstring is the help (vLLM's
``get_kwargs`` does the same for its engine arguments). Light imports only: argparse, ast, inspect, yaml.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path

import yaml

from agoq.cli.config_file import load_config_file
from agoq.config import AGOQ_FLAGS, AgoqFlag, flag_for

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "presets"
PRESET_FLAG = "--agoq-preset"
GROUPS = {  # AgoqConfig section -> argument group title (the top-level fields and the policy share the first)
    "": "agoq",
    "grads": "agoq gradients",
    "optimizer": "agoq optimizer (quantized states, split master weights)",
    "fp8": "agoq FP8 compute and Smooth-SwiGLU (docs/numerics.md)",
}
# The trainer's flags whose argparse default is None although the field has one: the policy's fp8 section applies
# under the fp8 flags, and --agoq-moments / --agoq-master are refused with --agoq-optimizer torch only when given.
TRAINER_UNSET = frozenset(f.flag for f in AGOQ_FLAGS if f.section == "fp8") | {flag_for("optimizer.moments"),
                                                                                flag_for("optimizer.master")}
ALL = "all"


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string right after each annotated field), whitespace folded."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split()).rstrip(".")
    return docs


def field_of(flag: AgoqFlag) -> tuple[typing.Any, typing.Any, str]:
    """(the field's type, its default, its docstring) of one flag."""
    default = {f.name: f.default for f in dataclasses.fields(flag.owner)}[flag.name]
    return typing.get_type_hints(flag.owner)[flag.name], default, _field_docs(flag.owner).get(flag.name, "")


def _choices(kind) -> tuple | None:
    """The choices of a ``Literal`` annotation (also inside ``X | None``), else None."""
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        for arg in typing.get_args(kind):
            if typing.get_origin(arg) is typing.Literal:
                return typing.get_args(arg)
    return None


def _scalar(kind) -> type | None:
    """int / float for a numeric field (also ``int | None``), None for strings and choices."""
    for arg in (kind, *typing.get_args(kind)):
        if arg in (int, float):
            return arg
    return None


def argument(flag: AgoqFlag, *, unset: bool, door: bool = False) -> dict:
    """The add_argument keywords of one flag. ``unset``: the argparse default is None (a valued flag not given reads
    as None, and the help says the field's default in words); switches default to False either way."""
    kind, default, doc = field_of(flag)
    text = flag.help or doc
    if flag.values:
        text = f"{text}: {flag.values}"
    if flag.switch:
        kw = {"action": "store_true"}
    else:
        kw = {"default": None if unset else default}
        if (choices := _choices(kind)) is not None:
            kw["choices"] = choices
        if (scalar := _scalar(kind)) is not None:
            kw["type"] = scalar
        if flag.metavar:
            kw["metavar"] = flag.metavar
        if flag.default is not None:
            text = f"{text} (default: {flag.default})"
        elif unset or flag.values:
            text = f"{text} (default: {default})"
    if door and flag.door_note:
        text = f"{text} ({flag.door_note})"
    kw["help"] = text
    kw["dest"] = flag.dest
    return kw


def add_agoq_flags(parser: argparse.ArgumentParser, *, unset=frozenset(), door: bool = False
                   ) -> argparse._ArgumentGroup:
    """Add every AGOQ_FLAGS flag (and ``--agoq-preset``) to ``parser``, one argument group per config section; returns
    the first group (the caller's own ``--agoq-*`` flags go there: the door's). ``unset``: the flags whose argparse
    default is None (ALL: every valued flag, the door's, whose checks tell a given flag by its value); ``door``: the
    Megatron-LM door's set (no ``--agoq-device``; the door's notes in the help)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in AGOQ_FLAGS:
        if door and not flag.door:
            continue
        title = GROUPS[flag.section if flag.section in GROUPS else ""]
        if title not in groups:
            first = not groups
            groups[title] = parser.add_argument_group(title)
            if first:
                groups[title].add_argument(PRESET_FLAG, default=None, metavar="NAME_OR_FILE", help=_preset_help())
        groups[title].add_argument(flag.flag, **argument(flag, unset=unset is ALL or flag.flag in unset, door=door))
    return groups[GROUPS[""]]


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _preset_help() -> str:
    return (f"a preset of --agoq-* values: a name ({', '.join(preset_names())}: configs/presets/NAME.yaml) or a YAML "
            "file of --agoq-* keys (snake_case); the flags given on the command line win over it, and it over the "
            "trainer's --config file (a key in both files is an error)")


def preset_path(name_or_file: str) -> Path:
    """The file of ``--agoq-preset NAME_OR_FILE``: an existing file as given, else configs/presets/NAME.yaml."""
    if Path(name_or_file).is_file():
        return Path(name_or_file)
    named = PRESET_DIR / f"{name_or_file}.yaml"
    if named.is_file():
        return named
    raise ValueError(f"{PRESET_FLAG} {name_or_file}: neither a file nor a preset name; the presets are "
                     f"{', '.join(preset_names())} (configs/presets/NAME.yaml), or give a YAML file's path")


def load_preset(name_or_file: str, *, door: bool = False) -> dict:
    """The ``--agoq-*`` values of a preset (flag destinations -> values, typed and checked as on the command line).
    A key that is no ``--agoq-*`` setting (a model or Megatron flag, a typo) is an error naming the file, the key
    and the allowed keys: a preset holds agoq's settings only. ``door``: the Megatron-LM door's flags."""
    path = preset_path(name_or_file)
    bare = argparse.ArgumentParser(add_help=False)
    for flag in AGOQ_FLAGS:
        if flag.door or not door:
            bare.add_argument(flag.flag, **argument(flag, unset=False))
    allowed = sorted(a.dest for a in bare._actions)
    try:
        keys = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        keys = {}  # load_config_file below names the syntax error
    for key in keys if isinstance(keys, dict) else ():
        if key not in allowed:
            where = "the Megatron-LM door's " if door else ""
            raise ValueError(f"{PRESET_FLAG} {path}: key {key!r} is not one of {where}--agoq-* settings (a preset "
                             "holds agoq's settings only: model, layout and Megatron flags go in --config or on the "
                             f"command line). Allowed keys: {', '.join(allowed)}")
    return load_config_file(str(path), bare, flag=PRESET_FLAG)


def merge_preset(file_values: dict, preset: str, file_name: str | None) -> dict:
    """A --config file's values with a preset's over them; a key both set is an error naming both (the order of
    the two would otherwise decide without a word)."""
    values = load_preset(preset)
    both = sorted(file_values.keys() & values.keys())
    if both:
        raise ValueError(f"{PRESET_FLAG} {preset} and --config {file_name} both set {', '.join(both)}: keep it in one "
                         "of the two (or give the flag on the command line, which wins over both)")
    return {**file_values, **values}
