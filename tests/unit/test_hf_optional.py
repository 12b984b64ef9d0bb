"""Issue 22 item 4: transformers, safetensors and tokenizers are optional extras ([hf]); importing agoq never
imports them (only loading a tokenizer.json or running python -m agoq.convert does)."""

from __future__ import annotations

import subprocess
import sys

from agoq.testing.procs import child_env

HF_MODULES = ("transformers", "safetensors", "tokenizers")


def test_importing_every_agoq_module_imports_no_hf_package():
    """Every module of agoq (agoq.megatron and agoq.convert included) imports in a fresh interpreter without
    loading any of the optional packages."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import agoq\n"
        "for info in pkgutil.walk_packages(agoq.__path__, 'agoq.'):\n"
        "    importlib.import_module(info.name)\n"
        f"loaded = [m for m in {HF_MODULES!r} if m in sys.modules]\n"
        "assert not loaded, f'imported optional packages: {loaded}'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_sentencepiece_runs_without_the_hf_packages(tmp_path):
    """With the optional packages unimportable, agoq, its tokenizer (SentencePiece) and the converter's CLI
    parser still work, and a tokenizer.json is refused with the install hint."""
    tok_json = tmp_path / "tokenizer.json"
    tok_json.write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": {}, "merges": []}}')
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{m!r}] = None\n" for m in HF_MODULES)
        + "import agoq, agoq.data.tokenizer as t, agoq.convert.__main__ as c\n"
        "c.build_parser().parse_args(['hf-to-agoq', 'x', '--output', 'y'])\n"
        "try:\n"
        f"    t.Tokenizer.load({str(tok_json)!r})\n"
        "except ValueError as e:\n"
        "    assert \"pip install 'agoq[hf]'\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('loaded a tokenizer.json without tokenizers')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
