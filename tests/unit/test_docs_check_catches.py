"""The docs check (tests/unit/test_docs_commands.py states its rules) fails on pages that break them: unknown flags,
bad layouts, torchrun flags, missing test files and markers, commands no rule knows, python blocks importing
names that do not exist, inline flags and choices, bench --only filters, output paths; and it skips what it should.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agoq.testing.procs import REPO_ROOT
from tests.unit._docs_checks import check_doc, check_inline
from tests.unit._docs_commands import inline_commands


@pytest.fixture
def stand_in(tmp_path) -> Path:
    path = tmp_path / "stand_in.tokenizer.model"
    path.write_bytes(b"stand-in: checked for existence only")
    return path


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
            "`python -m agoq.plan --config configs/model/x.yaml --no-such-plan-flag 3`, then\n"
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
    ("python -m agoq.plan --config configs/model/llama-1b.yaml --policies bf16 --out c.yaml", None),
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
