"""agoq.megatron.train.environment: the trainer reads torchrun's variables and agoq's kernel switch from the environment
and passes them in; the library modules that used to read them at import read nothing (issue 20 item 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agoq.testing.procs import child_env

TORCHRUN_RANK1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_launch_from_torchrun_variables_and_without_them():
    from agoq.megatron.runtime import SINGLE_PROCESS, LaunchInfo
    from agoq.megatron.train.environment import launch_from_environment

    assert launch_from_environment({}) == SINGLE_PROCESS
    assert launch_from_environment(TORCHRUN_RANK1) == LaunchInfo(rank=1, world_size=2, local_rank=1,
                                                                 rendezvous_from_environment=True)


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False)])
def test_fast_launch_switch_is_applied_by_the_trainer(value, enabled):
    from agoq.kernels import fastlaunch
    from agoq.megatron.train.environment import FAST_LAUNCH_ENV, apply_kernel_switches

    previous = fastlaunch.fast_launch_enabled()
    try:
        apply_kernel_switches({} if value is None else {FAST_LAUNCH_ENV: value})
        assert fastlaunch.fast_launch_enabled() is enabled
        with pytest.raises(ValueError, match=FAST_LAUNCH_ENV):  # "false" used to leave it on without a word
            apply_kernel_switches({FAST_LAUNCH_ENV: "false"})
    finally:
        fastlaunch.set_fast_launch(previous)


@pytest.mark.parametrize("value, mode", [(None, "gemm"), ("gemm", "gemm"), ("epilogue", "epilogue")])
def test_unsmooth_switch_is_applied_by_the_trainer(value, mode):
    from agoq.megatron.train.environment import UNSMOOTH_ENV, apply_kernel_switches
    from agoq.ops import smooth_swiglu_fp8

    previous = smooth_swiglu_fp8.unsmooth_mode()
    try:
        apply_kernel_switches({} if value is None else {UNSMOOTH_ENV: value})
        assert smooth_swiglu_fp8.unsmooth_mode() == mode
        with pytest.raises(ValueError, match="un-smoothing mode"):  # a typo stops the run, never ignored
            apply_kernel_switches({UNSMOOTH_ENV: "gem"})
    finally:
        smooth_swiglu_fp8.set_unsmooth_mode(previous)


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False)])
def test_plain_swiglu_fusion_switch_is_applied_by_the_trainer(value, enabled):
    from agoq.megatron.train.environment import PLAIN_FUSION_ENV, apply_kernel_switches
    from agoq.ops import smooth_swiglu_fp8

    previous = smooth_swiglu_fp8.plain_swiglu_fusion()
    try:
        apply_kernel_switches({} if value is None else {PLAIN_FUSION_ENV: value})
        assert smooth_swiglu_fp8.plain_swiglu_fusion() is enabled
        with pytest.raises(ValueError, match=PLAIN_FUSION_ENV):  # a typo stops the run, never ignored
            apply_kernel_switches({PLAIN_FUSION_ENV: "off"})
    finally:
        smooth_swiglu_fp8.set_plain_swiglu_fusion(previous)


def test_library_modules_ignore_the_environment_at_import():
    """With every variable set, importing the kernels' launcher and the plugin's runtime changes nothing: only
    the trainer's calls above carry them in."""
    code = ("from agoq.kernels import fastlaunch\n"
            "from agoq.megatron import runtime\n"
            "from agoq.ops import smooth_swiglu_fp8\n"
            "assert fastlaunch.fast_launch_enabled()\n"
            "assert smooth_swiglu_fp8.plain_swiglu_fusion() and smooth_swiglu_fp8.unsmooth_mode() == 'gemm'\n"
            "assert runtime.SINGLE_PROCESS.world_size == 1\n")
    env = child_env(AGOQ_TRITON_FAST_LAUNCH="0", AGOQ_FP8_SWIGLU_FUSION="0", AGOQ_SMOOTH_UNSMOOTH="epilogue",
                    **TORCHRUN_RANK1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
