"""The docs check's checks (tests/unit/test_docs_commands.py states the rules): of a fenced command, a python block,
a page, an inline command and slurm/*'s flags. Each returns its problems as lines naming the page, line and command
(empty: fine).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from agoq.testing.procs import REPO_ROOT
from tests.unit._docs_commands import (
    BENCH_PRETRAIN,
    CONFIG_REF,
    NOT_RUN,
    OUTPUT_FLAGS,
    PRETRAIN,
    PYTEST_VALUE_OPTIONS,
    RECORDS,
    REPO_PATH,
    Block,
    Command,
    block_commands,
    doc_blocks,
    is_command_block,
    program_of,
    slurm_flags,
)
from tests.unit._docs_parsers import check_pretrain, parse_script_args, parser_options, run_in_process


def _torchrun_split(tokens: list[str]) -> tuple[list[str], str | None, list[str]]:
    """torchrun's own arguments, the script, the script's arguments."""
    for i, word in enumerate(tokens):
        if word.endswith(".py"):
            return tokens[:i], word, tokens[i + 1:]
    return tokens, None, []


def check_torchrun(cmd: Command, tokens: list[str], stand_in: Path) -> list[str]:
    from torch.distributed.run import get_args_parser

    own, script, script_args = _torchrun_split(tokens)
    if script is None:
        return [f"{cmd.where}: `{cmd.text}`: no script to run"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = get_args_parser().parse_args([*own, script, *script_args])
    except SystemExit:
        return [f"{cmd.where}: `{cmd.text}`: torchrun: {err.getvalue().strip()[-400:]}"]
    nnodes = int(str(ns.nnodes).split(":")[-1])
    nproc = int(ns.nproc_per_node) if str(ns.nproc_per_node).isdigit() else 1
    return check_script(cmd, script, script_args, nnodes * nproc, stand_in)


def check_script(cmd: Command, script: str, args: list[str], world_size: int, stand_in: Path) -> list[str]:
    script = os.path.normpath(script)
    if not (REPO_ROOT / script).is_file():
        return [f"{cmd.where}: `{cmd.text}`: {script} does not exist"]
    if script == PRETRAIN:
        problem = check_pretrain(args, world_size, stand_in)
    elif script == "scripts/prepare_data.py" and not args and not cmd.env:
        problem = run_in_process(script)  # RUN: the default dataset, in the session's shared cache
    else:
        problem = parse_script_args(script, args)
    if script == BENCH_PRETRAIN and not problem:
        return check_bench_only(cmd, args)
    return [f"{cmd.where}: `{cmd.text}`: {problem}"] if problem else []


def _declared_markers() -> set[str]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


def check_pytest(cmd: Command, args: list[str]) -> list[str]:
    problems, skip_next = [], None
    for word in args:
        if skip_next:
            if skip_next == "-m":
                unknown = set(re.findall(r"[A-Za-z_]\w*", word)) - {"and", "or", "not"} - _declared_markers()
                problems += [f"marker {m!r} is not declared in pyproject.toml" for m in sorted(unknown)]
            skip_next = None
        elif word in PYTEST_VALUE_OPTIONS:
            skip_next = word
        elif not word.startswith("-") and not (REPO_ROOT / word.split("::")[0]).exists():
            problems.append(f"{word.split('::')[0]} does not exist")
    return [f"{cmd.where}: `{cmd.text}`: {p}" for p in problems]


def check_launch(cmd: Command, stand_in: Path) -> list[str]:
    launcher = os.path.normpath(cmd.tokens[0])
    if not (REPO_ROOT / launcher).is_file():
        return [f"{cmd.where}: `{cmd.text}`: {launcher} does not exist"]
    if "--dry-run" not in cmd.tokens:
        return []  # submits a Slurm job: not run
    env = dict(os.environ, **cmd.env, PYTHON=sys.executable)
    proc = subprocess.run(["bash", launcher, *cmd.tokens[1:]], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, env=env)
    if proc.returncode:
        return [f"{cmd.where}: `{cmd.text}`: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}"]
    problems = []
    for line in proc.stdout.splitlines():  # the per-node torchrun commands it would run
        if line.startswith("[node ") and "torchrun" in line:
            tokens = shlex.split(line.split("] ", 1)[1])
            tokens = tokens[tokens.index("torchrun") + 1:]
            problems += check_torchrun(Command(f"{cmd.where} (dry run)", tokens), tokens, stand_in)
    return problems


def _is_placeholder(word: str) -> bool:
    return any(c in word for c in "<>$|{}[]") or word.startswith("...")


def check_paths(cmd: Command) -> list[str]:
    """Rule 6: the repository paths a command names exist (an output's folder, for an output flag), and no result
    file is written into docs/."""
    problems, previous = [], None
    for word in cmd.tokens:
        flag, value = (word.split("=", 1) if word.startswith("--") and "=" in word else (previous, word))
        previous = word
        path = value.split("::")[0]
        if not REPO_PATH.match(path) or _is_placeholder(path.replace("*", "")):
            continue
        if flag in OUTPUT_FLAGS:
            if not (REPO_ROOT / path).parent.is_dir():
                problems.append(f"{flag} {path}: the folder {Path(path).parent} does not exist")
            elif path.startswith("docs/") and Path(path).suffix in (".json", ".jsonl", ".log"):
                problems.append(f"{flag} {path}: results are written to benchmarks/results/, not docs/")
        elif not (list(REPO_ROOT.glob(path)) if "*" in path else (REPO_ROOT / path).exists()):
            problems.append(f"{path} does not exist")
    return [f"{cmd.where}: `{cmd.text}`: {p}" for p in problems]


@functools.cache
def _bench_pretrain_suites():
    spec = importlib.util.spec_from_file_location("_docs_bench_pretrain", REPO_ROOT / BENCH_PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SUITES


def check_bench_only(cmd: Command, args: list[str]) -> list[str]:
    """benchmarks/bench_pretrain.py: every ``--only`` / ``--skip`` filter matches a variant of the suite (the bench
    refuses one that matches nothing; a page should not show such a command)."""
    suite, smoke, only, i = "attention", "--smoke" in args, [], 0
    flag_of: dict[str, str] = {}
    while i < len(args):
        word = args[i]
        if word.startswith("--suite="):
            suite = word.split("=", 1)[1]
        elif word == "--suite" and i + 1 < len(args):
            suite = args[i + 1]
        elif word in ("--only", "--skip"):
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                only.append(args[i + 1])
                flag_of[args[i + 1]] = word
                i += 1
        i += 1
    suites = _bench_pretrain_suites()
    if not only or suite not in suites:  # an unknown suite is the parser's error
        return []
    names = [v["name"] for v in suites[suite](smoke)]
    return [f"{cmd.where}: `{cmd.text}`: {flag_of[text]} {text!r} matches no variant of suite {suite!r} (--list prints "
            "them)"
            for text in only if not _is_placeholder(text) and not any(text in name for name in names)]


def check_command(cmd: Command, stand_in: Path) -> list[str]:
    """Problems of one command (empty: fine); see the module docstring for the rules."""
    program = program_of(cmd.tokens[0])
    not_paths = program == "pytest" or program in NOT_RUN or cmd.tokens[1:3] in (["-m", "pytest"], ["-m", "pip"])
    paths = [] if not_paths else check_paths(cmd)
    return paths + _check_program(cmd, stand_in)


def _check_program(cmd: Command, stand_in: Path) -> list[str]:
    word, rest = cmd.tokens[0], cmd.tokens[1:]
    program = program_of(word)
    if program == "python":
        if rest[:2] == ["-m", "pip"]:
            return []  # installs packages: not run
        if rest[:2] == ["-m", "pytest"]:
            return check_pytest(cmd, rest[2:])
        if rest[:2] == ["-m", "torch.distributed.run"]:
            return check_torchrun(cmd, rest[2:], stand_in)
        if len(rest) > 1 and rest[0] == "-m" and rest[1].startswith("agoq"):
            problem = parse_script_args(rest[1], rest[2:], module=True)
            return [f"{cmd.where}: `{cmd.text}`: {problem}"] if problem else []
        if rest and rest[0].endswith(".py"):
            return check_script(cmd, rest[0], rest[1:], 1, stand_in)
    elif program == "torchrun":
        return check_torchrun(cmd, rest, stand_in)
    elif program == "pytest":
        return check_pytest(cmd, rest)
    elif program == "bash" and rest and rest[0].endswith(".sh"):
        return [] if (REPO_ROOT / rest[0]).is_file() else [f"{cmd.where}: `{cmd.text}`: {rest[0]} does not exist"]
    elif program == "launch.sh":
        return check_launch(cmd, stand_in)
    elif program in NOT_RUN:
        return []
    return [f"{cmd.where}: `{cmd.text}`: no docs-check rule for this command (add one to "
            "tests/unit/_docs_checks.py, or mark the block <!-- docs-check: skip (reason) -->)"]


def check_python_block(block: Block) -> list[str]:
    try:
        tree = ast.parse(block.body)
    except SyntaxError as exc:
        return [f"{block.where}: python block does not parse: {exc}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "agoq":
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                problems.append(f"{block.where}: from {node.module} import ...: {exc}")
                continue
            missing = [a.name for a in node.names if not hasattr(module, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            problems += [f"{block.where}: {node.module} has no {name!r}" for name in missing]
    return problems


def check_doc(path: Path, stand_in: Path, text: str | None = None) -> tuple[list[str], list[Command]]:
    problems, commands = [], []
    for block in doc_blocks(path, text):
        if block.skip:
            continue
        if block.lang == "python":
            problems += check_python_block(block)
        elif is_command_block(block):
            for cmd in block_commands(block):
                commands.append(cmd)
                if cmd.text not in RECORDS:
                    problems += check_command(cmd, stand_in)
    return problems, commands


def config_problems(where: str, text: str) -> list[str]:
    """Every ``configs/...yaml`` named (placeholders such as ``configs/model/<model>.yaml`` are not names)."""
    return [f"{where}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)} does not exist"
            for m in CONFIG_REF.finditer(text) if not (REPO_ROOT / m.group(0)).is_file()]


# ------------------------------------------------------------------------------------------------ slurm/


def slurm_problems(texts: dict[str, str]) -> list[str]:
    from torch.distributed.run import get_args_parser

    options = {"pretrain": parser_options(PRETRAIN), "torchrun": get_args_parser()._option_string_actions,
               "slurm_dryrun": parser_options("scripts/slurm_dryrun.py")}
    found = slurm_flags(texts)
    problems = [f"{where}: {flag} is not a flag of {owner}" for owner, flags in found.items()
                for where, flag in flags if flag not in options[owner]]
    problems += [p for name, text in texts.items() for p in config_problems(name, text)]
    for owner, flags in found.items():  # the extraction still finds them (an empty check would pass trivially)
        if not flags:
            problems.append(f"slurm/*: no {owner} flag found any more: update slurm_flags")
    return problems


# ------------------------------------------------------------------------------------------------ inline commands


def _choice_problems(options: dict[str, argparse.Action], args: list[str]) -> list[str]:
    """Values shown for flags with choices (``--suite memory``) that are not among them."""
    problems = []
    for i, word in enumerate(args):
        flag, _, inline_value = word.partition("=")
        action = options.get(flag) if word.startswith("--") else None
        if action is None or not action.choices:
            continue
        if inline_value:
            values = [inline_value]
        else:
            values = []
            for value in args[i + 1:]:
                if value.startswith("-") or (values and action.nargs not in ("+", "*")):
                    break
                values.append(value)
        choices = {str(c) for c in action.choices}
        problems += [f"{flag} {value!r} is not one of its choices ({', '.join(sorted(choices))})"
                     for value in values if not _is_placeholder(value) and value not in choices]
    return problems


def check_inline(cmd: Command, stand_in: Path) -> list[str]:
    """Inline commands are often abridged (``...``, placeholders): the program must exist and every ``--flag``
    shown must be one of its flags (with a value among its choices, if it has choices); pytest paths must exist."""
    if cmd.text in RECORDS:
        return []
    tokens = [t for t in cmd.tokens if t != "..."]
    word, rest = tokens[0], tokens[1:]
    if program_of(word) == "python" and rest[:2] == ["-m", "pytest"] or program_of(word) == "pytest":
        return check_pytest(cmd, rest[2:] if rest[:1] == ["-m"] else rest)
    paths = check_paths(Command(cmd.where, tokens))
    if program_of(word) == "launch.sh":
        return paths + ([] if (REPO_ROOT / word).is_file() else [f"{cmd.where}: `{cmd.text}`: {word} does not exist"])
    return paths + _check_inline_program(cmd, tokens)


def _check_inline_program(cmd: Command, tokens: list[str]) -> list[str]:
    word, rest = tokens[0], tokens[1:]
    if program_of(word) == "python" and len(rest) > 1 and rest[0] == "-m":
        target, module, args = rest[1], True, rest[2:]
        if rest[1] == "pip":
            return []
        if importlib.util.find_spec(target) is None:
            return [f"{cmd.where}: `{cmd.text}`: no module {target}"]
    else:
        scripts = [i for i, t in enumerate(tokens) if t.endswith(".py")]
        if not scripts:
            return [f"{cmd.where}: `{cmd.text}`: no docs-check rule for this command"]
        target, module, args = os.path.normpath(tokens[scripts[0]]), False, tokens[scripts[0] + 1:]
        if not (REPO_ROOT / target).is_file():
            return [f"{cmd.where}: `{cmd.text}`: {target} does not exist"]
    if not any(t.startswith("--") for t in args):
        return []  # named, not configured: nothing to check against its parser (and nothing is run)
    options = parser_options(target, module=module)
    if options is None:
        return [f"{cmd.where}: `{cmd.text}`: {target} builds no argparse parser"]
    unknown = [t.split("=")[0] for t in args if t.startswith("--") and t.split("=")[0] not in options]
    problems = [f"{target} has no flag {flag}" for flag in unknown] + _choice_problems(options, args)
    only = check_bench_only(cmd, args) if target == BENCH_PRETRAIN else []
    return [f"{cmd.where}: `{cmd.text}`: {p}" for p in problems] + only
