"""agoq.train.known_warnings: exactly the listed third-party start-up warnings are ignored, nothing else."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from agoq.testing.procs import REPO_ROOT, child_env


def test_listed_warnings_are_ignored_and_others_still_print():
    """In a fresh process (filters are process-wide): a listed message from its module is dropped; the same
    module's other warnings, the listed message from another module, and other log records still print."""
    code = textwrap.dedent("""
        import logging, warnings
        from agoq.train.known_warnings import filter_known_warnings
        filter_known_warnings()
        filter_known_warnings()  # idempotent
        g = {"__name__": "megatron.core.optimizer"}
        exec("import warnings; warnings.warn('Transformer Engine and Apex are not installed. x')", g)
        exec("import warnings; warnings.warn('something else went wrong')", g)
        exec("import warnings; warnings.warn('Transformer Engine and Apex are not installed. y')",
             {"__name__": "mypackage"})
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. x")
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("another gpt_model warning")
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME=x")
        print("filters on the GPT logger:", len(logging.getLogger("megatron.core.models.gpt.gpt_model").filters))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "installed. x" not in proc.stderr and "GPTModel IS DEPRECATED" not in proc.stderr
    assert "No CUDA runtime" not in proc.stderr
    assert "something else went wrong" in proc.stderr
    assert "installed. y" in proc.stderr  # same text from a module that is not megatron's
    assert "another gpt_model warning" in proc.stderr
    assert "filters on the GPT logger: 1" in proc.stdout


def test_every_entry_says_why():
    from agoq.train.known_warnings import KNOWN_WARNINGS

    assert all(entry.message and entry.module and len(entry.why) > 20 for entry in KNOWN_WARNINGS)
    # importing adds no filter: checked in a fresh process (filters are process-wide, and in a shared pytest
    # worker another test may have run the script's start-up in-process, which installs them)
    code = ("import logging, agoq.train.known_warnings; "
            "print(len(logging.getLogger('megatron.core.models.gpt.gpt_model').filters))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr
