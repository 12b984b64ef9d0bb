"""The docs check (issue 21): every command in a fenced block of README.md, docs/**/*.md and benchmarks/README.md
is checked on the CPU, so a doc cannot show a flag, script, test file, config or API name that does not exist.
docs/benchmarks/ holds records of past runs: their commands are checked too (a record is what one re-runs), except
the few in RECORDS, kept as they ran on purpose (the page names today's form). slurm/*'s comments and flag lists
are checked by test_slurm_scripts_name_existing_flags.
The extraction is in tests/unit/_docs_commands.py, the checks in _docs_checks.py (scripts' parsers run in this
process by _docs_parsers.py); tests/unit/test_docs_check_catches.py shows the check failing on broken pages.

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

from pathlib import Path

import pytest

from agoq.testing.procs import REPO_ROOT
from tests.unit._docs_checks import check_doc, check_inline, config_problems, slurm_problems
from tests.unit._docs_commands import (
    DOC_FILES,
    PRETRAIN,
    RECORDS,
    SLURM_FILES,
    block_commands,
    doc_blocks,
    inline_commands,
    is_command_block,
)


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
