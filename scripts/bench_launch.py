"""Host-side cost per call of agoq's saved-activation ops (launch overhead), GPU.

When a training step is host-bound (fwd+bwd enqueue time ~ step time, see bench_memory.py's
``fwd_bwd_host_s_median``), what matters is the CPU time each op costs to enqueue, not its kernel
time. This times N back-to-back calls on tiny tensors (kernel time negligible) without syncing:

    python scripts/bench_launch.py --json out.json

Rows: microseconds of host time per call for torch.add (the floor), agoq quantize / dequantize per
format, swiglu_bwd, and the RMSNorm / SwiGLU saving-input autograd functions (forward + backward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _host_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(host / calls * 1e6, 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--formats", nargs="+", default=["nf4_b64", "int8_b128", "int4_b64"])
    p.add_argument("--json")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N top functions (tottime) "
                   "of the RMSNorm and SwiGLU saving-input steps under cProfile")
    args = p.parse_args(argv)
    from agoq.formats import parse_format
    from agoq.kernels.quant import dequantize, quantize
    from agoq.kernels.swiglu import swiglu_bwd
    from agoq.ops.saved_act import rmsnorm_saving_input, swiglu_saving_input

    dev = torch.device("cuda")
    x = torch.randn(4, 512, device=dev, dtype=torch.bfloat16)
    h = torch.randn(4, 1024, device=dev, dtype=torch.bfloat16)
    rows = {"torch_add": _host_us(lambda: x + x, args.calls)}
    for name in args.formats:
        fmt = parse_format(name)
        q = quantize(x, fmt)
        rows[f"quantize_{name}"] = _host_us(lambda: quantize(x, fmt), args.calls)
        rows[f"dequantize_{name}"] = _host_us(lambda: dequantize(q), args.calls)
    rows["swiglu_bwd"] = _host_us(lambda: swiglu_bwd(h, x), args.calls)
    fmt = parse_format(args.formats[0])
    xr = x.clone().requires_grad_(True)
    w = torch.ones(512, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def norm_step():
        y, _ = rmsnorm_saving_input(xr, w, 1e-5, fmt, (0, "norm_in"))
        y.sum().backward()

    hr = h.clone().requires_grad_(True)

    def swiglu_step():
        z, _ = swiglu_saving_input(hr, fmt, (0, "swiglu_in"))
        z.sum().backward()

    def plain_norm_step():
        torch.nn.functional.rms_norm(xr, (512,), w, 1e-5).sum().backward()

    rows["rmsnorm_saving_input_fwd_bwd"] = _host_us(norm_step, args.calls // 4)
    rows["plain_rms_norm_fwd_bwd"] = _host_us(plain_norm_step, args.calls // 4)
    rows["swiglu_saving_input_fwd_bwd"] = _host_us(swiglu_step, args.calls // 4)
    if args.cprofile:
        import cProfile
        import pstats

        for name, fn in (("rmsnorm", norm_step), ("swiglu", swiglu_step)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"--- cProfile: {name}_saving_input fwd+bwd x 200")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    for k, v in rows.items():
        print(f"{k:40s} {v:8.1f} us/call")
    if args.json:
        import triton

        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "triton": triton.__version__, "host_us_per_call": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
