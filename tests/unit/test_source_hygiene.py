"""Two rules of agoq/'s source, by scan (ast and text): no module imports another package's private names, and no
docstring, comment or string points outside the repository or at an issue number.

Private: a name (or a module on the import path) that starts with one underscore. Inside one package (agoq.kernels'
modules among themselves) private names are shared freely; across packages only public names travel, so that what
one package uses of another is its stated interface. Seen by the scan: ``from agoq.x import _name``,
``from agoq.x._mod import name``, ``import agoq.x._mod`` and ``mod._name`` where ``mod`` was imported from agoq,
also inside functions.

Pointers: a reader of the repository has its files and public sources (papers by arXiv number, upstream projects'
issues as ``owner/repo#N``), not the team's notes beside it (``shared/spec``) nor its tracker's numbers
("issue 21", "#21"): a comment says the fact itself or names a page under docs/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from agoq.testing.procs import REPO_ROOT

AGOQ = REPO_ROOT / "agoq"

POINTERS = re.compile(
    r"(?P<spec>(?:\.\./)?shared/spec\b)"  # the team's notes beside the repository
    r"|(?P<issue>(?i:\bissues?\s*#?\d+))"  # "issue 21", "issues 9 and 27", "issue #44" (over a line break too)
    r"|(?P<hash>(?<![\w/.\-])#\d+\b)"  # a bare "#21" (an upstream "owner/repo#21" is a public citation)
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(module: str) -> str:
    """The package a module belongs to (a package is its own)."""
    path = REPO_ROOT.joinpath(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path) -> list[str]:
    """'line: what' for each private name of another package that ``path`` imports or reads off an agoq module."""
    home = _package_of(_module_name(path)) if path.name != "__init__.py" else _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found, aliases = [], {}  # local name -> agoq module it is bound to

    def check(lineno: int, module: str, name: str | None) -> None:
        full = f"{module}.{name}" if name else module
        is_module = name is not None and (REPO_ROOT.joinpath(*full.split(".")).with_suffix(".py").is_file()
                                          or REPO_ROOT.joinpath(*full.split(".")).is_dir())
        target = full if is_module or name is None else module
        private = [p for p in full.split(".") if _is_private(p)]
        if private and _package_of(target) != home:
            found.append(f"{lineno}: {full}")
        return target if is_module or name is None else None

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "agoq":
            for alias in node.names:
                target = check(node.lineno, node.module, alias.name)
                if target:
                    aliases[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "agoq":
                    check(node.lineno, alias.name, None)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _is_private(node.attr) and _package_of(aliases[node.value.id]) != home):
            found.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


def pointers(text: str) -> list[str]:
    """'line: match' for each pointer outside the repository or at an issue number in ``text``."""
    return [f"{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in POINTERS.finditer(text)]


def test_no_module_imports_another_packages_private_names():
    offenders = [f"{path.relative_to(REPO_ROOT)}:{where}"
                 for path in sorted(AGOQ.rglob("*.py")) for where in private_imports(path)]
    fix = "make the name public (rename it, update its callers) or move it to the package that uses it"
    assert offenders == [], fix + ":\n" + "\n".join(offenders)


def test_no_docstring_or_comment_points_outside_the_repository_or_at_an_issue():
    offenders = [f"{path.relative_to(REPO_ROOT)}:{where}"
                 for path in sorted(AGOQ.rglob("*.py")) for where in pointers(path.read_text())]
    fix = "say the fact itself, or name a page under docs/ (a paper by its arXiv number)"
    assert offenders == [], fix + ":\n" + "\n".join(offenders)


def test_the_private_scan_sees_what_it_forbids(tmp_path, monkeypatch):
    """The scan flags each form once, across packages only (a file placed in agoq/ops of a scratch repository)."""
    import sys

    module = sys.modules[__name__]
    root = tmp_path / "repo"
    for pkg in ("agoq/ops", "agoq/kernels"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "agoq/__init__.py").write_text("")
    for name in ("_launch", "quant"):
        (root / "agoq/kernels" / f"{name}.py").write_text("")
    (root / "agoq/ops/saved_act.py").write_text("")
    bad = root / "agoq/ops/bad.py"
    bad.write_text("from agoq.kernels.quant import _pow2\nfrom agoq.kernels import _launch\n"
                   "from agoq.kernels._launch import remember\nimport agoq.kernels._launch\n"
                   "from agoq.kernels import quant\n"
                   "def f():\n    from agoq.kernels.quant import _late\n    return quant._table\n")
    good = root / "agoq/ops/good.py"
    good.write_text("from agoq.ops.saved_act import _dequantize\nfrom agoq.ops import saved_act\n"
                    "from agoq.kernels.quant import quantize\nx = saved_act._Saved\n")
    monkeypatch.setattr(module, "REPO_ROOT", root)
    assert len(private_imports(bad)) == 6
    assert private_imports(good) == []


def test_the_pointer_scan_sees_what_it_forbids():
    text = ("see ../shared/spec/algorithms.md\n# (issue 21)\nfixed in #44\nthe validation of issue\n24 item 1\n"
            "issues 9 and 27\n")
    assert [w.split(":")[0] for w in pointers(text)] == ["1", "2", "3", "4", "6"]
    assert pointers("FlashOptim (arXiv 2602.23349); pytorch/torchtitan#1342; a reduction launches 3 kernels; "
                    "0x#12 color #fff") == []
