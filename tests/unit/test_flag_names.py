"""House rule 2, one declaration per option: a message names an ``--agoq-*`` flag through
``agoq.config.flag_for(field)`` (derived from AGOQ_FLAGS), never by spelling it out, so renaming a flag renames every
message that names it. The AST scan below finds runtime strings (plain strings and f-string parts; docstrings and
comments are prose and stay) that spell a flag in agoq/, outside the layers below agoq.config, and every mention of
an ``--agoq-*`` name in agoq/ (prose included) must be a flag some parser offers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agoq.config import AGOQ_FLAGS, FLAG_OF_FIELD, AgoqConfig, flag_for
from agoq.testing.procs import REPO_ROOT

AGOQ = REPO_ROOT / "agoq"

# Packages below agoq.config (docs/../architecture.md 8.1, 8.3: agoq.config imports agoq.policy and agoq.formats;
# kernels and references never see a config; ops / optim / comm build on formats, ref, kernels and ops only): they
# may not import flag_for, so their messages spell the flag out (the mention test below still checks the names).
BELOW_CONFIG = ("agoq/policy/", "agoq/formats.py", "agoq/ref/", "agoq/kernels/", "agoq/ops/", "agoq/optim/",
                "agoq/comm/")
# --agoq-* flags that set no AgoqConfig field (flag_for has none of them), and the files that may spell each
NON_CONFIG_FLAGS = {
    # the Megatron-LM door's own flags (agoq.train.megatron_lm.add_agoq_args); the plugin's messages name them and
    # the plugin may not import the trainer
    "--agoq-attention": ("agoq/train/megatron_lm.py", "agoq/megatron/attention.py", "agoq/megatron/built_check.py"),
    "--agoq-log-json": ("agoq/train/megatron_lm.py", "agoq/megatron/megatron_lm.py"),
    # declared once as agoq.cli.agoq_flags.PRESET_FLAG, which its messages use
    "--agoq-preset": ("agoq/cli/agoq_flags.py",),
}
FLAG_DECLARATIONS = "agoq/config/__init__.py"  # AGOQ_FLAGS: AgoqFlag("--agoq-...", field) spells each flag once
NAME = re.compile(r"--agoq-[a-z0-9][a-z0-9-]*")


def _prose(tree: ast.AST) -> set[int]:
    """ids of the string constants that are statements: docstrings and attribute docstrings (prose)."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _declarations(tree: ast.AST) -> set[int]:
    """ids of the first argument of each AgoqFlag(...) call (the flag table's own spellings)."""
    return {id(node.args[0]) for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
            and isinstance(node.func, ast.Name) and node.func.id == "AgoqFlag"}


def runtime_spellings(path: Path, rel: str) -> list[str]:
    """'rel:line: flag' for each --agoq-* name in a runtime string of one file (a plain string or an f-string part,
    not a docstring; AGOQ_FLAGS's own entries and the NON_CONFIG_FLAGS a file may spell are left out), in order."""
    tree = ast.parse(path.read_text(), filename=rel)
    skip = _prose(tree) | (_declarations(tree) if rel == FLAG_DECLARATIONS else set())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += [((node.lineno, node.col_offset), f"{rel}:{node.lineno}: {name}")
                      for name in NAME.findall(node.value) if rel not in NON_CONFIG_FLAGS.get(name, ())]
    return [hit for _, hit in sorted(found, key=lambda pair: pair[0])]


def _agoq_files():
    for path in sorted(AGOQ.rglob("*.py")):
        yield path.relative_to(REPO_ROOT).as_posix(), path


def _hint(finding: str) -> str:
    name = finding.rsplit(" ", 1)[1]
    field = {flag: field for field, flag in FLAG_OF_FIELD.items()}.get(name)
    return f"{finding} -> flag_for({field!r})" if field else f"{finding} (no such AgoqConfig flag)"


# -- the helper ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", AGOQ_FLAGS, ids=lambda f: f.flag)
def test_flag_for_gives_each_declared_flag(entry):
    assert flag_for(entry.field) == entry.flag
    # the field is a real AgoqConfig field (or a section's): the key a message passes names the setting
    owner = AgoqConfig if not entry.section else type(getattr(AgoqConfig(), entry.section))
    assert entry.name in owner.__dataclass_fields__, entry.field


def test_flag_for_covers_every_declared_flag_once():
    assert sorted(FLAG_OF_FIELD.values()) == sorted(f.flag for f in AGOQ_FLAGS)
    assert len(FLAG_OF_FIELD) == len(AGOQ_FLAGS), "two AGOQ_FLAGS entries set one field"
    with pytest.raises(TypeError):
        FLAG_OF_FIELD["grads.format"] = "--agoq-x"  # a read-only view: the table is declared once


def test_flag_for_follows_a_renamed_flag(monkeypatch):
    """Derived, not a second list: renaming an AGOQ_FLAGS entry renames what flag_for gives (and a message's text)."""
    import agoq.config as config
    from agoq.config.sections import GradsConfig

    renamed = {**config.FLAG_OF_FIELD, "grads.mode": "--agoq-grad-mode"}
    monkeypatch.setattr(config, "FLAG_OF_FIELD", renamed)
    assert flag_for("grads.mode") == "--agoq-grad-mode"
    with pytest.raises(ValueError, match=r"^--agoq-grad-mode 'sideways': choose one of"):
        GradsConfig(mode="sideways")


@pytest.mark.parametrize("field", ["grads.formt", "format", "--agoq-grads", "agoq_grads", ""])
def test_flag_for_refuses_an_unknown_field(field):
    with pytest.raises(KeyError, match=r"no --agoq-\* flag sets the AgoqConfig field .*grads\.format, grads\.mode"):
        flag_for(field)


# -- no runtime string spells a flag ------------------------------------------------------------------------------


def test_no_runtime_string_spells_an_agoq_flag_ast_scan():
    found = [hit for rel, path in _agoq_files() if not rel.startswith(BELOW_CONFIG)
             for hit in runtime_spellings(path, rel)]
    assert found == [], ("name the flag with agoq.config.flag_for(field) (a lazy copy in agoq.config.values for the "
                         "config package itself):\n" + "\n".join(map(_hint, found)))


def test_the_scan_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""--agoq-grads in a docstring is prose."""\n'
                   'class C:\n    x: int = 1\n    """--agoq-fp8 in an attribute docstring too."""\n'
                   'def f(fmt):\n    """--agoq-optimizer: prose."""\n'
                   '    # --agoq-master in a comment\n'
                   '    raise ValueError(f"{fmt} needs --agoq-grads-mode store, " "or --agoq-disable")\n'
                   'HELP = {"x": "use --agoq-attention megatron", "y": "--agoq-preset NAME"}\n'
                   'AgoqFlag("--agoq-policy", "policy.path")\n')
    found = runtime_spellings(bad, "agoq/megatron/attention.py")
    assert found == ["agoq/megatron/attention.py:8: --agoq-grads-mode", "agoq/megatron/attention.py:8: --agoq-disable",
                     "agoq/megatron/attention.py:9: --agoq-preset", "agoq/megatron/attention.py:10: --agoq-policy"]
    assert [_hint(f) for f in found[:2]] == [
        "agoq/megatron/attention.py:8: --agoq-grads-mode -> flag_for('grads.mode')",
        "agoq/megatron/attention.py:8: --agoq-disable -> flag_for('enabled')"]
    # --agoq-attention only where NON_CONFIG_FLAGS lists it; AgoqFlag(...) spellings only in the flag table
    assert [f.rsplit(" ", 1)[1] for f in runtime_spellings(bad, "agoq/train/other.py")] == [
        "--agoq-grads-mode", "--agoq-disable", "--agoq-attention", "--agoq-preset", "--agoq-policy"]
    assert [f.rsplit(" ", 1)[1] for f in runtime_spellings(bad, FLAG_DECLARATIONS)] == [
        "--agoq-grads-mode", "--agoq-disable", "--agoq-attention", "--agoq-preset"]


def test_the_flag_table_is_the_only_literal_of_each_config_flag():
    """The scan leaves out AGOQ_FLAGS's entries (the one declaration): they are all there, in the table's file."""
    tree = ast.parse((REPO_ROOT / FLAG_DECLARATIONS).read_text())
    declared = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and id(node) in
                _declarations(tree)]
    assert declared == [f.flag for f in AGOQ_FLAGS]


def test_exemptions_are_still_needed():
    """Each NON_CONFIG_FLAGS entry is a flag a parser offers that sets no config field and is still spelled in each
    file listed; each package BELOW_CONFIG exists and imports no agoq.config (else it can use flag_for)."""
    from tests.unit.test_cli_frozen import current_lines

    offered = {line.split()[1] for line in current_lines()}
    assert set(NON_CONFIG_FLAGS) == offered - set(FLAG_OF_FIELD.values())
    for flag, files in NON_CONFIG_FLAGS.items():
        for rel in files:
            tree = ast.parse((REPO_ROOT / rel).read_text())
            spelled = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and id(n) not in _prose(tree) and flag in NAME.findall(n.value)]
            assert spelled, f"{rel} no longer spells {flag}: drop it from NON_CONFIG_FLAGS"
    for prefix in BELOW_CONFIG:
        paths = [REPO_ROOT / prefix] if prefix.endswith(".py") else sorted((REPO_ROOT / prefix).rglob("*.py"))
        assert paths and all(p.is_file() for p in paths), prefix
        for path in paths:
            text = path.read_text()
            assert "agoq.config" not in {n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)}


# -- every --agoq-* name agoq mentions exists ----------------------------------------------------------------------


def test_every_agoq_flag_named_in_agoq_exists():
    """Docstrings, comments and the layers below agoq.config spell flags out: each name must be a flag a parser
    offers (``--agoq-fp8-bf16-*-layers``-style families: a prefix of one), so a renamed flag leaves no stale text."""
    from tests.unit.test_cli_frozen import current_lines

    offered = {line.split()[1] for line in current_lines()}
    stale = []
    for rel, path in _agoq_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in NAME.finditer(line):
                name, after = match.group(), line[match.end():match.end() + 1]
                family = (name.endswith("-") or after == "*") and any(f.startswith(name) for f in offered)
                if name not in offered and not family:
                    stale.append(f"{rel}:{number}: {name}")
    assert stale == [], "no such --agoq-* flag (renamed or removed?):\n" + "\n".join(stale)
