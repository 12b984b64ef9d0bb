"""GPU: fp8_linear (torch._scaled_mm) vs its simulated twin ref_fp8_linear, error bounds vs bf16, saved
bytes, delayed scaling over steps, and Smooth-SwiGLU with a real FP8 fc2. Run: pytest tests/gpu -m gpu.

Tolerances. Both sides use identical FP8 codes (the same cast, agoq.ref.fp8.ref_fp8_cast), so the op
and the reference differ only in the GEMM: accumulation inside FP8 tensor cores (Hopper keeps ~14
significant bits in the MMA accumulator before promotion to fp32, DeepSeek-V3 report §3.3.2; with
fast accumulation there is no promotion) and the bf16 rounding of the output (2**-9 relative, SQNR
~59 dB). We require SQNR(op, ref) >= 40 dB: 14-bit accumulation over K <= 4096 terms in random order
keeps the relative error near 2**-14 * sqrt(K / 128) ~ 2**-11 (~66 dB), so 40 dB is a margin of >20 dB
that still fails for any wiring error (a wrong scale or transpose gives < 10 dB). The reference runs on
CPU in fp32 (no TF32).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agoq.ops.fp8_linear import fp8_linear
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ops.smooth_swiglu import smooth_swiglu, unsmooth_fc2_output
from agoq.ref.fp8 import fp8_amax, fp8_scale_from_amax, ref_fp8_linear
from agoq.testing.numerics import FP8_FLOORS_DB, sqnr_db

pytestmark = [pytest.mark.gpu]

OP_VS_REF_FLOOR_DB = 40.0  # see the module docstring
SHAPES = [(256, 512, 1024), (2048, 2048, 512)]  # (tokens M, in K, out N)


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(autouse=True)
def _needs_fp8_gpu():
    if not _fp8_capable():
        pytest.skip("needs an FP8-capable GPU (sm_89+)")


def _data(m, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    g = torch.randn(m, n, generator=gen)
    return x.bfloat16(), w.bfloat16(), g.bfloat16()


def _grads(fn, x, w, g, device):
    xd = x.to(device).requires_grad_()
    wd = w.to(device).requires_grad_()
    y = fn(xd, wd)
    y.backward(g.to(device))
    return [t.detach().float().cpu() for t in (y, xd.grad, wd.grad)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_linear_matches_ref_current_scaling(shape, granularity, fast_accum):
    x, w, g = _data(*shape)
    recipe = FP8Recipe(granularity=granularity, fast_accum_forward=fast_accum)
    got = _grads(lambda a, b: fp8_linear(a, b, None, recipe), x, w, g, "cuda")
    ref = _grads(lambda a, b: ref_fp8_linear(a.float(), b.float(), granularity), x, w, g, "cpu")
    for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
        assert sqnr_db(b, a) >= OP_VS_REF_FLOOR_DB, name


def _combined_floor_db(*floors_db, margin_db=1.0):
    """Independent quantization noises add in power through a GEMM (see tests/unit/test_fp8_ref.py)."""
    return -10 * math.log10(sum(10 ** (-f / 10) for f in floors_db)) - margin_db


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_linear_vs_bf16_linear_error_bounds(granularity):
    x, w, g = _data(1024, 1024, 1024, seed=1)
    got = _grads(lambda a, b: fp8_linear(a, b, None, FP8Recipe(granularity=granularity)), x, w, g, "cuda")
    ref = _grads(lambda a, b: F.linear(a.float(), b.float()), x, w, g, "cpu")
    e4, e5 = FP8_FLOORS_DB["e4m3"][0], FP8_FLOORS_DB["e5m2"][0]
    floors = (_combined_floor_db(e4, e4), _combined_floor_db(e5, e4), _combined_floor_db(e5, e4))
    for name, a, b, floor in zip(("y", "dx", "dw"), got, ref, floors, strict=True):
        assert sqnr_db(b, a) >= floor, name


def test_fp8_linear_delayed_scaling_over_steps_matches_ref_with_the_same_scales():
    recipe = FP8Recipe(scaling="delayed", amax_history_len=4, fast_accum_forward=False)
    state = FP8ScalingState(recipe).cuda()
    for step in range(5):
        x, w, g = _data(256, 512, 256, seed=10 + step)
        x = x * (1 + step)  # growing activations: the delayed scale lags and saturates a little
        scales = {slot: _next_scale(state, slot, t) for slot, t in (("x", x), ("w", w), ("g", g))}
        got = _grads(lambda a, b: fp8_linear(a, b, state, recipe), x, w, g, "cuda")
        ref = _grads(lambda a, b, sc=scales: ref_fp8_linear(a.float(), b.float(), "tensor", sc["x"], sc["w"], sc["g"]),
                     x, w, g, "cpu")
        for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
            assert sqnr_db(b, a) >= OP_VS_REF_FLOOR_DB, (step, name)
    assert state.num_updates == {"x": 5, "w": 5, "g": 5}


def _next_scale(state, slot, tensor):
    """The scale fp8_linear will use for this slot on its next call (bootstrap, or the history's)."""
    variant = "e5m2" if slot == "g" else "e4m3"
    if state.num_updates[slot] == 0:
        return fp8_scale_from_amax(fp8_amax(tensor.float()), variant)
    return state.scale(slot).detach().cpu()


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_linear_saves_one_byte_per_input_element(granularity):
    """Memory held between forward and backward, beyond the output y: the FP8 input (M*K bytes) plus
    scales; a bf16 copy would add 2*M*K. Slack: allocator rounding (512 B blocks) and scale tensors."""
    m, k, n = 4096, 4096, 1024
    x, w, _ = _data(m, k, n)
    x, w = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    recipe = FP8Recipe(granularity=granularity)
    fp8_linear(x, w, None, recipe)  # warm-up (cuBLAS workspace)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fp8_linear(x, w, None, recipe)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    assert held <= m * k + 64 * 1024, held
    assert held >= m * k  # the FP8 input is really kept
    del y


def test_fp8_linear_3d_input_and_bias():
    x, w, g = _data(512, 256, 128)
    bias = torch.randn(128).bfloat16().cuda().requires_grad_()
    x3 = x.reshape(8, 64, 256).cuda().requires_grad_()
    y = fp8_linear(x3, w.cuda(), None, FP8Recipe(), bias=bias)
    assert y.shape == (8, 64, 128) and y.dtype == torch.bfloat16
    y.backward(g.reshape(8, 64, 128).cuda())
    # bias grad = sum of the bf16 output grad over tokens: fp32 accumulation, one bf16 rounding of the
    # result (2**-8 relative, doubled for margin); atol for sums near 0: 512 bf16 terms of |g| <~ 4
    torch.testing.assert_close(bias.grad.float(), g.float().sum(0).cuda(), rtol=2**-7, atol=1e-2)
    assert x3.grad.shape == x3.shape


def test_smooth_swiglu_with_real_fp8_fc2_rescues_normal_tokens():
    """The outlier-injection case of tests/unit/test_swiglu_ref.py, with fc2 = fp8_linear (per-tensor
    E4M3): relative error of the normal tokens' fc2 output, plain vs per-token Smooth-SwiGLU. Plain
    loses them (inputs flushed to the subnormal band, error ~100 %); smoothed stays near E4M3 precision
    (combined x/w floor 25 dB ~ 6 % relative; we require < 10 %)."""
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, ffn, ch = 256, 256, 512, 7
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(2 * ffn, hidden, generator=gen) / math.sqrt(hidden)
    w1[ch] = w1[ffn + ch]  # aligned gate/up rows of channel ch (the theorem's stationary point)
    x[3] += 100 * math.sqrt(hidden) * w1[ffn + ch] / w1[ffn + ch].norm()
    w2 = (torch.randn(hidden, ffn, generator=gen) / math.sqrt(ffn)).cuda().bfloat16()
    fc1_out = (x @ w1.t()).cuda().bfloat16()
    gate, up = fc1_out.float().chunk(2, dim=-1)
    y_true = (F.silu(gate) * up) @ w2.float().t()
    keep = torch.ones(tokens, dtype=torch.bool, device="cuda")
    keep[3] = False
    plain = fp8_linear((F.silu(gate) * up).bfloat16(), w2).float()
    z, s = smooth_swiglu(fc1_out, "per_token")
    smooth = unsmooth_fc2_output(fp8_linear(z, w2), s).float()

    def rel(y):
        return ((y - y_true)[keep].norm() / y_true[keep].norm()).item()

    assert rel(plain) > 0.5 and rel(smooth) < 0.1, (rel(plain), rel(smooth))


# ------------------------------------------------------------ weight cache, launches, host syncs ----
CACHE_RECIPES = {"current": FP8Recipe(fast_accum_forward=False),
                 "delayed": FP8Recipe(scaling="delayed", fast_accum_forward=False),
                 "row": FP8Recipe(granularity="row", fast_accum_forward=False)}


@pytest.mark.parametrize("name", sorted(CACHE_RECIPES))
def test_weight_cache_gives_the_uncached_results(name):
    """Three micro-batches, one weight: bit-identical outputs and gradients with and without the
    FP8 weight cache, and the weight cast once with it."""
    from agoq.ops.fp8_weight_cache import FP8WeightCache

    recipe = CACHE_RECIPES[name]
    batches = [[t.cuda() for t in _data(512, 256, 384, seed=20 + i)] for i in range(3)]
    results = []
    for cache in (None, FP8WeightCache()):
        state = FP8ScalingState(recipe).cuda() if recipe.scaling == "delayed" else None
        w = batches[0][1].clone().requires_grad_()
        got = []
        for x, _, g in batches:
            x = x.clone().requires_grad_()
            y = fp8_linear(x, w, state, recipe, weight_cache=cache)
            y.backward(g)
            got += [y.detach(), x.grad]
        results.append(got + [w.grad])
        if cache is not None:
            assert cache.refreshes == 1
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _cuda_kernel_names(fn) -> list[str]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


def test_cached_delayed_linear_is_two_cast_launches_three_gemms_and_no_host_sync():
    """The overhead contract of the fused path: with delayed scaling and a cached weight, one forward +
    backward launches exactly two Triton kernels (the fused x and g casts: no amax, scale or history
    kernels, no weight cast) and never synchronises the host."""
    from agoq.ops.fp8_weight_cache import FP8WeightCache

    recipe = FP8Recipe(scaling="delayed")
    state, cache = FP8ScalingState(recipe).cuda(), FP8WeightCache()
    x, w, g = (t.cuda() for t in _data(1024, 512, 768))
    x, w = x.requires_grad_(), w.requires_grad_()

    def step():
        fp8_linear(x, w, state, recipe, weight_cache=cache).backward(g)

    for _ in range(3):  # bootstrap, compile, weight cast
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    names = _cuda_kernel_names(step)
    agoq_kernels = {"_cast_tensor_kernel", "_cast_kernel", "_amax_flat_kernel", "_amax_rowcol_kernel",
                    "_scales_kernel", "_history_kernel"}
    assert [n for n in names if n in agoq_kernels] == ["_cast_tensor_kernel", "_cast_tensor_kernel"], names
    assert cache.refreshes == 1


# ------------------------------------------------------------ direct Triton launches (host time) ----

def _delayed_steps(x, w, g, steps=4):
    """forward + backward of a delayed-scaling FP8 linear with a weight cache, several micro-batches:
    outputs, grads and the final metas (every cast after the first is a delayed one)."""
    from agoq.ops.fp8_weight_cache import FP8WeightCache

    recipe = FP8Recipe(scaling="delayed")
    state, cache, outs = FP8ScalingState(recipe).cuda(), FP8WeightCache(), []
    for i in range(steps):
        xi = (x * (1 + i)).requires_grad_()
        wi = w.detach().requires_grad_()
        y = fp8_linear(xi, wi, state, recipe, weight_cache=cache)
        y.backward(g * (1 + 2 * i))
        outs += [y.detach(), xi.grad, wi.grad]
    return outs + [state.meta(s) for s in ("x", "w", "g")]


@pytest.mark.parametrize("lead", [(1024,), (4, 256)])
def test_direct_launch_is_bit_identical_to_tritons_dispatch(lead):
    """agoq.kernels.fastlaunch calls the compiled cast kernels directly after their first launch:
    outputs, gradients and the scaling metas equal those of Triton's own dispatch bit for bit (2-D
    and 3-D inputs, the latter read in place)."""
    from agoq.kernels import fastlaunch, fp8_fused

    x, w, g = (t.cuda() for t in _data(1024, 512, 768))
    x, g = x.reshape(*lead, 512), g.reshape(*lead, 768)
    previous = fastlaunch.set_fast_launch(False)
    try:
        dispatched = _delayed_steps(x, w, g)
    finally:
        fastlaunch.set_fast_launch(previous)
    assert fastlaunch.fast_launch_enabled()
    before = fp8_fused._CAST_LAUNCH.direct_calls
    direct = _delayed_steps(x, w, g)
    assert fp8_fused._CAST_LAUNCH.direct_calls > before  # the direct path did run
    for a, b in zip(dispatched, direct, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_3d_input_output_is_not_a_view_and_allows_in_place_ops():
    """The 3-D output is written in its final shape (no view made inside the Function), so in-place
    ops on it (Megatron's bias add / all-reduce) work; grads match the 2-D call."""
    x, w, g = (t.cuda() for t in _data(512, 256, 384))
    recipe = FP8Recipe()
    x3 = x.reshape(8, 64, 256).requires_grad_()
    w3 = w.clone().requires_grad_()
    y3 = fp8_linear(x3, w3, None, recipe)
    assert y3.shape == (8, 64, 384) and y3._base is None
    y3.mul_(1.0)
    y3.backward(g.reshape(8, 64, 384))
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8_linear(x2, w2, None, recipe).backward(g)
    assert torch.equal(x3.grad.reshape(512, 256), x2.grad) and torch.equal(w3.grad, w2.grad)
