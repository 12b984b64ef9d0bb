"""Launch an already-compiled Triton kernel without Triton's per-call dispatch (host time).

``jit_fn[grid](*args, **options)`` costs ~45 us of host time per call on the H100 box (Triton 3.6,
docs/benchmarks/fp8.md): ``JITFunction.run`` binds every argument, asks Triton's C++ specializer
about each, builds a cache key (a tuple of the specialization plus ``str(options)``), looks it up,
re-checks the kernel's global values, builds launch metadata and calls the launch hooks. The FP8
linear launches two such kernels per forward + backward, so this is a large share of its host time.

:class:`DirectLauncher` keeps, per *agoq* key, the ``CompiledKernel`` that Triton's own dispatch
returned on the first call with that key, and afterwards calls its launcher directly
(``kernel.run(grid..., stream, function, packed_metadata, None, None, None, *args)``: the same call
``JITFunction.run`` makes, in Triton 3.6 and 3.8 alike, minus the hooks when none is registered).

Safety: the agoq key must be at least as fine as Triton's specialization, so that two calls with one
agoq key would also have got one compiled kernel from Triton. It holds, per argument in signature
order: constexprs by value; tensors by dtype and whether ``data_ptr() % 16 == 0`` (Triton's "D"
alignment attribute); ints by ``== 1`` (specialised as a constant), ``% 16 == 0`` ("D") and
signedness / width class (i32, i64, u64); any other value by itself. Plus the current device (Triton
keeps one kernel cache per device). ``tests/kernels/test_direct_launch.py`` checks the partition
against Triton's own specializer (``native_specialize_impl``) for tensors and ints around every
boundary. Triton's dispatch is used instead (every call) when:
  - ``AGOQ_TRITON_DIRECT_LAUNCH=0`` is set (read at import), or :func:`set_direct_launch` (False);
  - Triton's interpreter runs (``TRITON_INTERPRET=1``: nothing is compiled);
  - launch hooks or pre-run hooks are registered (profilers such as proton rely on them);
  - the key was not seen yet (Triton compiles or finds the kernel, and launches it).
Not re-checked on the direct path: Triton's "global values unchanged" guard (agoq kernels read only
module constants) and a changed Triton cache / environment at run time.
"""

from __future__ import annotations

import os

import torch

__all__ = ["DirectLauncher", "set_direct_launch", "direct_launch_enabled", "DIRECT_LAUNCH_ENV"]

DIRECT_LAUNCH_ENV = "AGOQ_TRITON_DIRECT_LAUNCH"
# Triton's pointer / int divisibility specialization ("D" attribute) is "a multiple of 16": the keys
# below test ``x & 15`` (the same as ``% 16 == 0`` for Python ints, negative ones included).
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_UINT64_MIN, _UINT64_MAX = 2**63, 2**64 - 1

_enabled = os.environ.get(DIRECT_LAUNCH_ENV, "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1"


def set_direct_launch(enabled: bool) -> bool:
    """Switch the direct path on or off (every DirectLauncher); returns the previous setting. With
    TRITON_INTERPRET=1 it stays off."""
    global _enabled
    previous = _enabled
    _enabled = bool(enabled) and os.environ.get("TRITON_INTERPRET") != "1"
    return previous


def direct_launch_enabled() -> bool:
    return _enabled


_Tensor = torch.Tensor


def arg_key(a):
    """The part of an argument that Triton's specialization can depend on (or finer): a tensor's dtype
    and 16-byte alignment; an int's ``== 1``, divisibility by 16 and width class (i32 / u64 / other);
    anything else (constexprs, bools, floats) by value."""
    if isinstance(a, _Tensor):
        return (a.dtype, not (a.data_ptr() & 15))
    if a.__class__ is int:
        return (a == 1, not (a & 15), _INT32_MIN <= a <= _INT32_MAX, _UINT64_MIN <= a <= _UINT64_MAX)
    return a


def launch_key(args) -> tuple:
    """``tuple(map(arg_key, args))`` in one comprehension (no call per argument: this runs per launch)."""
    return tuple([(a.dtype, not (a.data_ptr() & 15)) if isinstance(a, _Tensor) else
                  (a == 1, not (a & 15), _INT32_MIN <= a <= _INT32_MAX, _UINT64_MIN <= a <= _UINT64_MAX)
                  if a.__class__ is int else a for a in args])


_runtime_knobs = None


def _current_device() -> int:
    """The device Triton launches on (its driver's get_current_device is torch.cuda.current_device)."""
    return torch.cuda.current_device()


def _stream_getter():
    """Triton's ``get_current_stream(device)`` (torch's raw current stream), as JITFunction.run uses."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def _hooks_registered() -> bool:
    """Launch hooks registered with Triton (HookChain objects with calls, or a plain callable)."""
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    enter, exit_ = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(exit_, "calls", exit_))


class DirectLauncher:
    """``launcher(grid, args)`` = ``jit_fn[grid](*args, **options)``, with later calls of the same
    key going straight to the compiled kernel (module docstring). ``args`` holds every kernel
    parameter positionally, in signature order, constexprs included (no defaults are filled in)."""

    def __init__(self, jit_fn, **options) -> None:
        self.jit_fn = jit_fn
        self.options = options
        self._kernels: dict[tuple, tuple] = {}
        self.direct_calls = 0  # for tests and the host benchmark
        self.dispatch_calls = 0
        self._pre_run_hooks = getattr(jit_fn, "pre_run_hooks", [])  # Triton's own list (hooks are appended)
        params = getattr(jit_fn, "params", None)
        self._num_params = len(params) if params is not None else None

    def __call__(self, grid: tuple, args: tuple) -> None:
        if not _enabled:
            self._check_arity(args)
            self.dispatch_calls += 1
            self.jit_fn[grid](*args, **self.options)
            return
        device = _current_device()
        key = (device, launch_key(args))
        entry = self._kernels.get(key)
        if entry is None or self._pre_run_hooks or _hooks_registered():
            self._dispatch(grid, args, key, device)
            return
        run, function, packed, get_stream = entry
        self.direct_calls += 1
        g = (*grid, 1, 1)
        run(g[0], g[1], g[2], get_stream(device), function, packed, None, None, None, *args)

    def _check_arity(self, args) -> None:
        if self._num_params is not None and len(args) != self._num_params:
            raise TypeError(f"{self.jit_fn}: {len(args)} arguments for {self._num_params} parameters (pass "
                            "every parameter, constexprs included, in signature order)")

    def _dispatch(self, grid, args, key, device) -> None:
        self._check_arity(args)  # a key fixes the number of arguments: checked once per key
        self.dispatch_calls += 1
        kernel = self.jit_fn[grid](*args, **self.options)
        if self._pre_run_hooks or _hooks_registered():
            return
        if kernel is None or not hasattr(kernel, "packed_metadata"):  # interpreter or an unknown Triton
            return
        run = kernel.run  # the launcher (its handles are loaded by now: the kernel just ran)
        self._kernels[key] = (run, kernel.function, kernel.packed_metadata, _stream_getter())
