"""Cross-compile Triton kernels for the GPU's compiler on a machine without a GPU.

The Triton interpreter (CPU tests) never runs Triton's front end, so a kernel can pass every CPU test
and still fail to compile on the H100 (Triton 3.6). This module records the launches a kernel module
really makes (its public launchers, called with small CPU tensors, with the ``@triton.jit`` object
swapped for a recorder), lets Triton's own binder specialise each launch as the GPU runtime would
(dtypes, 16-byte alignment, constexprs, launch options), and compiles every distinct variant for
``sm_90`` down to a cubin. No device and no CUDA driver are needed, only ptxas from the Triton wheel.

Use from a process whose ``triton`` is the target version (3.6 is what the GPU runs)::

    PYTHONPATH=/tmp/t36:$PWD python -m agoq.testing.xcompile optim        # every fused-optimizer variant
    PYTHONPATH=/tmp/t36:$PWD python -m agoq.testing.xcompile optim_multi  # the multi-tensor step

tests/kernels/test_xcompile.py runs that in a subprocess when ``AGOQ_XCOMPILE_TRITON`` names such a
Triton (a directory put first on PYTHONPATH) and skips, saying why, otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

TRITON_ENV_VAR = "AGOQ_XCOMPILE_TRITON"
TARGET_ARCH = 90  # H100 (sm_90)
TARGET_WARP = 32
EXPECTED_TRITON = "3.6"  # the GPU machine's Triton (docs/benchmarks: torch 2.11 + Triton 3.6.0)


@dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)`` call."""

    label: str
    args: tuple
    kwargs: dict


@dataclass
class Recorder:
    """Stands in for a ``@triton.jit`` function: ``rec[grid](*args, **kw)`` records instead of running."""

    label: str = ""
    launches: list[Launch] = field(default_factory=list)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.label, args, dict(kwargs)))


@contextlib.contextmanager
def recording(module, kernel_name: str) -> Iterator[Recorder]:
    """Swap ``module.<kernel_name>`` for a Recorder for the duration of the block."""
    original = getattr(module, kernel_name)
    rec = Recorder()
    if hasattr(original, "fn") and hasattr(original, "options"):  # a FastKernel: it launches through .fn
        launcher, original = original, original.fn
        launcher.fn = rec
        try:
            yield rec
        finally:
            launcher.fn = original
        return
    setattr(module, kernel_name, rec)
    try:
        yield rec
    finally:
        setattr(module, kernel_name, original)


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", TARGET_ARCH, TARGET_WARP)


def specialize(kernel, launch: Launch):
    """(ASTSource, options dict, cache key) of a launch, specialised by Triton's own runtime binder."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    backend = CUDABackend(_target())
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    key = repr((specialization, sorted(options.__dict__.items())))
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__, key


def compile_launch(kernel, launch: Launch):
    """Compile one recorded launch for sm_90; returns the compiled kernel (``.asm['cubin']``)."""
    import triton

    src, options, _ = specialize(kernel, launch)
    return triton.compile(src, target=_target(), options=options)


@dataclass
class Outcome:
    label: str
    ok: bool
    seconds: float
    error: str = ""


def compile_all(kernel, launches: list[Launch], *, log=None) -> list[Outcome]:
    """Compile every distinct variant among ``launches`` (deduplicated on Triton's specialisation key)."""
    seen: dict[str, str] = {}
    outcomes = []
    for launch in launches:
        _, _, key = specialize(kernel, launch)
        if key in seen:
            continue
        seen[key] = launch.label
        t0 = time.perf_counter()
        try:
            compiled = compile_launch(kernel, launch)
            if not compiled.asm.get("cubin"):
                raise RuntimeError("no cubin produced")
            out = Outcome(launch.label, True, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - reported per variant, re-raised by the caller
            out = Outcome(launch.label, False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:4000])
        outcomes.append(out)
        if log:
            detail = "" if out.ok else f"\n{out.error}"
            log(f"{'ok  ' if out.ok else 'FAIL'} {out.seconds:6.1f}s {out.label}{detail}")
    return outcomes


def ptx_global_ops(ptx: str) -> dict[str, int]:
    """Static counts of the global-memory instructions of a PTX text (``ld.global.v4.b32``: 8, ...), qualifiers
    (cache hints, vector width, type) included: vectorised loads show as ``.v2`` / ``.v4``."""
    import re
    from collections import Counter

    return dict(Counter(re.findall(r"\b(?:ld|st)\.global(?:\.[\w:]+)*", ptx)))


def sass_stats(cubin: bytes, top: int = 12) -> dict:
    """Static SASS counts of a cubin (nvdisasm from the Triton wheel): ``body`` is the number of instructions
    up to the first unconditional EXIT (the straight-line path every thread runs; slow-path subroutines of
    correctly rounded div / sqrt follow it), ``ops`` the most frequent opcodes in the whole kernel. A
    static count, not a timing: an issue-bound kernel's time scales with body x threads."""
    import os
    import re
    import subprocess
    import tempfile
    from collections import Counter

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    ops = Counter(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", ln).split()[0].split(".")[0] for ln in lines)
    body = next((i + 1 for i, ln in enumerate(lines) if re.search(r"\bEXIT\b", ln) and "@" not in ln), len(lines))
    return {"instructions": len(lines), "body": body, "ops": dict(ops.most_common(top))}


# --------------------------------------------------------------------------------------------------
# variant tables: the launches each kernel module can make
# --------------------------------------------------------------------------------------------------
# Every state format family the fused optimizer step accepts (non-stochastic; stochastic formats are
# refused by agoq.kernels.optim.fused_block), at the default block / scale: plain storages, every int
# width (6/5/3 bits use two bit planes), NF4, both FP8 variants, FlashOptim's companded formats.
OPTIM_STATE_FORMATS = (
    "fp32", "bf16", "fp16", "int8_b32", "int6_b32", "int5_b32", "int4_b32", "int3_b32", "int2_b32",
    "nf4_b32", "fp8e4m3_b32", "fp8e5m2_b32", "cint8_b32", "cuint8_b32",
)  # fmt: skip
# Block sizes and scale storages change ROWS and the scale load/store; swept on one format per family.
OPTIM_BLOCK_SCALE_FORMATS = (
    "int8_b64_s16", "int8_b128_sp2", "int8_b256", "int4_b64_sp2", "int4_b256_s16", "nf4_b128_sp2", "nf4_b256",
    "cint8_b64_s32", "cuint8_b128_sp2", "cint8_b256", "fp8e4m3_b128_sp2", "fp8e5m2_b256_s16", "int6_b256_sp2",
)  # fmt: skip
# (param dtype, master dtype): none (bf16 / fp16 / fp32 param), split24, split32, fp32 master, fp16 split
OPTIM_MASTERS = (
    (torch.bfloat16, None), (torch.float16, None), (torch.float32, None), (torch.bfloat16, torch.int8),
    (torch.bfloat16, torch.int16), (torch.bfloat16, torch.float32), (torch.float16, torch.int8),
    (torch.float16, torch.int16),
)  # fmt: skip
SGD_OPTIONS = ((0.0, False, 0.0), (0.0, False, 0.01), (0.9, False, 0.0), (0.9, True, 0.01))  # momentum, nesterov, wd
OPTIM_NUMEL = 2 * 2048 + 96  # > one program, a tail group, divisible by 16 (aligned like real tensors)


def _optim_state(fmt: str | None, numel: int):
    from agoq.formats import parse_format
    from agoq.ref.quant import ref_quantize

    if fmt is None:
        return None
    return ref_quantize(torch.zeros(numel), parse_format(fmt))


def _v_partner(m_fmt: str) -> str:
    """A v format sharing m's block (the fused step requires one block for all quantized states)."""
    from agoq.formats import parse_format

    f = parse_format(m_fmt)
    return f"cuint8_b{f.block}" if f.quantized else "fp32"


def optim_calls(full: bool = False) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, call) for every launch variant of agoq.kernels.optim.

    Default: every state format x every master mode x every optimizer (AdamW m formats with a
    matching v, v formats with a matching m; Lion / SGD momentum formats; SGD's wd / Nesterov
    branches), plus the block / scale sweep with a split24 master. ``full``: the sweep x every master."""
    from agoq.kernels import optim as k

    n = OPTIM_NUMEL
    sweep_masters = OPTIM_MASTERS if full else ((torch.bfloat16, torch.int8),)
    plans = [(f, OPTIM_MASTERS) for f in OPTIM_STATE_FORMATS] + [(f, sweep_masters) for f in OPTIM_BLOCK_SCALE_FORMATS]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    for fmt, masters in plans:
        for (pdt, mdt), which in itertools.product(masters, ("m", "v")):
            m_fmt, v_fmt = (fmt, _v_partner(fmt)) if which == "m" else (_v_partner(fmt), fmt)
            tag = f"{str(pdt)[6:]}/{str(mdt)[6:] if mdt else 'none'}"

            def adamw(pdt=pdt, mdt=mdt, m_fmt=m_fmt, v_fmt=v_fmt):
                p = torch.zeros(n, dtype=pdt)
                master = None if mdt is None else torch.zeros(n, dtype=mdt)
                k.adamw_step(p, torch.zeros(n, dtype=torch.bfloat16), master, _optim_state(m_fmt, n),
                             _optim_state(v_fmt, n), **hp)  # fmt: skip

            yield f"adamw m={m_fmt} v={v_fmt} {tag}", adamw
            if which == "v":
                continue

            def lion(pdt=pdt, mdt=mdt, m_fmt=m_fmt):
                p = torch.zeros(n, dtype=pdt)
                master = None if mdt is None else torch.zeros(n, dtype=mdt)
                k.lion_step(p, torch.zeros(n, dtype=torch.float32), master, _optim_state(m_fmt, n),
                            lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)  # fmt: skip

            yield f"lion m={m_fmt} {tag}", lion
            for mom, nest, wd in SGD_OPTIONS:

                def sgd(pdt=pdt, mdt=mdt, m_fmt=m_fmt, mom=mom, nest=nest, wd=wd):
                    p = torch.zeros(n, dtype=pdt)
                    master = None if mdt is None else torch.zeros(n, dtype=mdt)
                    buf = _optim_state(m_fmt, n) if mom else None
                    k.sgd_step(p, torch.zeros(n, dtype=torch.bfloat16), master, buf, lr=0.1, momentum=mom,
                               weight_decay=wd, nesterov=nest)  # fmt: skip

                yield f"sgd m={m_fmt if mom else '-'} mom={mom} nesterov={nest} wd={wd} {tag}", sgd


# The saved-activation SwiGLU kernels: every activation-format family x dtype x Smooth-SwiGLU scale mode.
SWIGLU_QUANT_FORMATS = ("nf4_b64", "int8_b128", "int4_b64", "int6_b64_sp2", "int4_b32_s16", "cint8_b32",
                        "fp8e4m3_b128", "fp8e5m2_b256")  # fmt: skip


def swiglu_quant_calls(full: bool = False) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, call) for the launches of agoq.kernels.swiglu_quant (forward, and both backward modes)."""
    from agoq.formats import parse_format
    from agoq.kernels import swiglu_quant as k
    from agoq.ref.quant import ref_quantize

    for name, dt in itertools.product(SWIGLU_QUANT_FORMATS, (torch.bfloat16, torch.float16, torch.float32)):
        fmt = parse_format(name)
        ffn = 2 * k.TILE_ELEMS + fmt.block  # two whole tiles and a partial one
        h = torch.zeros(3, 2 * ffn, dtype=dt)
        q = ref_quantize(h, fmt)
        gz = torch.zeros(3, ffn, dtype=dt)
        yield f"swiglu_quantize {name} {dt}", lambda h=h, fmt=fmt: k.swiglu_quantize(h, fmt)
        for mode, s in (("none", None), ("per_token", torch.ones(3, 1)), ("per_channel", torch.ones(ffn))):
            yield f"dequant_swiglu_fwd {name} {dt} {mode}", lambda q=q, s=s: k.dequant_swiglu_fwd(q, s)
            yield f"dequant_swiglu_bwd {name} {dt} {mode}", lambda q=q, gz=gz, s=s: k.dequant_swiglu_bwd(q, gz, s)


def smooth_swiglu_fp8_calls(full: bool = False) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, call) for agoq.kernels.smooth_swiglu_fp8 (both amaxes, the cast in every layout and mode: per token,
    per channel, plain) and the ``mul`` variants of agoq.kernels.fp8_fused's delayed cast."""
    from agoq.kernels import fp8_fused
    from agoq.kernels import smooth_swiglu_fp8 as k

    meta = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float32)
    ws = torch.zeros(2, dtype=torch.int32)
    for dt in k.SMOOTH_DTYPES:
        h = torch.zeros(300, 2 * 130, dtype=dt)
        for per_token in (True, False):
            yield f"smooth_amax {dt} per_token={per_token}", lambda h=h, p=per_token: k.smooth_swiglu_amax(h, p)
            amax = torch.zeros(300 if per_token else 130)
            for rm, tr in ((True, True), (True, False), (False, True)):
                yield (f"smooth_cast {dt} per_token={per_token} rowmajor={rm} transposed={tr}",
                       lambda h=h, a=amax, p=per_token, rm=rm, tr=tr: k.smooth_swiglu_cast_delayed(
                           h, a, "e4m3", meta, ws, per_token=p, rowmajor=rm, transposed=tr, t_colmajor=tr))
        for rm, tr in ((True, True), (True, False), (False, True)):  # plain SwiGLU for a plain FP8 fc2 (s = 1)
            yield (f"smooth_cast {dt} plain rowmajor={rm} transposed={tr}",
                   lambda h=h, rm=rm, tr=tr: k.smooth_swiglu_cast_delayed(
                       h, None, "e4m3", meta, ws, per_token=False, rowmajor=rm, transposed=tr, t_colmajor=tr))
        x = torch.zeros(300, 130, dtype=dt)
        for mul in (None, torch.ones(300, 1), torch.ones(1, 130)):
            for variant in ("e4m3", "e5m2"):
                yield (f"fp8_fused_cast {dt} {variant} mul={None if mul is None else tuple(mul.shape)}",
                       lambda x=x, m=mul, v=variant: fp8_fused.fp8_cast_delayed_2d(x, v, meta, ws, rowmajor=True,
                                                                                 transposed=True, mul=m))


# Byte offset of the last codes row in the ``rows=offset`` variants of comm_peer_calls: a multiple of 8, not of 16
# (agoq.kernels.comm.PEER_ROW_ALIGN_BYTES), so the host check must look at every row and at the full 16 bytes.
PEER_ROW_OFFSET = 8


def _peer_code_rows(world: int, nb: int, offset: int) -> list[torch.Tensor]:
    """W codes rows of nb 256-byte blocks, separate CPU allocations (64-byte aligned); the last one starts
    ``offset`` bytes into its allocation."""
    rows = [torch.zeros(nb * 256, dtype=torch.uint8) for _ in range(world - 1)]
    return rows + [torch.zeros(nb * 256 + offset, dtype=torch.uint8)[offset:]]


def comm_peer_calls(full: bool = False) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, call) for the peer transport's reduce / dequantize launches (agoq.kernels.comm ``*_peer_rows``): float,
    requantized and pushed (requantized into every row, in place: the store all-reduce) output, average and
    post-scale, rows of 1 block (Triton passes a stride of 1 as a constant), 3 and 37 blocks, 2 and 4 peers; codes
    rows at 16-byte aligned addresses (``rows=aligned``: the kernels' ALIGNED specialisation, vector loads and
    stores) and with one row PEER_ROW_OFFSET bytes off (``rows=offset``: byte loads and stores)."""
    from agoq.formats import parse_format
    from agoq.kernels import comm as k

    for fmt_name in ("int8_b256", "fp8e4m3_b256"):
        fmt = parse_format(fmt_name)
        for (world, nb), offset in itertools.product(((2, 1), (2, 3), (4, 37)), (0, PEER_ROW_OFFSET)):
            codes = _peer_code_rows(world, nb, offset)
            scales = [torch.zeros(nb, dtype=torch.float32) for _ in range(world)]
            tag = f"{fmt_name} W={world} nb={nb} rows={'offset' if offset else 'aligned'}"
            for average, post_scale in ((False, 1.0), (True, 0.5)):
                yield (f"reduce_peer_rows {tag} float average={average}",
                       lambda c=codes, s=scales, f=fmt, a=average, ps=post_scale, n=nb * 256: k.reduce_peer_rows(
                           c, s, f, average=a, post_scale=ps, out=torch.zeros(n), out_numel=n))
                yield (f"reduce_peer_rows {tag} requant average={average}",
                       lambda c=codes, s=scales, f=fmt, a=average, ps=post_scale: k.reduce_peer_rows(
                           c, s, f, average=a, post_scale=ps, codes_out=c[0], scales_out=s[0]))
                yield (f"reduce_peer_rows {tag} push average={average}",
                       lambda c=codes, s=scales, f=fmt, a=average, ps=post_scale: k.reduce_peer_rows(
                           c, s, f, average=a, post_scale=ps, codes_out_rows=c, scales_out_rows=s))
            yield (f"dequantize_peer_rows {tag}",
                   lambda c=codes, s=scales, f=fmt, n=nb * 256, w=world: k.dequantize_peer_rows(
                       c, s, torch.zeros(w * n), f, row_stride=n, row_numel=n, col0=0))


def _only(calls, prefix):
    return lambda full=False: ((label, c) for label, c in calls(full) if label.startswith(prefix))


MULTI_NUMELS = (OPTIM_NUMEL, 1000, 64)  # several tensors: full tiles, tails, one short tensor


def optim_multi_calls(full: bool = False) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, call) for the multi-tensor kernel (agoq.kernels.optim_multi): AdamW over every state
    format x every master mode, Lion over every momentum format, SGD's branches (``full``: the block /
    scale sweep too). Tensors are separate allocations, as an optimizer's states are."""
    from agoq.kernels import optim as k
    from agoq.kernels.optim_multi import MultiTensorLaunch

    formats = OPTIM_STATE_FORMATS + (OPTIM_BLOCK_SCALE_FORMATS if full else ())

    def build(pdt, mdt, m_fmt, v_fmt, gdt=torch.bfloat16):
        ps = [torch.zeros(n, dtype=pdt) for n in MULTI_NUMELS]
        masters = [None if mdt is None else torch.zeros(n, dtype=mdt) for n in MULTI_NUMELS]
        return MultiTensorLaunch.build(ps, [torch.zeros(n, dtype=gdt) for n in MULTI_NUMELS], masters,
                                       [_optim_state(m_fmt, n) for n in MULTI_NUMELS],
                                       [_optim_state(v_fmt, n) for n in MULTI_NUMELS])  # fmt: skip

    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    for fmt in formats:
        for pdt, mdt in OPTIM_MASTERS:
            tag = f"{str(pdt)[6:]}/{str(mdt)[6:] if mdt else 'none'}"

            def adamw(pdt=pdt, mdt=mdt, fmt=fmt):
                build(pdt, mdt, fmt, _v_partner(fmt)).run("adamw", k.adamw_scalar_args(**hp))

            yield f"multi adamw m={fmt} {tag}", adamw

        def lion(fmt=fmt):
            scalars = k.lion_scalar_args(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
            build(torch.bfloat16, torch.int8, fmt, None, torch.float32).run("lion", scalars)

        yield f"multi lion m={fmt}", lion
    for mom, nest, wd in SGD_OPTIONS:

        def sgd(mom=mom, nest=nest, wd=wd):
            scalars = k.sgd_scalar_args(lr=0.1, momentum=mom, weight_decay=wd)
            launch = build(torch.bfloat16, torch.int8, "cint8_b32" if mom else None, None)
            launch.run("sgd", scalars, has_wd=wd != 0.0, nesterov=nest)

        yield f"multi sgd mom={mom} nesterov={nest} wd={wd}", sgd


MODULES = {
    "optim": ("agoq.kernels.optim", "_optim_step_kernel", optim_calls),
    "swiglu_quant_fwd": ("agoq.kernels.swiglu_quant", "_FWD", _only(swiglu_quant_calls, "swiglu_quantize")),
    "swiglu_quant_bwd": ("agoq.kernels.swiglu_quant", "_DQ", _only(swiglu_quant_calls, "dequant_swiglu")),
    "optim_multi": ("agoq.kernels.optim_multi", "_multi_step_kernel", optim_multi_calls),
    "smooth_token_amax": ("agoq.kernels.smooth_swiglu_fp8", "_TOKEN_AMAX",
                          _only(smooth_swiglu_fp8_calls, "smooth_amax torch.bfloat16 per_token=True")),
    "smooth_channel_amax": ("agoq.kernels.smooth_swiglu_fp8", "_CHANNEL_AMAX",
                            _only(smooth_swiglu_fp8_calls, "smooth_amax torch.bfloat16 per_token=False")),
    "smooth_cast": ("agoq.kernels.smooth_swiglu_fp8", "_CAST", _only(smooth_swiglu_fp8_calls, "smooth_cast")),
    "fp8_fused_cast": ("agoq.kernels.fp8_fused", "_CAST_LAUNCH", _only(smooth_swiglu_fp8_calls, "fp8_fused_cast")),
    "comm_peer_reduce": ("agoq.kernels.comm", "_PEER_REDUCE", _only(comm_peer_calls, "reduce_peer_rows")),
    "comm_peer_dequantize": ("agoq.kernels.comm", "_PEER_DEQUANTIZE", _only(comm_peer_calls, "dequantize_peer_rows")),
}


def record(module_key: str, full: bool = False) -> tuple[object, list[Launch]]:
    """(the real jit kernel, the launches of every variant call) for a MODULES entry."""
    mod_name, kernel_name, calls = MODULES[module_key]
    module = importlib.import_module(mod_name)
    kernel = getattr(module, kernel_name)
    if hasattr(kernel, "fn") and hasattr(kernel, "options"):  # a FastKernel launches its .fn (a JITFunction's
        kernel = kernel.fn  # own .fn is the Python function: keep the JITFunction then)
    launches: list[Launch] = []
    with recording(module, kernel_name) as rec:
        for label, call in calls(full):
            rec.label = label
            before = len(rec.launches)
            call()
            if len(rec.launches) == before:
                raise AssertionError(f"variant {label!r} launched nothing")
        launches = rec.launches
    return kernel, launches


def main(argv: list[str] | None = None) -> int:
    import triton

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", choices=sorted(MODULES))
    parser.add_argument("--full", action="store_true", help="block/scale sweep x every master mode")
    parser.add_argument("--first", type=int, default=0, help="compile only the first N distinct variants")
    parser.add_argument("--match", default="", help="compile only variants whose label contains this")
    parser.add_argument("--sass", action="store_true", help="print the SASS instruction counts of each variant")
    parser.add_argument("--ptx-ops", action="store_true",
                        help="print each variant's global loads / stores in its PTX, one JSON object a line")
    args = parser.parse_args(argv)
    if not triton.__version__.startswith(EXPECTED_TRITON):
        print(f"warning: Triton {triton.__version__} imported, the GPU runs {EXPECTED_TRITON}", file=sys.stderr)
    kernel, launches = record(args.module, args.full)
    launches = [launch for launch in launches if args.match in launch.label]
    if args.first:
        keys, kept = set(), []
        for launch in launches:
            key = specialize(kernel, launch)[2]
            if key not in keys and len(keys) < args.first:
                keys.add(key)
                kept.append(launch)
        launches = kept
    if args.sass or args.ptx_ops:
        seen = set()
        for launch in launches:
            key = specialize(kernel, launch)[2]
            if key not in seen:
                seen.add(key)
                compiled = compile_launch(kernel, launch)
                if args.sass:
                    print(launch.label, sass_stats(compiled.asm["cubin"]), flush=True)
                if args.ptx_ops:
                    print(json.dumps({"label": launch.label, "ptx_ops": ptx_global_ops(compiled.asm["ptx"])}),
                          flush=True)  # fmt: skip
        return 0
    outcomes = compile_all(kernel, launches, log=lambda s: print(s, flush=True))
    bad = [o for o in outcomes if not o.ok]
    total = sum(o.seconds for o in outcomes)
    print(f"triton {triton.__version__} sm_{TARGET_ARCH}: {len(outcomes) - len(bad)}/{len(outcomes)} variants "
          f"compiled ({len(launches)} launches recorded, {total:.0f}s)")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
