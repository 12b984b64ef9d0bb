"""agoq.ops.fp8_linear on CPU: argument checks, the no-silent-fallback error, and the GEMM wiring
(transposes, layouts, scales) of FP8LinearFunction against ref_fp8_linear through torch's CPU
``_scaled_mm`` (present in recent torch; skipped where missing). GPU runs: tests/gpu/test_fp8_linear_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from agoq.ops.fp8_linear import FP8LinearFunction, check_fp8_linear_args, fp8_linear
from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState
from agoq.ref.fp8 import fp8_amax, fp8_scale_from_amax, ref_fp8_linear
from agoq.testing.fp8 import CPU_SCALED_MM_SKIP_REASON, cpu_scaled_mm_available

EPS32 = torch.finfo(torch.float32).eps
BF16_REL = 2.0**-8  # bf16 rounding of a GEMM output: half an ulp of an 8-bit significand


needs_cpu_scaled_mm = pytest.mark.skipif(not cpu_scaled_mm_available(), reason=CPU_SCALED_MM_SKIP_REASON)


def _data(m=64, k=96, n=48, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[3] *= 30.0  # one loud token: row scaling differs visibly from tensor scaling
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    g = torch.randn(m, n, generator=gen)
    return x.to(dtype), w.to(dtype), g.to(dtype)


def test_fp8_linear_on_cpu_raises_with_the_fix():
    x, w, _ = _data()
    with pytest.raises(NotImplementedError, match="ref_fp8_linear"):
        fp8_linear(x, w)


@pytest.mark.parametrize(
    "shape_x,shape_w,match",
    [((10, 32), (32, 32), "tokens"), ((16, 40), (32, 40), "in_features"), ((16, 32), (24, 32), "out_features"),
     ((16, 32), (32, 48), "do not match")],
)
def test_check_args_dims(shape_x, shape_w, match):
    with pytest.raises(ValueError, match=match):
        check_fp8_linear_args(torch.zeros(shape_x), torch.zeros(shape_w), None, FP8Recipe())


def test_check_args_delayed_needs_state_and_recipe_type():
    x, w, _ = _data()
    with pytest.raises(ValueError, match="FP8ScalingState"):
        check_fp8_linear_args(x, w, None, FP8Recipe(scaling="delayed"))
    with pytest.raises(ValueError, match="FP8Recipe"):
        check_fp8_linear_args(x, w, None, "tensor")
    with pytest.raises(ValueError, match="bf16"):
        check_fp8_linear_args(x.to(torch.float8_e4m3fn), w, None, FP8Recipe())


def _run(fn, x, w, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y.detach().float(), x.grad.float(), w.grad.float()


def _assert_gemm_close(got, ref, a_abs, b_abs, what):
    """Same FP8 codes on both sides; the GEMMs differ only in accumulation order (<= K eps32 of the
    sum of |terms|) and the bf16 rounding of the result (<= 2**-8 relative each side)."""
    k = a_abs.shape[1]
    bound = 2 * BF16_REL * ref.abs() + 2 * k * EPS32 * (a_abs @ b_abs) + 1e-30
    worst = ((got - ref).abs() / bound).max().item()
    assert worst <= 1.0, f"{what}: error {worst:.2f}x the bound"


@needs_cpu_scaled_mm
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_function_wiring_matches_ref_current_scaling(granularity):
    x, w, g = _data()
    recipe = FP8Recipe(granularity=granularity, fast_accum_forward=False)
    y, dx, dw = _run(lambda a, b: FP8LinearFunction.apply(a, b, None, recipe), x, w, g)
    y_r, dx_r, dw_r = _run(lambda a, b: ref_fp8_linear(a, b, granularity), x, w, g)
    xa, wa, ga = x.float().abs(), w.float().abs(), g.float().abs()
    # |terms| use the unquantized magnitudes times (1 + 2**-3): FP8 moves each value by < 1/16 relative
    _assert_gemm_close(y, y_r, xa * 1.125, wa.t() * 1.125, "y")
    _assert_gemm_close(dx, dx_r, ga * 1.25, wa * 1.125, "dx")
    _assert_gemm_close(dw, dw_r, ga.t() * 1.25, xa * 1.125, "dw")


@needs_cpu_scaled_mm
def test_function_wiring_delayed_uses_each_microbatch_forward_scales():
    """Two micro-batches forward (the state's scales move in between), then backward in reverse order
    (pipeline 1F1B order does this): each backward must use its own forward's x / w scales."""
    recipe = FP8Recipe(scaling="delayed", amax_history_len=4, fast_accum_forward=False)
    state = FP8ScalingState(recipe)
    batches = [_data(seed=s) for s in (1, 2)]
    batches[1] = (batches[1][0] * 8, batches[1][1], batches[1][2])  # larger amax in micro-batch 2
    w = batches[0][1].clone().requires_grad_()
    outs, expected_scales = [], []
    for x, _, _ in batches:
        sx_hist = fp8_scale_from_amax(state.amax_history("x").amax(), "e4m3") if state.num_updates["x"] else None
        sx = sx_hist if sx_hist is not None else fp8_scale_from_amax(fp8_amax(x), "e4m3")
        expected_scales.append(sx)
        outs.append(FP8LinearFunction.apply(x, w, state, recipe))
    grads = []
    for y, (_, _, g) in zip(reversed(outs), reversed(batches), strict=True):
        w.grad = None
        y.backward(g)
        grads.append(w.grad.float())
    grads.reverse()
    for i, (x, _, g) in enumerate(batches):
        wq = w.detach().clone().requires_grad_()
        xs = x.clone().requires_grad_()
        # g's delayed scale: micro-batch 2's backward ran first (bootstrap = its own amax)
        y_r = ref_fp8_linear(xs, wq, "tensor", x_scale=expected_scales[i],
                             w_scale=fp8_scale_from_amax(fp8_amax(w), "e4m3"),
                             g_scale=_g_scale(batches, i))
        y_r.backward(g)
        _assert_gemm_close(grads[i], wq.grad.float(), g.float().abs().t() * 1.25, x.float().abs() * 1.125, f"dw{i}")


def _g_scale(batches, i):
    """Backward order is micro-batch 1 (index 1) then 0: index 1 bootstraps from its own amax, index 0
    uses the history, which then holds index 1's amax."""
    return fp8_scale_from_amax(fp8_amax(batches[1][2]), "e5m2")


@needs_cpu_scaled_mm
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_saved_input_is_fp8_only(granularity):
    """No bf16 copy of x is kept for backward: the x-sized saved tensor is FP8 (1 byte/element) and
    the weight is saved by reference (the parameter itself, no copy)."""
    x, w, _ = _data()
    w = w.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        FP8LinearFunction.apply(x.requires_grad_(), w, None, FP8Recipe(granularity=granularity))
    x_sized = [t for t in saved if t.numel() == x.numel()]
    assert len(x_sized) == 1 and x_sized[0].dtype == torch.float8_e4m3fn
    assert any(t is w or t.data_ptr() == w.data_ptr() for t in saved)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != w.data_ptr())
    # codes + fp32 scales: row-wise keeps the per-column scales of x and w ([1, K] each) and their
    # inverses for backward
    assert saved_bytes <= x.numel() + 4 * (4 * x.shape[1] + 4)


@needs_cpu_scaled_mm
def test_row_granularity_beats_tensor_on_token_outliers():
    """A token 1e4 x louder than the rest: per-tensor E4M3 flushes the quiet tokens' inputs, row scaling
    keeps them (relative output error of the quiet tokens, forward)."""
    x, w, _ = _data(dtype=torch.float32)
    x[3] *= 1e4
    errs = {}
    for gran in ("tensor", "row"):
        y = FP8LinearFunction.apply(x, w, None, FP8Recipe(granularity=gran, fast_accum_forward=False)).float()
        y_true = x @ w.t()
        quiet = torch.ones(x.shape[0], dtype=torch.bool)
        quiet[3] = False
        errs[gran] = ((y - y_true)[quiet].norm() / y_true[quiet].norm()).item()
    assert errs["row"] < 0.1 and errs["tensor"] > 0.5, errs


class _Handle:
    """What agoq's activation storage hands the FP8 linear: materialize() gives x back in backward."""

    def __init__(self, x, calls):
        self.x, self.calls = x, calls

    def materialize(self):
        self.calls.append(1)
        return self.x


@needs_cpu_scaled_mm
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_x_saver_keeps_no_fp8_copy_and_gives_the_same_grads(granularity):
    """With an exact handle, rebuilding x and re-casting it with the forward's scales must give the
    codes the forward would have kept: identical gradients, and no x-sized tensor saved by the op."""
    x, w, g = _data()
    recipe = FP8Recipe(granularity=granularity, fast_accum_forward=False)
    ref = _run(lambda a, b: FP8LinearFunction.apply(a, b, None, recipe), x, w, g)
    calls, saved = [], []

    def pack(t):
        saved.append(t)
        return t

    def fn(a, b):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return FP8LinearFunction.apply(a, b, None, recipe, None, lambda x2: _Handle(x2.detach(), calls))

    got = _run(fn, x, w, g)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    assert calls == [1] and not [t for t in saved if t.numel() == x.numel()]


@needs_cpu_scaled_mm
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_w_col_scale_uses_w_times_s_and_scales_the_weight_grad(granularity):
    """Per-channel Smooth-SwiGLU folds s into fc2's input columns: y = x @ (W * s).T, dW = dW' * s.
    With power-of-two s, W * s is exact in bf16, so the op must equal the op on a materialised W * s
    (same codes) and its weight grad must be that grad times s (exact: a power-of-two product)."""
    x, w, g = _data()
    s = 2.0 ** torch.randint(-3, 4, (w.shape[1],), generator=torch.Generator().manual_seed(5)).float()
    recipe = FP8Recipe(granularity=granularity, fast_accum_forward=False)
    y, dx, dw = _run(lambda a, b: FP8LinearFunction.apply(a, b, None, recipe, s), x, w, g)
    w_s = (w.float() * s).bfloat16()
    y_r, dx_r, dw_r = _run(lambda a, b: FP8LinearFunction.apply(a, b, None, recipe), x, w_s, g)
    assert torch.equal(y, y_r) and torch.equal(dx, dx_r)
    assert torch.equal(dw, (dw_r * s).bfloat16().float())


@needs_cpu_scaled_mm
def test_no_grad_forward_keeps_nothing():
    x, w, _ = _data()
    with torch.no_grad():
        y = FP8LinearFunction.apply(x, w.requires_grad_(), None, FP8Recipe(), None, None, False)
    assert y.grad_fn is None and y.dtype == x.dtype


@needs_cpu_scaled_mm
@pytest.mark.parametrize("granularity,scaling", [("tensor", "current"), ("tensor", "delayed"), ("row", "current")])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_3d_input_is_read_in_place_and_gives_the_2d_results(granularity, scaling, x_dtype):
    """x [B, S, K] goes into the Function as is (no reshape node): the output is [B, S, N], not a view
    (in-place ops on it are allowed, as Megatron's bias add / all-reduce need), and y, dx, dw equal
    the 2-D call's bit for bit; the graph holds the FP8 node only."""
    recipe = FP8Recipe(granularity=granularity, scaling=scaling)
    x, w, g = _data(dtype=x_dtype)
    results = []
    for lead in ((64,), (4, 16)):
        state = FP8ScalingState(recipe) if scaling == "delayed" else None
        xr = x.reshape(*lead, x.shape[1]).clone().requires_grad_()
        wr = w.clone().requires_grad_()
        y = FP8LinearFunction.apply(xr, wr, state, recipe)
        assert y.shape == (*lead, w.shape[0]) and y._base is None and y.dtype == x_dtype
        assert type(y.grad_fn).__name__ == "FP8LinearFunctionBackward"
        y.mul_(1.0)  # an in-place op on the output: an error if it were a view made inside the Function
        y.backward(g.reshape(*lead, g.shape[1]))
        assert xr.grad.shape == xr.shape
        results.append((y.detach().reshape(64, -1), xr.grad.reshape(64, -1), wr.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_raw_apply_binding_is_the_public_apply_when_torch_has_no_wrapper(monkeypatch):
    """agoq.ops.fp8_linear._bind_apply: torch's own apply where Function.apply is the C++ one; else a
    wrapper that calls the C++ apply (and the public one under a functorch transform)."""
    import agoq.ops.fp8_linear as mod

    c_apply = torch._C._FunctionBase.__dict__["apply"]
    if torch.autograd.Function.__dict__.get("apply") is c_apply:
        assert mod._bind_apply() == FP8LinearFunction.apply
    calls = []

    class _Wrapped(torch.autograd.Function):  # an older torch: a Python apply around the C++ one
        @classmethod
        def apply(cls, *args):
            calls.append(args)
            return super().apply(*args)

    monkeypatch.setattr(mod, "FP8LinearFunction", type("F", (_Wrapped,), dict(mod.FP8LinearFunction.__dict__)))
    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(lambda cls, *a: None), raising=True)
    bound = mod._bind_apply()
    x, w, g = _data()
    x, w = x.requires_grad_(), w.requires_grad_()
    if cpu_scaled_mm_available():
        y = bound(x, w, None, FP8Recipe(), None, None, True, None)
        y.backward(g)
        assert calls == [] and x.grad is not None and w.grad is not None  # the raw C++ apply ran
        monkeypatch.setattr(torch._C, "_are_functorch_transforms_active", lambda: True)
        bound = mod._bind_apply()
        bound(x.detach(), w, None, FP8Recipe(), None, None, True, None)
        assert len(calls) == 1  # under a transform: the public apply
