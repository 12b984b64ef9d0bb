"""agoq.train.determinism (--deterministic-mode): the environment it fills and refuses, torch's switch it turns on
(fully: not warn-only), and the script's one-line stop before torch loads."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from agoq.testing.procs import PRETRAIN_SCRIPT, TINY_CONFIG, child_env
from agoq.train import determinism


def test_unset_variables_take_the_deterministic_defaults_and_set_ones_are_kept():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring,CollnetDirect", "OTHER": "x"}
    assert determinism.apply_environment(env) == {"NCCL_ALGO": "Ring,CollnetDirect",
                                                  "CUBLAS_WORKSPACE_CONFIG": ":16:8",
                                                  "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert env["OTHER"] == "x"
    assert determinism.apply_environment({}) == determinism.DEFAULTS


@pytest.mark.parametrize("name, value", [("NCCL_ALGO", "Tree"), ("NCCL_ALGO", "Ring,Tree"), ("NCCL_ALGO", ""),
                                         ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
                                         ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")])
def test_a_nondeterministic_setting_is_refused_with_the_allowed_values(name, value):
    env = {name: value}
    allowed = re.escape(", ".join(determinism.ALLOWED[name]))
    with pytest.raises(ValueError, match=rf"--deterministic-mode: {name}='{value}' is not a deterministic setting "
                                         rf"\(allowed: {allowed}"):
        determinism.apply_environment(env)
    assert env == {name: value}  # nothing filled in on a refusal


def test_torch_is_switched_fully_on():
    probe = ("from agoq.train import determinism; import torch\n"
             "line = determinism.enable_torch({'NCCL_ALGO': 'Ring'})\n"
             "print(torch.are_deterministic_algorithms_enabled(),\n"
             "      torch.is_deterministic_algorithms_warn_only_enabled())\n"
             "print(line)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env=child_env()).stdout.splitlines()
    assert out[0] == "True False"
    assert out[1] == ("deterministic mode (--deterministic-mode): torch deterministic algorithms on; NCCL_ALGO=Ring, "
                      "CUBLAS_WORKSPACE_CONFIG=(unset), NVTE_ALLOW_NONDETERMINISTIC_ALGO=(unset)")


def test_the_script_stops_in_one_line_before_torch_loads():
    done = subprocess.run([sys.executable, str(PRETRAIN_SCRIPT), "--config", str(TINY_CONFIG), "--deterministic-mode",
                           "--agoq-device", "cpu"], capture_output=True, text=True, timeout=120,
                          env=child_env(NCCL_ALGO="Tree"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "pretrain_llama.py: error: --deterministic-mode: NCCL_ALGO='Tree' is not a deterministic setting (allowed: "
        "Ring, CollnetDirect, CollnetChain, ^NVLS; a comma-separated list of them); unset it or set one of those")
