"""agoq.train.environment: the trainer reads torchrun's variables and agoq's kernel switch from the environment
and passes them in; the library modules that used to read them at import read nothing (issue 20 item 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agoq.testing.procs import child_env

TORCHRUN_RANK1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_launch_from_torchrun_variables_and_without_them():
    from agoq.megatron.runtime import SINGLE_PROCESS, LaunchInfo
    from agoq.train.environment import launch_from_environment

    assert launch_from_environment({}) == SINGLE_PROCESS
    assert launch_from_environment(TORCHRUN_RANK1) == LaunchInfo(rank=1, world_size=2, local_rank=1,
                                                                 rendezvous_from_environment=True)


@pytest.mark.parametrize("fast, fused", [(None, None), ("1", "1"), ("0", "0"), ("0", None), (None, "0")])
def test_kernel_switches_become_the_config_kernels_section(fast, fused):
    """AGOQ_TRITON_FAST_LAUNCH / AGOQ_FP8_SWIGLU_FUSION (1, the default, or 0) become AgoqConfig.kernels; a typo
    stops the run with the variable's name ("false" used to leave the fast launch on without a word)."""
    from agoq.config.sections import KernelsConfig
    from agoq.train.environment import FAST_LAUNCH_ENV, PLAIN_FUSION_ENV, kernels_from_environment

    environ = {k: v for k, v in ((FAST_LAUNCH_ENV, fast), (PLAIN_FUSION_ENV, fused)) if v is not None}
    assert kernels_from_environment(environ) == KernelsConfig(fast_launch=fast != "0", fuse_swiglu_fp8=fused != "0")
    for name, typo in ((FAST_LAUNCH_ENV, "false"), (PLAIN_FUSION_ENV, "off")):
        with pytest.raises(ValueError, match=name):
            kernels_from_environment({**environ, name: typo})


def test_install_applies_the_fast_launch_setting_and_undo_restores_it():
    """kernels.fast_launch False (AGOQ_TRITON_FAST_LAUNCH=0) switches agoq's direct launches off through
    agoq.megatron.install's ``triton_launch`` seam; the handle's undo turns them back on."""
    from agoq.config import AgoqConfig
    from agoq.config.sections import KernelsConfig
    from agoq.kernels import fastlaunch
    from agoq.megatron.install import install

    assert fastlaunch.fast_launch_enabled()
    handle = install(AgoqConfig(device="cpu", kernels=KernelsConfig(fast_launch=False)))
    try:
        assert not fastlaunch.fast_launch_enabled()
        assert "triton_launch" in [s.name for s in handle.applied]
    finally:
        handle.undo()
    assert fastlaunch.fast_launch_enabled()


def test_library_modules_ignore_the_environment_at_import():
    """With every variable set, importing the kernels' launcher and the plugin's runtime changes nothing: only
    the trainer's config (kernels_from_environment above) carries them in."""
    code = ("from agoq.kernels import fastlaunch\n"
            "from agoq.megatron import runtime\n"
            "from agoq.config import AgoqConfig\n"
            "assert fastlaunch.fast_launch_enabled()\n"
            "assert AgoqConfig().kernels.fast_launch and AgoqConfig().kernels.fuse_swiglu_fp8\n"
            "assert runtime.SINGLE_PROCESS.world_size == 1\n")
    env = child_env(AGOQ_TRITON_FAST_LAUNCH="0", AGOQ_FP8_SWIGLU_FUSION="0", **TORCHRUN_RANK1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
