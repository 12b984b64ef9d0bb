"""Host-side cost per call of agoq's saved-activation ops (launch overhead), GPU; CPU smoke.

When a training step is host-bound (fwd+bwd enqueue time ~ step time, see bench_memory.py's
``fwd_bwd_host_s_median``), what matters is the CPU time each op costs to enqueue, not its kernel
time. This times N back-to-back calls on tiny tensors (kernel time negligible) without syncing:

    python benchmarks/bench_launch.py --json out.json          # GPU, ~1 minute
    python benchmarks/bench_launch.py --smoke --json out.json  # CPU: reference ops, checks the script runs

Rows (microseconds of host time per call):
- ``torch_add``: the floor of one ATen launch;
- per format: ``quantize_<fmt>`` / ``dequantize_<fmt>`` with agoq's direct launch
  (agoq.kernels.fastlaunch) and ``..._triton_run`` through Triton's own ``kernel[grid]`` path;
- the SwiGLU kernels: ``swiglu_bwd``, ``swiglu_quantize``, ``dequant_swiglu_fwd`` / ``_bwd``;
- whole autograd paths, forward + backward, each against the plain bf16 path that Megatron runs when
  the role is bf16 (``plain_*``; SwiGLU: Megatron's unfused GLU): the norm alone, norm -> linear (the
  linear recomputes its input from the norm's stash, as QKV / fc1 do), SwiGLU alone, SwiGLU -> linear
  (fc2), each also as agoq's one node (``*_node``: agoq.ops.norm_linear / swiglu_linear, the defaults), and a
  linear storing its own input quantized (the out-projection) in a hook scope and as one node (agoq.ops.quant_linear,
  the default). ``*_legacy`` rows run the same agoq path with direct launches and the fused SwiGLU kernels
  switched off (the launch path and SwiGLU of the code before this change; its Python glue trimming
  stays on), in the same process, so the A/B does not depend on the host's speed.
- ``ratio_*``: saving path / plain path per pair (the issue's goal: within ~1.5x).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKENS, HIDDEN, FFN = 4, 512, 512  # tiny: kernel time is negligible next to the host's


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _host_us(fn, calls: int, dev: torch.device) -> float:
    for _ in range(max(2, calls // 50)):
        fn()
    _sync(dev)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    _sync(dev)
    return round(host / calls * 1e6, 2)


def legacy_save_paths():
    """The SwiGLU and RMSNorm of the saved-activation code before the host-cost work: the unfused SwiGLU
    (quantize + ATen forward; dequantize + recompute + backward) and the RMSNorm as agoq's autograd function
    (passed in as ``agoq.ops.saved_act.SavePaths``)."""
    from agoq.ops.saved_act import SavePaths

    return SavePaths(fuse_swiglu=False, fuse_norm_linear=False, fuse_swiglu_linear=False, quantized_linear_node=False)


@contextlib.contextmanager
def legacy_launch():
    """The launch path of the code before the host-cost work: Triton's own launch path for every kernel (no
    direct launches, no launch sites). With :func:`legacy_save_paths` the old code path; the glue trimming
    (counter weakrefs, per-tensor hooks on the linears' saved input) is not undone."""
    from agoq.kernels import fastlaunch

    previous = fastlaunch.set_fast_launch(False)
    try:
        yield
    finally:
        fastlaunch.set_fast_launch(previous)


def _linear_saving(x, w, stash):
    """A linear that stores nothing and rebuilds its input from ``stash`` (agoq's QKV / fc1 / fc2)."""
    from agoq.ops.saved_act import quantized_saves

    with quantized_saves(x, stash=stash):
        return F.linear(x, w)


def path_steps(dev: torch.device, fmt, paths=None) -> dict:
    """name -> zero-argument callable running one forward + backward of a plain or saving path (``paths``:
    an ``agoq.ops.saved_act.SavePaths``, default the current paths)."""
    from agoq.ops.saved_act import SavePaths
    from agoq.ops.saved_norm import rmsnorm_saving_input
    from agoq.ops.saved_swiglu import swiglu_reference, swiglu_saving_input

    paths = paths or SavePaths()
    norm_kw, glu_kw = {}, {"fuse": paths.fuse_swiglu}

    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
    h = torch.randn(TOKENS, 2 * FFN, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w_lin = torch.randn(HIDDEN, HIDDEN, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
    w_fc2 = torch.randn(HIDDEN, FFN, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
    x_lin = torch.randn(TOKENS, HIDDEN, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)

    def norm():
        y, _ = rmsnorm_saving_input(x, w, 1e-5, fmt, (0, "norm.input"), **norm_kw)
        y.sum().backward()

    def plain_norm():
        F.rms_norm(x, (HIDDEN,), w, 1e-5).sum().backward()

    def norm_linear():
        y, stash = rmsnorm_saving_input(x, w, 1e-5, fmt, (0, "norm.input"), **norm_kw)
        _linear_saving(y, w_lin, stash).sum().backward()

    def norm_linear_node():  # the default for QKV / fc1: norm and linear as one node (agoq.ops.norm_linear)
        from agoq.ops.norm_linear import NormFeed, rmsnorm_linear, rmsnorm_no_graph

        y = rmsnorm_no_graph(x, w, 1e-5)
        rmsnorm_linear(NormFeed(x, w, 1e-5, y, fmt, (0, "norm.input"), None), w_lin).sum().backward()

    def plain_norm_linear():
        F.linear(F.rms_norm(x, (HIDDEN,), w, 1e-5), w_lin).sum().backward()

    def swiglu():
        z, _ = swiglu_saving_input(h, fmt, (0, "mlp.swiglu_input"), **glu_kw)
        z.sum().backward()

    def plain_swiglu():
        swiglu_reference(h).sum().backward()

    def swiglu_linear():
        z, stash = swiglu_saving_input(h, fmt, (0, "mlp.swiglu_input"), **glu_kw)
        _linear_saving(z, w_fc2, stash).sum().backward()

    def swiglu_linear_node():  # the default for fc2: SwiGLU and fc2 as one node (agoq.ops.swiglu_linear)
        from agoq.ops.swiglu_linear import swiglu_linear, swiglu_no_graph

        feed = swiglu_no_graph(h, fmt, (0, "mlp.swiglu_input"), None, **glu_kw)
        swiglu_linear(feed, w_fc2).sum().backward()

    def plain_swiglu_linear():
        F.linear(swiglu_reference(h), w_fc2).sum().backward()

    def linear_quantized_scope():  # a linear storing its input quantized, in agoq's hook scope (the old path)
        from agoq.ops.saved_act import quantized_saves

        with quantized_saves(x_lin, fmt=fmt, key=(0, "attn.proj_input"), counter=None):
            out = F.linear(x_lin, w_lin)
        out.sum().backward()  # outside the scope, as in the model

    def linear_quantized_node():  # the default for the out-projection: one node (agoq.ops.quant_linear)
        from agoq.ops.quant_linear import quantized_input_linear

        quantized_input_linear(x_lin, w_lin, None, fmt, (0, "attn.proj_input")).sum().backward()

    def plain_linear():
        F.linear(x_lin, w_lin).sum().backward()

    return {"rmsnorm_saving_input_fwd_bwd": norm, "plain_rms_norm_fwd_bwd": plain_norm,
            "rmsnorm_saving_then_linear_fwd_bwd": norm_linear, "plain_rms_norm_then_linear_fwd_bwd": plain_norm_linear,
            "rmsnorm_linear_node_fwd_bwd": norm_linear_node,
            "swiglu_saving_input_fwd_bwd": swiglu, "plain_swiglu_fwd_bwd": plain_swiglu,
            "swiglu_saving_then_linear_fwd_bwd": swiglu_linear, "plain_swiglu_then_linear_fwd_bwd": plain_swiglu_linear,
            "swiglu_linear_node_fwd_bwd": swiglu_linear_node,
            "linear_quantized_scope_fwd_bwd": linear_quantized_scope,
            "linear_quantized_node_fwd_bwd": linear_quantized_node, "plain_linear_fwd_bwd": plain_linear}


def anatomy_steps(dev: torch.device, fmt) -> dict:
    """Where the RMSNorm saving path's host time goes: the same norm fwd + bwd built up piece by piece
    (``--anatomy``). Each row adds one ingredient of rmsnorm_saving_input to the plain ATen norm."""
    from agoq.kernels.quant import dequantize, quantize
    from agoq.ops.saved_act import quantized_saves
    from agoq.ops.saved_norm import _fused_rms_norm, rmsnorm_saving_input

    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    width = [HIDDEN]

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g

    class FnNorm(torch.autograd.Function):  # ATen's fused norm inside a Python Function, nothing quantized
        @staticmethod
        def forward(ctx, t, weight):
            y, rstd = _fused_rms_norm(t, width, weight, 1e-5)
            ctx.save_for_backward(t, weight, rstd)
            return y

        @staticmethod
        def backward(ctx, g):
            t, weight, rstd = ctx.saved_tensors
            return torch.ops.aten._fused_rms_norm_backward(g.contiguous(), t, width, rstd, weight, [True, True])

    def pack_quant(t):
        return quantize(t, fmt) if t.dim() == 2 and t.shape[0] == TOKENS else t

    def unpack_quant(obj):
        return dequantize(obj) if not isinstance(obj, torch.Tensor) else obj

    def backward_floor():
        x.sum().backward()

    def identity_fn():
        Identity.apply(x).sum().backward()

    def plain():
        F.rms_norm(x, width, w, 1e-5).sum().backward()

    def fn_norm():
        FnNorm.apply(x, w).sum().backward()

    def hooks_identity():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = F.rms_norm(x, width, w, 1e-5)
        y.sum().backward()

    def hooks_quant():
        with torch.autograd.graph.saved_tensors_hooks(pack_quant, unpack_quant):
            y = F.rms_norm(x, width, w, 1e-5)
        y.sum().backward()

    def quant_dequant():
        dequantize(quantize(x, fmt))

    def fused_norm_nograd():
        with torch.no_grad():
            _fused_rms_norm(x, width, w, 1e-5)

    def agoq_norm():
        y, _ = rmsnorm_saving_input(x, w, 1e-5, fmt, (0, "norm.input"))
        y.sum().backward()

    w_lin = torch.randn(HIDDEN, HIDDEN, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)

    def plain_linear():
        F.linear(x, w_lin).sum().backward()

    def linear_quantized_saves():
        with quantized_saves(x, fmt=fmt, key=(0, "attn.proj_input")):
            y = F.linear(x, w_lin)
        y.sum().backward()

    return {"anat_backward_floor": backward_floor, "anat_identity_fn": identity_fn, "anat_plain_norm": plain,
            "anat_fn_norm": fn_norm, "anat_hooks_identity_norm": hooks_identity, "anat_hooks_quant_norm": hooks_quant,
            "anat_quant_dequant": quant_dequant, "anat_fused_norm_nograd": fused_norm_nograd,
            "anat_agoq_norm": agoq_norm, "anat_plain_linear": plain_linear,
            "anat_linear_quantized_saves": linear_quantized_saves}


PAIRS = {"rmsnorm": ("rmsnorm_saving_input_fwd_bwd", "plain_rms_norm_fwd_bwd"),
         "rmsnorm_linear": ("rmsnorm_saving_then_linear_fwd_bwd", "plain_rms_norm_then_linear_fwd_bwd"),
         "rmsnorm_linear_node": ("rmsnorm_linear_node_fwd_bwd", "plain_rms_norm_then_linear_fwd_bwd"),
         "swiglu": ("swiglu_saving_input_fwd_bwd", "plain_swiglu_fwd_bwd"),
         "swiglu_linear": ("swiglu_saving_then_linear_fwd_bwd", "plain_swiglu_then_linear_fwd_bwd"),
         "swiglu_linear_node": ("swiglu_linear_node_fwd_bwd", "plain_swiglu_then_linear_fwd_bwd"),
         "linear_quantized_scope": ("linear_quantized_scope_fwd_bwd", "plain_linear_fwd_bwd"),
         "linear_quantized_node": ("linear_quantized_node_fwd_bwd", "plain_linear_fwd_bwd")}


def kernel_rows(dev, formats, calls) -> dict:
    from agoq.formats import parse_format
    from agoq.kernels import fastlaunch
    from agoq.kernels.quant import dequantize, quantize
    from agoq.kernels.swiglu import swiglu_bwd
    from agoq.kernels.swiglu_quant import dequant_swiglu_bwd, dequant_swiglu_fwd, swiglu_quantize

    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    h = torch.randn(TOKENS, 2 * FFN, device=dev, dtype=torch.bfloat16)
    gz = torch.randn(TOKENS, FFN, device=dev, dtype=torch.bfloat16)
    rows = {}
    for name in formats:
        fmt = parse_format(name)
        q = quantize(x, fmt)
        for fast in (True, False):
            previous = fastlaunch.set_fast_launch(fast)
            suffix = "" if fast else "_triton_run"
            rows[f"quantize_{name}{suffix}"] = _host_us(lambda: quantize(x, fmt), calls, dev)  # noqa: B023
            rows[f"dequantize_{name}{suffix}"] = _host_us(lambda: dequantize(q), calls, dev)  # noqa: B023
            fastlaunch.set_fast_launch(previous)
    fmt = parse_format(formats[0])
    qh = quantize(h, fmt)
    rows["swiglu_bwd"] = _host_us(lambda: swiglu_bwd(h, gz), calls, dev)
    rows["swiglu_quantize"] = _host_us(lambda: swiglu_quantize(h, fmt), calls, dev)
    rows["dequant_swiglu_fwd"] = _host_us(lambda: dequant_swiglu_fwd(qh), calls, dev)
    rows["dequant_swiglu_bwd"] = _host_us(lambda: dequant_swiglu_bwd(qh, gz), calls, dev)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--formats", nargs="+", default=["nf4_b64", "int8_b128", "int4_b64"])
    p.add_argument("--smoke", action="store_true", help="CPU, reference ops, few calls: checks the script runs")
    p.add_argument("--json")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N top functions (tottime) "
                   "of the RMSNorm and SwiGLU saving-input steps under cProfile")
    p.add_argument("--anatomy", action="store_true", help="also time the RMSNorm saving path built up piece "
                   "by piece (anat_* rows, GPU only)")
    args = p.parse_args(argv)
    from agoq.formats import parse_format

    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    calls = 8 if args.smoke else args.calls
    t = torch.ones(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    rows = {"torch_add": _host_us(lambda: t + t, calls, dev)}
    if dev.type == "cuda":
        rows.update(kernel_rows(dev, args.formats, calls))
    steps = path_steps(dev, parse_format(args.formats[0]))
    legacy_steps = path_steps(dev, parse_format(args.formats[0]), legacy_save_paths())
    for name, fn in steps.items():
        rows[name] = _host_us(fn, max(2, calls // 4), dev)
        if not name.startswith("plain_"):
            with legacy_launch():
                rows[f"{name}_legacy"] = _host_us(legacy_steps[name], max(2, calls // 4), dev)
    if args.anatomy and dev.type == "cuda":
        for name, fn in anatomy_steps(dev, parse_format(args.formats[0])).items():
            rows[name] = _host_us(fn, max(2, calls // 4), dev)
    for pair, (saving, plain) in PAIRS.items():
        rows[f"ratio_{pair}"] = round(rows[saving] / rows[plain], 3)
        rows[f"ratio_{pair}_legacy"] = round(rows[f"{saving}_legacy"] / rows[plain], 3)
    if args.cprofile:
        import cProfile
        import pstats

        for name in ("rmsnorm_linear_node_fwd_bwd", "plain_rms_norm_then_linear_fwd_bwd",
                     "rmsnorm_saving_then_linear_fwd_bwd", "swiglu_saving_then_linear_fwd_bwd"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                steps[name]()
            prof.disable()
            _sync(dev)
            print(f"--- cProfile: {name} x 200")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    for k, v in rows.items():
        print(f"{k:48s} {v:9.2f} {'x' if k.startswith('ratio_') else 'us/call'}")
    if args.json:
        import triton

        Path(args.json).write_text(json.dumps({
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke: reference ops)",
            "torch": torch.__version__, "triton": triton.__version__, "tokens": TOKENS, "hidden": HIDDEN,
            "ffn": FFN, "host_us_per_call": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
