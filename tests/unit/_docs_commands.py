"""The docs check's extraction (tests/unit/test_docs_commands.py states the rules): the fenced blocks of a page and
their commands, commands quoted inline, and the flags slurm/* hands to agoq's programs. The checks of what is found
are in tests/unit/_docs_checks.py.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from agoq.testing.procs import REPO_ROOT

DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md")),
             REPO_ROOT / "benchmarks" / "README.md"]
SLURM_FILES = sorted((REPO_ROOT / "slurm").iterdir())
# Commands of docs/benchmarks kept as they were run (the page says what the flag is called now): command -> why.
RECORDS = {
    "python3 benchmarks/bench_quant.py --sweep --out sweep.json":
        "docs/benchmarks/log.md (quant suite, run B): the command as run; the page says --sweep is now --variants",
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
    return bool(first) and (program_of(first[0]) is not None)


def program_of(word: str) -> str | None:
    if PYTHONS.match(word):
        return "python"
    name = word.rsplit("/", 1)[-1]
    if name in ("torchrun", "pytest", "bash", "launch.sh") or word in NOT_RUN:
        return name if word not in NOT_RUN else word
    return None


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
