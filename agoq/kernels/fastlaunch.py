"""Direct launches of already-compiled Triton kernels: the host cost of ``kernel[grid](...)`` without
Triton's per-call binding.

``JITFunction.run`` (Triton 3.6 and 3.8 alike) binds the arguments, builds a specialization list and a
string cache key, checks the kernel's globals, builds launch metadata and only then calls
``compiled.run(grid0, grid1, grid2, stream, function, packed_metadata, launch_metadata, enter_hook,
exit_hook, *all_arguments)``. On the saved-activation path that binding is paid by every quantize /
dequantize / SwiGLU launch (activations_launch.json (commit ca8453e; git show
ca8453e:docs/benchmarks/activations_launch.json): 44-90 us of host time per agoq
call against 9.6 us for ``torch.add``).

:class:`FastKernel` keeps, per *specialization key*, the ``CompiledKernel`` that Triton's own ``run``
returned the first time and afterwards makes exactly the final call above itself. The key is a
superset of what Triton specializes on (Triton 3.6 / 3.8 ``specialize_impl``): per tensor its dtype
and whether its data pointer is 16-byte aligned; per int whether it equals 1, is a multiple of 16 and
fits int32; per float / bool / None its type; every constexpr by value; plus the device and the launch
options. Two calls with the same key would therefore get the same compiled kernel from Triton.

Rules: every kernel parameter is passed positionally, in signature order, constexprs included (as
``JITFunction.run`` passes ``bound_args.values()``); launch options are fixed per FastKernel. Triton's
own path is used (every call, not silently: it is the same kernel) under ``TRITON_INTERPRET=1``
(no compiled kernel), when the first argument is not a CUDA tensor (CPU launch recorders such as
benchmarks/xc_quant.py), when a launch hook is installed (profilers: they need launch metadata), and when
switched off with :func:`set_fast_launch` (the escape hatch: ``AgoqConfig.kernels.fast_launch``, applied by
``agoq.megatron.install.install`` and undone by its handle; benchmarks' A/B call it directly. This module reads no
environment and no config).
"""

from __future__ import annotations

import torch

__all__ = ["FastKernel", "LaunchSite", "arg_key", "fast_launch_enabled", "set_fast_launch", "set_check_sites"]

_ENABLED = True  # direct launches on; set_fast_launch switches them (agoq.megatron.install, benchmarks' A/B)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ALIGN = 16  # bytes / divisor Triton specializes pointers and ints on ("D" attribute)


def fast_launch_enabled() -> bool:
    return _ENABLED


def set_fast_launch(enabled: bool) -> bool:
    """Switch direct launches on / off process-wide (``AgoqConfig.kernels.fast_launch`` through
    agoq.megatron.install, benchmarks' A/B); returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


_UINT64_MIN, _UINT64_MAX = 2**63, 2**64 - 1


def arg_key(a):
    """What Triton's specialization can see of a runtime (non-constexpr) argument, or finer: a tensor's
    dtype and 16-byte alignment; an int's ``== 1``, divisibility by 16 and width class (i32 / u64 / i64,
    Triton's C++ specializer ranges). tests/kernels/test_launch_key.py checks the partition against
    Triton 3.8's specializer (and 3.6's with AGOQ_XCOMPILE_TRITON)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % _ALIGN == 0)
    if isinstance(a, bool):  # before int: bool is an int
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a % _ALIGN == 0, _INT32_MIN <= a <= _INT32_MAX, _UINT64_MIN <= a <= _UINT64_MAX)
    if isinstance(a, float):
        return ("f",)
    if a is None:
        return ("n",)
    raise TypeError(f"FastKernel: unsupported runtime argument type {type(a).__name__}")


def _no_hooks(runtime_knobs) -> bool:
    """True when no launch hook would observe the launch (HookChain without calls, or None)."""
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime_knobs, name, None)
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class FastKernel:
    """``FastKernel(jit_fn, num_warps=4)(grid, *args)`` launches ``jit_fn[grid](*args, **options)``.

    ``args``: every parameter of the kernel, positionally and in order (constexprs included)."""

    def __init__(self, jit_fn, **options):
        self.fn = jit_fn
        self.options = options
        self._static = tuple(sorted(options.items()))
        self._cache: dict = {}
        self.direct_calls = 0  # launches that skipped Triton's dispatch (tests, host benchmarks)
        params = getattr(jit_fn, "params", None)
        # InterpretedFunction (TRITON_INTERPRET=1) has no compiled kernel to reuse
        self._direct = hasattr(jit_fn, "device_caches") and params is not None
        self._constexpr = tuple(bool(p.is_constexpr) for p in params) if params is not None else ()
        self._triton = None

    def _triton_mods(self):
        if self._triton is None:
            from triton import knobs
            from triton.runtime import driver

            active = driver.active
            self._triton = (knobs.runtime, active.get_current_device, active.get_current_stream)
        return self._triton

    @staticmethod
    def _on_gpu(args) -> bool:
        return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_cuda

    def key(self, args) -> tuple:
        if len(args) != len(self._constexpr):
            raise TypeError(f"FastKernel({self.fn.__name__}): {len(args)} arguments for "
                            f"{len(self._constexpr)} parameters; pass every parameter positionally")
        return tuple(a if c else arg_key(a) for a, c in zip(args, self._constexpr, strict=True))

    def __call__(self, grid, *args) -> None:
        if not (_ENABLED and self._direct and self._on_gpu(args)):
            self.fn[grid](*args, **self.options)  # interpreter, CPU tensors (launch recorders), or switched off
            return
        runtime_knobs, get_device, get_stream = self._triton_mods()
        if not _no_hooks(runtime_knobs) or getattr(self.fn, "pre_run_hooks", None):
            self.fn[grid](*args, **self.options)
            return
        device = get_device()
        key = (device, self._static, self.key(args))
        entry = self._cache.get(key)
        if entry is None:
            compiled = self.fn[grid](*args, **self.options)  # compiles (once) and launches
            if hasattr(compiled, "result"):  # async compilation future (Triton 3.6)
                compiled = compiled.result()
            if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
                self._cache[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return  # else (a patched run returned no compiled kernel): Triton's path again next time
        run, function, metadata = entry
        self.direct_calls += 1
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, get_stream(device), function, metadata, None, None, None, *args)

    def cache_size(self) -> int:
        return len(self._cache)

    def cached_entry(self, args) -> tuple | None:
        """(run, function, metadata) this kernel would launch ``args`` with directly, or None (not compiled
        yet through :meth:`__call__`, interpreter, switched off)."""
        if not (self._direct and self._on_gpu(args)):
            return None
        _, get_device, _ = self._triton_mods()
        return self._cache.get((get_device(), self._static, self.key(args)))


_CHECK_SITES = False  # tests: every LaunchSite call also recomputes the full key (the site's contract)


def set_check_sites(enabled: bool) -> bool:
    """Make every :class:`LaunchSite` call verify its contract with the full key; returns the previous."""
    global _CHECK_SITES
    previous, _CHECK_SITES = _CHECK_SITES, bool(enabled)
    return previous


class LaunchSite:
    """One call site of a :class:`FastKernel` whose grid and non-tensor arguments never change: the caller
    keeps one site per value of everything they depend on (format, shape, dtype, device, ...).

    The first call goes through the FastKernel; from then on a call checks only what can still change,
    the 16-byte alignment of each tensor argument and the current device, then makes the final launch
    call itself, with the tensors' data pointers in their place. That is the FastKernel key's dict work
    (a key tuple of every argument per launch: ~15 of the ~50 host us a launch cost on an H100 host,
    docs/benchmarks/log.md "Host cost") done once per site.
    Anything else (an unaligned tensor, another device, a launch hook, direct launches off) takes the
    FastKernel's own path for that call. ``set_check_sites(True)`` (tests) recomputes the full key on
    every call and raises if a caller broke the contract."""

    __slots__ = ("kernel", "grid", "direct_calls", "_entry", "_tensor_pos", "_device", "_key")

    def __init__(self, kernel: FastKernel, grid: tuple):
        self.kernel = kernel
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.direct_calls = 0  # launches this site made itself (tests, host benchmarks)
        self._entry = None
        self._tensor_pos: tuple = ()
        self._device = None
        self._key = None

    def __call__(self, *args) -> None:
        entry = self._entry
        if entry is not None and _ENABLED:
            runtime_knobs, get_device, get_stream = self.kernel._triton_mods()
            device = get_device()
            if device == self._device and _no_hooks(runtime_knobs):
                launch_args = self._pointer_args(args)
                if launch_args is not None:
                    if _CHECK_SITES:
                        self._check(device, args)
                    g0, g1, g2 = self.grid
                    self.direct_calls += 1
                    entry[0](g0, g1, g2, get_stream(device), entry[1], entry[2], None, None, None, *launch_args)
                    return
        self.kernel(self.grid, *args)
        if entry is None:
            self._adopt(args)

    def _pointer_args(self, args) -> list | None:
        """``args`` with every tensor replaced by its data pointer, or None if one is not 16-byte aligned.
        Triton's launcher (3.6 and 3.8) takes an int as a device pointer as is; a tensor costs it a
        ``data_ptr()`` call back into Python (and, in 3.6, a driver query) per argument and launch. The
        caller still holds the tensors, so their memory outlives the stream-ordered launch as before."""
        out = list(args)
        for i in self._tensor_pos:
            ptr = out[i].data_ptr()
            if ptr % _ALIGN:
                return None
            out[i] = ptr
        return out

    def _adopt(self, args) -> None:
        """After the first launch: keep the compiled kernel if every tensor was aligned (the common case)."""
        entry = self.kernel.cached_entry(args)
        positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if entry is None or not all(args[i].data_ptr() % _ALIGN == 0 for i in positions):
            return
        _, get_device, _ = self.kernel._triton_mods()
        self._tensor_pos, self._device, self._key = positions, get_device(), self.kernel.key(args)
        self._entry = entry

    def _check(self, device, args) -> None:
        if self.kernel.key(args) != self._key:
            raise RuntimeError(f"LaunchSite({self.kernel.fn.__name__}): a non-tensor argument changed between "
                               "calls of one site; the caller's site key must cover every such argument")
