"""The ``--agoq-*`` command lines are frozen: the three parsers that take them (scripts/pretrain_llama.py, python -m
agoq.plan, the Megatron-LM door) offer exactly the flags, choices and defaults of the checked-in list
tests/unit/agoq_flags.frozen (torchtitan's test_no_new_cli_options.py), and each flag is declared in one place.

Adding, removing or changing an ``--agoq-*`` flag is a decision: update the list with
``PYTHONPATH=. python tests/unit/test_cli_frozen.py`` and commit it with the change (the diff shows what users see).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter

import pytest

from agoq.testing.procs import REPO_ROOT

FROZEN = REPO_ROOT / "tests" / "unit" / "agoq_flags.frozen"
AGOQ = REPO_ROOT / "agoq"
GENERATOR = "agoq/cli/agoq_flags.py"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from agoq.cli.flags import build_parser as trainer
    from agoq.plan.__main__ import build_parser as planner
    from agoq.train.megatron_lm import add_agoq_args

    return {"trainer": trainer(), "planner": planner(), "door": add_agoq_args(argparse.ArgumentParser())}


def current_lines() -> list[str]:
    """One line per parser and --agoq-* flag: 'parser flag kind choices=... default=...'."""
    lines = []
    for name, parser in _parsers().items():
        for action in parser._actions:
            for flag in (s for s in action.option_strings if s.startswith("--agoq-")):
                kind = ("switch" if isinstance(action, argparse._StoreTrueAction) else
                        getattr(action.type, "__name__", "str"))
                choices = ",".join(map(str, action.choices)) if action.choices else "-"
                lines.append(f"{name} {flag} {kind} choices={choices} default={parser.get_default(action.dest)!r}")
    return sorted(lines)


def test_agoq_flags_match_the_frozen_list():
    frozen = [line for line in FROZEN.read_text().splitlines() if line and not line.startswith("#")]
    now = current_lines()
    added, removed = sorted(set(now) - set(frozen)), sorted(set(frozen) - set(now))
    assert not (added or removed), (
        "the --agoq-* flags changed:\n" + "".join(f"  + {line}\n" for line in added)
        + "".join(f"  - {line}\n" for line in removed)
        + f"if intended, update the list: PYTHONPATH=. python tests/unit/test_cli_frozen.py (writes {FROZEN.name})")


def test_the_frozen_list_catches_a_new_or_changed_flag(monkeypatch):
    """The comparison can fail: a flag added to one parser and a default changed in another both show."""
    import tests.unit.test_cli_frozen as me

    parsers = _parsers()
    parsers["door"].add_argument("--agoq-new-thing", type=int, default=3)
    parsers["trainer"].set_defaults(agoq_grads_mode="reduce")
    monkeypatch.setattr(me, "_parsers", lambda: parsers)
    with pytest.raises(AssertionError) as info:
        me.test_agoq_flags_match_the_frozen_list()
    text = str(info.value)
    assert "+ door --agoq-new-thing int choices=- default=3" in text
    assert "+ trainer --agoq-grads-mode str choices=reduce,store default='reduce'" in text
    assert "- trainer --agoq-grads-mode str choices=reduce,store default='store'" in text


def _module_constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def declarations() -> tuple[Counter, dict[str, list[str]], list[str]]:
    """(declaration count per --agoq-* flag, the files declaring each, the add_argument calls whose name is computed)
    over agoq/: an ``add_argument`` with a literal (or module-constant) ``--agoq-*`` name, or an ``AgoqFlag(...)``
    entry of agoq.config.AGOQ_FLAGS (rendered by the generator)."""
    count, where, computed = Counter(), {}, []
    for path in sorted(AGOQ.rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        constants = _module_constants(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func not in ("add_argument", "AgoqFlag"):
                continue
            first = node.args[0]
            name = (first.value if isinstance(first, ast.Constant) else
                    constants.get(first.id) if isinstance(first, ast.Name) else None)
            if name is None:
                computed.append(f"{rel}:{node.lineno}")
            elif isinstance(name, str) and name.startswith("--agoq-"):
                count[name] += 1
                where.setdefault(name, []).append(rel)
    return count, where, computed


def test_each_agoq_flag_is_declared_once():
    count, where, computed = declarations()
    offered = {line.split()[1] for line in current_lines()}
    missing = sorted(offered - set(count))
    twice = {flag: where[flag] for flag in offered if count[flag] > 1}
    assert not missing, f"--agoq-* flags the parsers offer but no declaration names: {missing}"
    assert not twice, f"--agoq-* flags declared more than once: {twice}"
    # the only add_argument calls with a computed name are the generator's (each renders AGOQ_FLAGS)
    assert {site.split(":")[0] for site in computed} == {GENERATOR}, computed


def test_config_flags_come_from_agoq_config_and_the_door_adds_two():
    """Every --agoq-* flag but the door's own two (--agoq-attention, --agoq-log-json: no config field) and
    --agoq-preset is an AGOQ_FLAGS entry of agoq/config/__init__.py."""
    from agoq.config import AGOQ_FLAGS

    _, where, _ = declarations()
    in_config = {flag for flag, files in where.items() if files == ["agoq/config/__init__.py"]}
    assert in_config == {f.flag for f in AGOQ_FLAGS}
    rest = {flag: files for flag, files in where.items() if flag not in in_config}
    assert rest == {"--agoq-attention": ["agoq/train/megatron_lm.py"],
                    "--agoq-log-json": ["agoq/train/megatron_lm.py"], "--agoq-preset": [GENERATOR]}


def test_a_second_declaration_is_caught(tmp_path, monkeypatch):
    """The declaration count can fail: a hand-written copy of a generated flag in another file counts twice."""
    import tests.unit.test_cli_frozen as me

    (tmp_path / "agoq").mkdir()
    for rel in ("agoq/config/__init__.py", GENERATOR):
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((REPO_ROOT / rel).read_text())
    (tmp_path / "agoq" / "copy.py").write_text('def f(g):\n    g.add_argument("--agoq-grads-mode", default="store")\n')
    monkeypatch.setattr(me, "AGOQ", tmp_path / "agoq")
    monkeypatch.setattr(me, "REPO_ROOT", tmp_path)
    count, where, _ = me.declarations()
    assert count["--agoq-grads-mode"] == 2
    assert sorted(where["--agoq-grads-mode"]) == ["agoq/config/__init__.py", "agoq/copy.py"]


if __name__ == "__main__":
    FROZEN.write_text("# The --agoq-* flags of each parser (tests/unit/test_cli_frozen.py): parser, flag, kind, "
                      "choices, "
                      "default.\n"
                      "# Regenerate with: PYTHONPATH=. python tests/unit/test_cli_frozen.py\n"
                      + "\n".join(current_lines()) + "\n")
    print(f"wrote {FROZEN} ({len(current_lines())} lines)", file=sys.stderr)
