"""The docs check (issue 21): every command in a fenced block of README.md, docs/**/*.md and benchmarks/README.md
is checked on the CPU, so a doc cannot show a flag, script, test file, config or API name that does not exist.
docs/benchmarks/ holds records of past runs: their commands are checked too (a record is what one re-runs), except
the few in RECORDS, kept as they ran on purpose (the page names today's form). slurm/*'s comments and flag lists
are checked by test_slurm_scripts_name_existing_flags.

Rules, in order (the first that applies decides):

1. A block whose previous non-blank line is ``<!-- docs-check: skip (reason) -->`` is not read.
2. A block is a command block when its language is bash/sh/shell/console, or it has none and its first word is a
   program below. Other blocks are output, diagrams or YAML; ``python`` blocks are API sketches: they must parse,
   and every ``from agoq... import name`` in them must resolve.
3. In a command block, continuation lines are joined, ``# comments`` dropped, and commands split at ``&&`` and
   ``;``. ``VAR=value`` prefixes and ``export VAR=...`` lines set the environment of what follows in the block.
   A lone ``...`` argument means "more flags" and is dropped.
4. Each command (every one gets a rule; a command no rule knows fails the check):
   - ``python|python3 scripts/X.py ARGS`` and ``torchrun [TORCHRUN FLAGS] scripts/X.py ARGS`` (any path to the
     interpreter): the script's own parser must accept ARGS. The script runs in this process only until its
     ``parse_args`` returns, then it is stopped: nothing trains, downloads or writes (GPU, multi-node, long and
     network commands are all checked this way, none is run). ``scripts/pretrain_llama.py`` gets its full
     start-up check (config keys, policy rules, layout against torchrun's ``--nnodes`` x ``--nproc-per-node``,
     batch sizes); files that are yours to provide (``--tokenizer-model``) are stood in for. torchrun's own flags
     must pass torch.distributed.run's parser. The README's first command also runs in full in
     tests/megatron/test_pretrain_script.py::test_pp2_1f1b_loss_falls.
   - RUN (seconds on the CPU): ``python scripts/prepare_data.py`` without arguments (the default dataset, in the
     test session's shared cache) and ``slurm/launch.sh --dry-run ...`` (fake Slurm; the per-node torchrun
     command it prints gets the pretrain check as well) run for real and must exit 0.
   - ``pytest`` / ``python -m pytest``: every test path exists and ``-m`` names declared markers (running the
     tests is the suite's job).
   - ``python -m agoq.X ARGS``: as a script, by module.
   - ``bash scripts/X.sh``: the file exists; not run (setup_env.sh installs packages, run_tests.sh is the suite).
   - ``slurm/launch.sh`` without ``--dry-run`` submits a job: the file exists; not run.
   - ``pip``, ``python -m pip``, ``.``/``source``, ``cd``, ``rm``, ``mkdir``: install / shell state / destructive:
     not run.
5. Commands quoted inline (`` `python scripts/x.py --flag ...` ``, `` `python -m agoq.plan ...` ``, torchrun,
   ``slurm/launch.sh``, pytest) are often abridged: the program must exist and every ``--flag`` shown must be one
   of its parser's flags, with a value among its choices where the flag has choices (``--suite``); pytest paths
   must exist. A script quoted without flags is only looked up, not run.
6. Every command, fenced or inline: a path of this repository in it (``configs/``, ``scripts/``, ``benchmarks/``,
   ``tests/``, ``slurm/``, ``agoq/``, ``docs/``; ``data/`` is yours to fill) exists, or for an output flag
   (``--out``, ``--json``, ...) its folder does, and no result (.json, .log) is written into docs/ (results live
   in benchmarks/results/). ``benchmarks/bench_pretrain.py``: every ``--only`` filter matches a variant name of
   the suite (``--list`` prints them). Every ``configs/...yaml`` the pages (and slurm/*) name exists.
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
import runpy
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agoq.testing.procs import REPO_ROOT

DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md")),
             REPO_ROOT / "benchmarks" / "README.md"]
SLURM_FILES = sorted((REPO_ROOT / "slurm").iterdir())
# Commands of docs/benchmarks kept as they were run (the page says what the flag is called now): command -> why.
RECORDS = {
    "python3 benchmarks/bench_quant.py --sweep --out sweep.json":
        "docs/benchmarks/quant.md run B's command as run; the page says --sweep is now --variants",
}
SKIP_MARK = re.compile(r"<!--\s*docs-check:\s*skip\s*\((?P<reason>.+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
SHELL_LANGS = ("bash", "sh", "shell", "console")
PYTHONS = re.compile(r"^(.*/)?python(3(\.\d+)?)?$")
NOT_RUN = {"pip": "installs packages", "pip3": "installs packages", ".": "shell state", "source": "shell state",
           "cd": "shell state", "rm": "deletes files", "mkdir": "creates directories"}
PYTEST_VALUE_OPTIONS = ("-m", "-k", "-n", "-p", "-c", "-o", "-W", "--dist", "--durations", "--maxfail", "--rootdir",
                        "--deselect", "--ignore")
PRETRAIN = "scripts/pretrain_llama.py"
BENCH_PRETRAIN = "benchmarks/bench_pretrain.py"
REPO_PATH = re.compile(r"^(configs|scripts|benchmarks|tests|slurm|agoq|docs)/")
OUTPUT_FLAGS = ("--out", "--json", "--output", "--output-prefix", "--out-dir", "--save")
CONFIG_REF = re.compile(r"(?<![\w/.-])configs/[\w./-]+\.ya?ml\b")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    body: str
    skip: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


@dataclass
class Command:
    where: str
    tokens: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return shlex.join(self.tokens)


def doc_blocks(path: Path, text: str | None = None) -> list[Block]:
    text = path.read_text() if text is None else text
    blocks = []
    for m in FENCE.finditer(text):
        before = [line for line in text[:m.start()].splitlines() if line.strip()]
        mark = SKIP_MARK.search(before[-1]) if before else None
        body = "\n".join(line.removeprefix(m["indent"]) for line in m["body"].splitlines())
        blocks.append(Block(path, text[:m.start()].count("\n") + 1, m["lang"], body, mark["reason"] if mark else None))
    return blocks


def _logical_lines(body: str) -> list[str]:
    lines, current = [], ""
    for raw in body.splitlines():
        current += raw
        if current.rstrip().endswith("\\"):
            current = current.rstrip()[:-1] + " "
            continue
        lines.append(current)
        current = ""
    return lines + ([current] if current.strip() else [])


def block_commands(block: Block) -> list[Command]:
    env: dict[str, str] = {}
    commands = []
    for line in _logical_lines(block.body):
        tokens = shlex.split(line, comments=True)
        while tokens:
            cut = next((i for i, t in enumerate(tokens) if t in ("&&", ";", "||")), len(tokens))
            words, tokens = tokens[:cut], tokens[cut + 1:]
            if words and words[0] == "export":
                env.update(w.split("=", 1) for w in words[1:] if "=" in w)
                continue
            own_env = dict(env)
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                key, value = words.pop(0).split("=", 1)
                own_env[key] = value
            if words:
                commands.append(Command(block.where, [w for w in words if w != "..."], own_env))
    return commands


def is_command_block(block: Block) -> bool:
    if block.lang in SHELL_LANGS:
        return True
    if block.lang:
        return False
    first = _logical_lines(block.body)[0].split() if block.body.strip() else []
    while first and "=" in first[0] and not first[0].startswith("-"):
        first = first[1:]
    return bool(first) and (_program(first[0]) is not None)


def _program(word: str) -> str | None:
    if PYTHONS.match(word):
        return "python"
    name = word.rsplit("/", 1)[-1]
    if name in ("torchrun", "pytest", "bash", "launch.sh") or word in NOT_RUN:
        return name if word not in NOT_RUN else word
    return None


# ------------------------------------------------------------------------------------------------ the checks


class _Parsed(Exception):  # noqa: N818 (a stop signal, not an error)
    pass


@contextlib.contextmanager
def _process_state():
    """A script run in this process may set os.environ, sys.path or sys.argv: put them back."""
    environ, path, argv = dict(os.environ), list(sys.path), list(sys.argv)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        sys.argv[:] = argv


def parse_script_args(target: str, args: list[str], *, module: bool = False) -> str | None:
    """Run ``target`` (a script path or a module) in this process until its argparse parser has parsed
    ``args``; None when it accepts them, else its error text."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    err = io.StringIO()
    with _process_state(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        argparse.ArgumentParser.parse_args = parse_then_stop
        sys.argv[:] = [target, *args]
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO_ROOT / target), run_name="__main__")
        except _Parsed:
            return None
        except SystemExit as exc:
            if exc.code in (0, None):
                return None  # --help
            return f"exit {exc.code}: {err.getvalue().strip()[-600:]}"
        finally:
            argparse.ArgumentParser.parse_args = original
    return f"{target} finished without parsing a command line (no rule for it)"


def check_pretrain(args: list[str], world_size: int, stand_in: Path) -> str | None:
    """scripts/pretrain_llama.py's start-up checks on ``args`` (without reading your data files)."""
    from agoq.megatron.train.args import check_layout, parse_args

    args = list(args)
    for i, word in enumerate(args[:-1]):
        if word == "--tokenizer-model" and not (REPO_ROOT / args[i + 1]).is_file():
            args[i + 1] = str(stand_in)  # yours to provide
    err = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(REPO_ROOT)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parse_args(args, quiet=False)
        check_layout(ns, world_size)
        from agoq.megatron.model import ParallelLayout
        from agoq.megatron.train.pretrain import num_microbatches

        layout = ParallelLayout(tp=ns.tensor_model_parallel_size, pp=ns.pipeline_model_parallel_size, vpp=ns.vpp)
        num_microbatches(ns, layout, world_size)
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip()
    except ValueError as exc:
        return str(exc)
    finally:
        os.chdir(cwd)
    return None


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


def run_in_process(script: str) -> str | None:
    err = io.StringIO()
    with _process_state(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        sys.argv[:] = [script]
        try:
            runpy.run_path(str(REPO_ROOT / script), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                return f"exit {exc.code}: {err.getvalue().strip()[-600:]}"
    return None


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
    """benchmarks/bench_pretrain.py: every ``--only`` filter matches a variant of the suite (a filter that matches
    nothing is silently dropped by the bench as long as another one matches)."""
    suite, smoke, only, i = "attention", "--smoke" in args, [], 0
    while i < len(args):
        word = args[i]
        if word.startswith("--suite="):
            suite = word.split("=", 1)[1]
        elif word == "--suite" and i + 1 < len(args):
            suite = args[i + 1]
        elif word == "--only":
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                only.append(args[i + 1])
                i += 1
        i += 1
    suites = _bench_pretrain_suites()
    if not only or suite not in suites:  # an unknown suite is the parser's error
        return []
    names = [v["name"] for v in suites[suite](smoke)]
    return [f"{cmd.where}: `{cmd.text}`: --only {text!r} matches no variant of suite {suite!r} (--list prints them)"
            for text in only if not _is_placeholder(text) and not any(text in name for name in names)]


def check_command(cmd: Command, stand_in: Path) -> list[str]:
    """Problems of one command (empty: fine); see the module docstring for the rules."""
    program = _program(cmd.tokens[0])
    not_paths = program == "pytest" or program in NOT_RUN or cmd.tokens[1:3] in (["-m", "pytest"], ["-m", "pip"])
    paths = [] if not_paths else check_paths(cmd)
    return paths + _check_program(cmd, stand_in)


def _check_program(cmd: Command, stand_in: Path) -> list[str]:
    word, rest = cmd.tokens[0], cmd.tokens[1:]
    program = _program(word)
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
            "tests/unit/test_docs_commands.py, or mark the block <!-- docs-check: skip (reason) -->)"]


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

SHELL_FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def slurm_flags(texts: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """The flags slurm/* hands to agoq's programs or documents for them, by program ("pretrain": the trainer via
    the sbatch script's train_args and its environment table; "torchrun": slurm/node.sh's torchrun_args;
    "slurm_dryrun": what launch.sh passes scripts/slurm_dryrun.py and its usage comment's ``--dry-run ...``);
    sbatch's and srun's own flags are Slurm's and not listed. Values: (where, flag)."""
    found: dict[str, list[tuple[str, str]]] = {"pretrain": [], "torchrun": [], "slurm_dryrun": []}
    for name, text in texts.items():
        in_torchrun = False
        for number, line in enumerate(text.splitlines(), 1):
            where, comment = f"{name}:{number}", line.lstrip().startswith("#")
            if re.match(r"\s*torchrun_args=\(", line):
                in_torchrun = True
            owner, tail = None, line
            if in_torchrun:
                owner = "torchrun"
                in_torchrun = not line.strip().endswith(")") or line.strip().endswith("=(")
            elif not comment and re.search(r"\btrain_args\+?=\(", line):
                owner = "pretrain"
            elif comment and re.match(r"#\s+[A-Z][A-Z_]+\s{2,}", line):  # the sbatch script's environment table
                owner = "pretrain"
            elif not comment and "scripts/slurm_dryrun.py" in line:
                owner, tail = "slurm_dryrun", line.split("scripts/slurm_dryrun.py", 1)[1]
            elif comment and "launch.sh --dry-run" in line:
                owner, tail = "slurm_dryrun", line.split("launch.sh --dry-run", 1)[1]
            if owner:
                found[owner] += [(where, flag) for flag in SHELL_FLAG.findall(tail)]
    return found


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

INLINE = re.compile(r"`(?P<cmd>((\S*/)?python3?\s|torchrun\s|(\S*/)?(scripts|benchmarks)/\S+\.py\s+--|"
                    r"slurm/launch\.sh\s)[^`]*)`")


def inline_commands(path: Path, text: str | None = None) -> list[Command]:
    """Commands quoted inline (`python scripts/x.py --flag ...`) outside fenced blocks."""
    text = path.read_text() if text is None else text
    outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    commands = []
    for m in INLINE.finditer(outside):
        line = outside[:m.start()].count("\n") + 1
        try:
            tokens = shlex.split(m["cmd"].replace("\n", " "))
        except ValueError:
            tokens = m["cmd"].split()
        commands.append(Command(f"{path.relative_to(REPO_ROOT)}:{line} (inline)", tokens))
    return commands


def parser_options(target: str, *, module: bool = False) -> dict[str, argparse.Action] | None:
    """The options (option string -> action) of the parser ``target`` builds (run in this process until it
    parses)."""
    if target == PRETRAIN:
        from agoq.megatron.train.args import build_parser

        return dict(build_parser()._option_string_actions)
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    with _process_state(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        argparse.ArgumentParser.parse_args = capture
        sys.argv[:] = [target]
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(REPO_ROOT / target), run_name="__main__")
        except _Parsed as parsed:
            return dict(parsed.args[0]._option_string_actions)
        except SystemExit:
            return None
        finally:
            argparse.ArgumentParser.parse_args = original
    return None


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
    if _program(word) == "python" and rest[:2] == ["-m", "pytest"] or _program(word) == "pytest":
        return check_pytest(cmd, rest[2:] if rest[:1] == ["-m"] else rest)
    paths = check_paths(Command(cmd.where, tokens))
    if _program(word) == "launch.sh":
        return paths + ([] if (REPO_ROOT / word).is_file() else [f"{cmd.where}: `{cmd.text}`: {word} does not exist"])
    return paths + _check_inline_program(cmd, tokens)


def _check_inline_program(cmd: Command, tokens: list[str]) -> list[str]:
    word, rest = tokens[0], tokens[1:]
    if _program(word) == "python" and len(rest) > 1 and rest[0] == "-m":
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


# ------------------------------------------------------------------------------------------------ the tests


@pytest.fixture
def stand_in(tmp_path) -> Path:
    path = tmp_path / "stand_in.tokenizer.model"
    path.write_bytes(b"stand-in: checked for existence only")
    return path


def test_every_documented_command_is_accepted(stand_in, agoq_cache, monkeypatch):
    monkeypatch.setenv("AGOQ_CACHE", str(agoq_cache))  # the RUN of prepare_data.py reuses the session's dataset
    problems, commands = [], []
    for path in DOC_FILES:
        found, cmds = check_doc(path, stand_in)
        problems += found
        commands += cmds
    for path in DOC_FILES:
        for cmd in inline_commands(path):
            problems += check_inline(cmd, stand_in)
    for path in DOC_FILES:
        problems += config_problems(str(path.relative_to(REPO_ROOT)), path.read_text())
    assert problems == [], "\n".join(problems)
    scripts = {t for c in commands for t in c.tokens if t.endswith(".py")}
    # the extraction really found the documented commands (an empty check would pass trivially)
    assert len(commands) >= 30 and {PRETRAIN, "scripts/prepare_data.py"} <= scripts, [c.text for c in commands]


@pytest.mark.parametrize("snippet, expected", [
    ("```bash\npython scripts/pretrain_llama.py --config configs/model/tiny.yaml --no-such-flag\n```",
     "unrecognized arguments: --no-such-flag"),
    ("```bash\ntorchrun --nproc-per-node 2 scripts/pretrain_llama.py --config configs/model/tiny.yaml \\\n"
     "    --pipeline-model-parallel-size 4\n```", "world size 2 is not divisible"),
    ("```bash\ntorchrun --nproc-per-node 2 --no-such-torchrun-flag scripts/pretrain_llama.py\n```", "torchrun:"),
    ("```bash\npython scripts/train_tokenizer.py --output x.model --vocab-size-typo 5\n```",
     "unrecognized arguments"),
    ("```\npytest tests/unit/test_no_such_file.py -m 'not gpu and nightly'\n```", "does not exist"),
    ("```\npytest tests/unit/test_args.py -m nightly\n```", "marker 'nightly' is not declared"),
    ("```bash\nmake everything\n```", "no docs-check rule"),
    ("```python\nfrom agoq.policy import load_policy, no_such_function\n```", "has no 'no_such_function'"),
])
def test_the_check_fails_on_a_wrong_doc(snippet, expected, stand_in):
    problems, _ = check_doc(REPO_ROOT / "docs" / "example.md", stand_in, text=f"intro\n\n{snippet}\n")
    assert any(expected in p for p in problems), problems


def test_inline_commands_name_existing_flags(stand_in):
    text = ("Run `python scripts/prepare_data.py --input ... --output-prefix ...` or\n"
            "`python -m agoq.plan --model configs/model/x.yaml --no-such-plan-flag 3`, then\n"
            "`python scripts/pretrain_llama.py --agoq-typo`.\n")
    problems = [p for cmd in inline_commands(REPO_ROOT / "docs" / "example.md", text)
                for p in check_inline(cmd, stand_in)]
    assert len(problems) == 3, problems
    assert "configs/model/x.yaml does not exist" in problems[0], problems
    assert "no flag --no-such-plan-flag" in problems[1] and "no flag --agoq-typo" in problems[2], problems


@pytest.mark.parametrize("inline, expected", [
    ("python3 benchmarks/bench_pretrain.py --suite memroy --out m.json", "--suite 'memroy' is not one of its choices"),
    ("python3 benchmarks/bench_pretrain.py --suite=memroy --out m.json", "--suite 'memroy' is not one of its choices"),
    ("python3 benchmarks/bench_pretrain.py --suite fp8_scale --only '7b-layers/mbs1/fp8 delayed' 13b --out x.json",
     "--only '13b' matches no variant of suite 'fp8_scale'"),
    ("benchmarks/bench_pretrain.py --only 1b/mbs4/fp8", "--only '1b/mbs4/fp8' matches no variant of suite 'attention'"),
    ("python benchmarks/bench_fp8.py --profile --out docs/benchmarks/fp8.json", "results are written to benchmarks"),
    ("python benchmarks/bench_fp8.py --profile --out benchmarks/no_such_dir/fp8.json", "folder benchmarks/no_such_dir"),
    ("python -m agoq.plan --model configs/model/llama-1b.yaml --policies bf16 --out c.yaml", None),
    ("python -m agoq.no_such_module --x 1", "no module agoq.no_such_module"),
    ("torchrun --nproc-per-node 1 scripts/pretrain_llama.py --agoq-fp8 delayd", "--agoq-fp8 'delayd' is not one"),
    ("python3 -m pip install -e .", None),
])
def test_inline_values_suites_and_paths(inline, expected, stand_in):
    problems = [p for cmd in inline_commands(REPO_ROOT / "docs" / "example.md", f"Run `{inline}`.\n")
                for p in check_inline(cmd, stand_in)]
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


def test_fenced_bench_only_and_paths(stand_in):
    text = ("```bash\npython3 benchmarks/bench_pretrain.py --suite fp8_scale --only '1b/mbs4/fp8 delayd' "
            "--out x.json\npython3 -m pip install -q x.whl && python3 benchmarks/bench_quant.py --check "
            "--configs-from benchmarks/results/no_such.json --out q.json\n```\n")
    problems, commands = check_doc(REPO_ROOT / "docs" / "example.md", stand_in, text=text)
    assert len(commands) == 3 and len(problems) == 2, problems
    assert "--only '1b/mbs4/fp8 delayd' matches no variant" in problems[0], problems
    assert "benchmarks/results/no_such.json does not exist" in problems[1], problems


def test_skip_marker_and_block_classification(stand_in):
    text = ("<!-- docs-check: skip (needs a GPU cluster) -->\n```bash\nmake everything\n```\n\n"
            "```\nlayers  pp  vp\n0-1     0   -\n```\n\n```yaml\nversion: 1\n```\n")
    problems, commands = check_doc(REPO_ROOT / "docs" / "example.md", stand_in, text=text)
    assert problems == [] and commands == []


def test_slurm_scripts_name_existing_flags():
    texts = {str(p.relative_to(REPO_ROOT)): p.read_text() for p in SLURM_FILES}
    assert slurm_problems(texts) == []
    broken = dict(texts)
    broken["slurm/node.sh"] = texts["slurm/node.sh"].replace("--rdzv-backend", "--rdzv-backnd")
    broken["slurm/pretrain.sbatch"] = (texts["slurm/pretrain.sbatch"].replace("--agoq-policy", "--agoq-polcy")
                                       .replace("llama3-8b.yaml", "llama3-9b.yaml"))
    broken["slurm/launch.sh"] = texts["slurm/launch.sh"].replace("[--nodelist", "[--node-list")
    problems = slurm_problems(broken)
    for expected in ("--rdzv-backnd is not a flag of torchrun", "--node-list is not a flag of slurm_dryrun",
                     "configs/model/llama3-9b.yaml does not exist"):
        assert any(expected in p for p in problems), problems
    assert sum("--agoq-polcy is not a flag of pretrain" in p for p in problems) == 2, problems


def test_records_are_still_on_their_pages():
    """A RECORDS entry whose command left the docs is stale: remove it."""
    text = "\n".join(p.read_text() for p in DOC_FILES)
    commands = {c.text for p in DOC_FILES for c in inline_commands(p)}
    commands |= {c.text for p in DOC_FILES for b in doc_blocks(p) if is_command_block(b) for c in block_commands(b)}
    assert text and not set(RECORDS) - commands, set(RECORDS) - commands

