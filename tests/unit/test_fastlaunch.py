"""agoq.kernels.fastlaunch.FastKernel with a stand-in for Triton's JITFunction / CompiledKernel (CPU).

What is checked: the first call per specialization key goes through ``fn[grid](...)`` with the fixed
options; later calls with the same key make Triton's final launch call themselves, with the grid padded
to 3-D, the current stream, the cached function / metadata, no launch hooks and every argument in order;
anything Triton specializes on (pointer alignment, int == 1 / % 16 / int32 range, dtypes, constexprs)
gives a new key; installed launch hooks, non-CUDA first arguments and interpreter functions (no
``device_caches``) always take Triton's own path.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from agoq.kernels import fastlaunch
from agoq.kernels.fastlaunch import FastKernel


class _Compiled:
    def __init__(self, log):
        self.log = log
        self.function = "FUNC"
        self.packed_metadata = ("META",)

    @property
    def run(self):
        return lambda *a: self.log.append(("direct", a))


class _Jit:
    """JITFunction stand-in: params with is_constexpr, device_caches, fn[grid](...) -> compiled."""

    __name__ = "fake_kernel"

    def __init__(self, constexpr_flags):
        self.params = [SimpleNamespace(is_constexpr=c) for c in constexpr_flags]
        self.device_caches = {}
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", grid, args, options))
            return _Compiled(self.log)

        return launch


@pytest.fixture
def fake_triton(monkeypatch):
    hooks = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=SimpleNamespace(calls=[]))
    monkeypatch.setattr(FastKernel, "_triton_mods", lambda self: (hooks, lambda: 0, lambda dev: 1234))
    monkeypatch.setattr(FastKernel, "_on_gpu", staticmethod(lambda args: True))
    monkeypatch.setattr(fastlaunch, "_ENABLED", True)
    return hooks


def test_first_call_compiles_then_direct_launch_with_all_args(fake_triton):
    jit = _Jit([False, False, False, True, True])
    fk = FastKernel(jit, num_warps=4, enable_fp_fusion=False)
    x, out = torch.zeros(8), torch.zeros(8)
    fk((3,), x, out, 64, 7, "K")
    assert jit.log == [("jit", (3,), (x, out, 64, 7, "K"), {"num_warps": 4, "enable_fp_fusion": False})]
    fk((5, 2), x, out, 128, 7, "K")  # same key: 64 and 128 are both multiples of 16
    assert jit.log[-1] == ("direct", (5, 2, 1, 1234, "FUNC", ("META",), None, None, None, x, out, 128, 7, "K"))
    assert fk.cache_size() == 1


@pytest.mark.parametrize("change", ["int_not_mult16", "int_is_one", "int64", "unaligned_ptr", "dtype", "constexpr"])
def test_anything_triton_specializes_on_is_a_new_key(fake_triton, change):
    jit = _Jit([False, False, False, True, True])
    fk = FastKernel(jit, num_warps=4)
    base = torch.zeros(64)
    args = [base, torch.zeros(8), 64, 7, "K"]
    fk((1,), *args)
    if change == "int_not_mult16":
        args[2] = 65
    elif change == "int_is_one":
        args[2] = 1
    elif change == "int64":
        args[2] = 2**32
    elif change == "unaligned_ptr":
        args[0] = base[1:]  # 4-byte offset: not 16-byte aligned
    elif change == "dtype":
        args[0] = base.to(torch.float64)
    else:
        args[3] = 8
    fk((1,), *args)
    assert [e[0] for e in jit.log] == ["jit", "jit"] and fk.cache_size() == 2


def test_hooks_non_cuda_and_interpreter_take_tritons_path(fake_triton, monkeypatch):
    jit = _Jit([False, True])
    fk = FastKernel(jit, num_warps=4)
    x = torch.zeros(4)
    fake_triton.launch_enter_hook.calls.append(print)  # a profiler hook is installed
    fk((1,), x, 3)
    fk((1,), x, 3)
    assert [e[0] for e in jit.log] == ["jit", "jit"] and fk.cache_size() == 0
    fake_triton.launch_enter_hook.calls.clear()
    monkeypatch.setattr(FastKernel, "_on_gpu", staticmethod(lambda args: False))
    fk((1,), x, 3)
    assert [e[0] for e in jit.log] == ["jit"] * 3 and fk.cache_size() == 0
    interp = _Jit([False, True])
    del interp.device_caches  # TRITON_INTERPRET's InterpretedFunction has none
    monkeypatch.setattr(FastKernel, "_on_gpu", staticmethod(lambda args: True))
    fi = FastKernel(interp, num_warps=4)
    fi((1,), x, 3)
    fi((1,), x, 3)
    assert [e[0] for e in interp.log] == ["jit", "jit"]
    previous = fastlaunch.set_fast_launch(False)  # the run-time switch
    try:
        fk2 = FastKernel(_Jit([False, True]), num_warps=4)
        fk2((1,), x, 3)
        fk2((1,), x, 3)
        assert [e[0] for e in fk2.fn.log] == ["jit", "jit"] and fk2.cache_size() == 0
    finally:
        fastlaunch.set_fast_launch(previous)


def test_wrong_argument_count_raises(fake_triton):
    fk = FastKernel(_Jit([False, True]), num_warps=4)
    fk((1,), torch.zeros(4), 3)
    with pytest.raises(TypeError, match="every parameter positionally"):
        fk((1,), torch.zeros(4))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs Triton's real binder")
def test_key_is_a_superset_of_tritons_specialization():
    """Against Triton's own runtime binder (agoq.testing.xcompile.specialize, no GPU needed): any two
    argument lists FastKernel gives the same key get the same Triton specialization (so reusing the
    compiled kernel of one for the other is what Triton itself would do)."""
    import itertools

    from agoq.formats import parse_format
    from agoq.kernels.quant import _dequantize_fwd_kernel, _dequantize_plan
    from agoq.testing.xcompile import Launch, specialize

    fk = FastKernel(_dequantize_fwd_kernel, num_warps=4, enable_fp_fusion=False)
    _, _, consts = _dequantize_plan(parse_format("nf4_b64"))
    buf = torch.zeros(4096, dtype=torch.uint8)
    out = torch.zeros(1024, dtype=torch.bfloat16)
    codes = [buf, buf[16:], buf[3:]]  # aligned, aligned, unaligned
    outs = [out, out[8:], out[1:], out.to(torch.float32)]
    ints = [1, 16, 17, 4096, 2**31 + 16, 2**31 + 17]
    seen = {}
    for c, o, numel, nblocks in itertools.product(codes, outs, ints, ints[:3]):
        args = (c, torch.zeros(8), o, torch.zeros(16), numel, nblocks, *consts)
        ours = fk.key(args)
        theirs = specialize(_dequantize_fwd_kernel, Launch("", args, dict(fk.options)))[2]
        assert seen.setdefault(ours, theirs) == theirs, f"same FastKernel key, different Triton key for {ours}"
    assert len(set(seen.values())) > 1  # the sample does exercise Triton's specialization


# ------------------------------------------------------------------------------------- LaunchSite ----
def test_launch_site_compiles_once_then_launches_directly(fake_triton):
    from agoq.kernels.fastlaunch import LaunchSite

    jit = _Jit([False, False, False, True])
    site = LaunchSite(FastKernel(jit, num_warps=4), (3,))
    x, out = torch.zeros(8), torch.zeros(8)
    site(x, out, 64, "K")
    assert jit.log == [("jit", (3, 1, 1), (x, out, 64, "K"), {"num_warps": 4})]
    y = torch.zeros(8)  # another (aligned) tensor: same site, direct launch with the padded grid and stream
    site(y, out, 64, "K")
    # the tensors travel as their data pointers (Triton's launcher takes ints as device pointers)
    assert jit.log[-1] == ("direct", (3, 1, 1, 1234, "FUNC", ("META",), None, None, None, y.data_ptr(),
                                      out.data_ptr(), 64, "K"))


def test_launch_site_unaligned_tensor_or_hook_takes_the_kernels_path(fake_triton):
    from agoq.kernels.fastlaunch import LaunchSite

    jit = _Jit([False, False, True])
    fk = FastKernel(jit, num_warps=4)
    site = LaunchSite(fk, (1,))
    base = torch.zeros(64)
    site(base, 32, "K")
    site(base[1:], 32, "K")  # 4-byte offset: Triton specializes on alignment, so not the site's kernel
    assert [e[0] for e in jit.log] == ["jit", "jit"] and fk.cache_size() == 2
    fake_triton.launch_enter_hook.calls.append(print)  # a profiler hook: never a direct launch
    site(base, 32, "K")
    assert jit.log[-1][0] == "jit"
    fake_triton.launch_enter_hook.calls.clear()
    site(base, 32, "K")
    assert jit.log[-1][0] == "direct"


def test_launch_site_first_call_unaligned_never_adopts(fake_triton):
    from agoq.kernels.fastlaunch import LaunchSite

    jit = _Jit([False, True])
    site = LaunchSite(FastKernel(jit, num_warps=4), (1,))
    base = torch.zeros(64)
    site(base[1:], "K")
    site(base, "K")  # the site kept nothing from the unaligned call: FastKernel's own (compiling) path
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_launch_site_check_mode_catches_a_changed_scalar(fake_triton):
    from agoq.kernels.fastlaunch import LaunchSite

    jit = _Jit([False, False, True])
    site = LaunchSite(FastKernel(jit, num_warps=4), (1,))
    x = torch.zeros(8)
    site(x, 64, "K")
    site(x, 65, "K")  # unchecked: the contract is the caller's (65 is another specialization)
    previous = fastlaunch.set_check_sites(True)
    try:
        with pytest.raises(RuntimeError, match="non-tensor argument changed"):
            site(x, 65, "K")
        site(x, 64, "K")
    finally:
        fastlaunch.set_check_sites(previous)
    assert jit.log[-1][0] == "direct"
