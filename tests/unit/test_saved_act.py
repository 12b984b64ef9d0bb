"""agoq.ops.saved_act / saved_norm / saved_swiglu: forward unchanged, backward from quantized saves, exact byte
accounting.

SQNR floors for gradients: a gradient computed from a dequantized saved tensor carries that
tensor's relative error through a smooth op (RMSNorm, SwiGLU, a matmul) whose local gain is O(1)
for unit-scale data, so its SQNR sits near the round-trip SQNR of the saved tensor
(``gaussian_floor_db``). GRAD_MARGIN_DB (6 dB: error power 4x) covers that gain (RMSNorm's
projection, silu' up to ~1.1, and the product of two perturbed SwiGLU halves). A backward that
uses the wrong tensor (not dequantized, wrong scale, another micro-batch) lands near 0 dB.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agoq.formats import parse_format
from agoq.ops.saved_act import (
    RecomputeStash,
    SavedBytesCounter,
    default_saved_hooks_active,
    quantized_saves,
)
from agoq.ops.saved_norm import rmsnorm_saving_input
from agoq.ops.saved_swiglu import swiglu_reference, swiglu_saving_input
from agoq.ref.quant import ref_dequantize, ref_quantize
from agoq.testing.numerics import gaussian_floor_db, sqnr_db

GRAD_MARGIN_DB = 6.0
FORMATS = ["int8_b128", "int6_b64", "nf4_b64", "int4_b64"]
EPS = 1e-5


class _LinearLikeMegatron(torch.autograd.Function):
    """The save pattern of Megatron's LinearWithGradAccumulationAndAsyncCommunication."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


def _data(shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_forward_is_bitwise_torch_rmsnorm(dtype):
    x = _data((5, 3, 64), 0, dtype).requires_grad_()
    norm = torch.nn.RMSNorm(64, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _data((64,), 1, dtype))
    y_ref = norm(x)
    y, _ = rmsnorm_saving_input(x, norm.weight, EPS, parse_format("nf4_b64"), (0, "norm.input"))
    assert torch.equal(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_forward_is_bitwise_megatron_glu(dtype):
    h = _data((5, 3, 128), 2, dtype).requires_grad_()
    gate, up = torch.chunk(h, 2, dim=-1)
    z_ref = F.silu(gate) * (up + 0.0)  # megatron/core/transformer/mlp.py glu() with offset 0
    z, _ = swiglu_saving_input(h, parse_format("int4_b64"), (0, "mlp.swiglu_input"))
    assert torch.equal(z, z_ref)


@pytest.mark.parametrize("name", FORMATS)
def test_rmsnorm_backward_is_exact_rmsnorm_backward_at_dequantized_input(name):
    fmt = parse_format(name)
    x = _data((16, 2, 256), 3).requires_grad_()
    w = torch.nn.Parameter(1 + 0.1 * _data((256,), 4))
    g = _data((16, 2, 256), 5)
    counter = SavedBytesCounter()
    y, _ = rmsnorm_saving_input(x, w, EPS, fmt, (7, "norm.input"), counter)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    # oracle 1: autograd of torch's RMSNorm at the dequantized input: the same math, bit for bit
    x_hat = ref_dequantize(ref_quantize(x.detach(), fmt)).requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    gx_hat, gw_hat = torch.autograd.grad(F.rms_norm(x_hat, (256,), w2, EPS), (x_hat, w2), g)
    assert torch.equal(gx, gx_hat) and torch.equal(gw, gw_hat)
    # oracle 2: the exact gradients, within the format's floor
    x_ex = x.detach().clone().requires_grad_()
    w3 = w.detach().clone().requires_grad_()
    gx_ex, gw_ex = torch.autograd.grad(F.rms_norm(x_ex, (256,), w3, EPS), (x_ex, w3), g)
    floor = gaussian_floor_db(fmt) - GRAD_MARGIN_DB
    assert sqnr_db(gx_ex, gx) >= floor and sqnr_db(gw_ex, gw) >= floor
    assert counter.packed == {(7, "norm.input"): fmt.storage_bytes(x.numel())}


@pytest.mark.parametrize("name", FORMATS)
def test_swiglu_backward_within_floor_and_bytes_exact(name):
    fmt = parse_format(name)
    h = _data((16, 2, 256), 6).requires_grad_()
    g = _data((16, 2, 128), 7)
    counter = SavedBytesCounter()
    z, _ = swiglu_saving_input(h, fmt, (3, "mlp.swiglu_input"), counter)
    (gh,) = torch.autograd.grad(z, (h,), g)
    h_ex = h.detach().clone().requires_grad_()
    (gh_ex,) = torch.autograd.grad(swiglu_reference(h_ex), (h_ex,), g)
    assert sqnr_db(gh_ex, gh) >= gaussian_floor_db(fmt) - GRAD_MARGIN_DB
    assert counter.packed == {(3, "mlp.swiglu_input"): fmt.storage_bytes(h.numel())}
    assert counter.live == 0  # the quantized copy is gone after backward


def test_quantized_saves_replaces_only_the_input_and_wgrad_uses_dequantized_input():
    fmt = parse_format("int8_b128")
    x = _data((8, 2, 64), 8).requires_grad_()
    w = torch.nn.Parameter(_data((32, 64), 9))
    g = _data((8, 2, 32), 10)
    counter = SavedBytesCounter()
    with quantized_saves(x, fmt=fmt, key=(0, "attn.proj_input"), counter=counter):
        out = _LinearLikeMegatron.apply(x, w)
    assert torch.equal(out, x.detach() @ w.detach().t())  # forward unchanged
    assert counter.live == fmt.storage_bytes(x.numel())
    gx, gw = torch.autograd.grad(out, (x, w), g)
    x_hat = ref_dequantize(ref_quantize(x.detach(), fmt))
    assert torch.equal(gx, g @ w.detach())  # dgrad needs no activation: exact
    assert torch.equal(gw, g.reshape(-1, 32).t() @ x_hat.reshape(-1, 64))
    assert counter.live == 0 and counter.total() == fmt.storage_bytes(x.numel())


def _norm_feeding_a_linear():
    """(fmt, x, gamma, w, counter, y, stash): an nf4 norm whose output y feeds a 48-wide linear w."""
    fmt = parse_format("nf4_b64")
    x = _data((8, 2, 64), 11).requires_grad_()
    gamma = torch.nn.Parameter(1 + 0.1 * _data((64,), 12))
    w = torch.nn.Parameter(_data((48, 64), 13))
    counter = SavedBytesCounter()
    y, stash = rmsnorm_saving_input(x, gamma, EPS, fmt, (0, "norm.input"), counter)
    return fmt, x, gamma, w, counter, y, stash


def test_norm_then_linear_stores_only_the_quantized_norm_input():
    fmt, x, gamma, w, counter, y, stash = _norm_feeding_a_linear()
    with quantized_saves(y, stash=stash):
        out = _LinearLikeMegatron.apply(y, w)
    assert counter.packed == {(0, "norm.input"): fmt.storage_bytes(x.numel())}  # the linear adds nothing
    g = _data((8, 2, 48), 14)
    gx, gw, ggamma = torch.autograd.grad(out, (x, w, gamma), g)
    x_hat = ref_dequantize(ref_quantize(x.detach(), fmt))
    y_hat = F.rms_norm(x_hat, (64,), gamma.detach(), EPS)
    assert torch.equal(gw, g.reshape(-1, 48).t() @ y_hat.reshape(-1, 64))
    # end to end against exact autograd
    xe, we, ge = (t.detach().clone().requires_grad_() for t in (x, w, gamma))
    ref = torch.autograd.grad(F.rms_norm(xe, (64,), ge, EPS) @ we.t(), (xe, we, ge), g)
    floor = gaussian_floor_db(fmt) - GRAD_MARGIN_DB
    for got, want in zip((gx, gw, ggamma), ref, strict=True):
        assert sqnr_db(want, got) >= floor
    assert counter.live == 0


def test_quantized_saves_refuses_a_foreign_input_and_a_missing_save():
    x = _data((4, 64), 15).requires_grad_()
    gamma = torch.nn.Parameter(torch.ones(64))
    _, stash = rmsnorm_saving_input(x, gamma, EPS, parse_format("int8_b128"), (0, "norm.input"))
    other = x * 2
    with pytest.raises(RuntimeError, match="not the output of the recomputable op"):
        with quantized_saves(other, stash=stash):
            pass
    with pytest.raises(RuntimeError, match="saved it 0 times"):
        with quantized_saves(other, fmt=parse_format("int8_b128")):
            _ = other + 1  # add saves nothing: the input was never saved
    with pytest.raises(ValueError, match="exactly one"):
        with quantized_saves(x):
            pass



def test_default_saved_hooks_active_sees_an_active_scope():
    """The layers take the hook-scope paths inside another saved-tensor hook scope: the query must see one."""
    assert not default_saved_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert default_saved_hooks_active()
    assert not default_saved_hooks_active()


def test_no_grad_forward_stores_nothing():
    counter = SavedBytesCounter()
    x = _data((4, 64), 16)
    with torch.no_grad():
        y, stash = rmsnorm_saving_input(x, torch.ones(64), EPS, parse_format("int8_b128"), (0, "norm.input"),
                                        counter)
        z, stash2 = swiglu_saving_input(x, parse_format("int8_b128"), (0, "mlp.swiglu_input"), counter)
    assert stash is None and stash2 is None and counter.total() == 0
    assert torch.equal(y, F.rms_norm(x, (64,), torch.ones(64), EPS)) and torch.equal(z, swiglu_reference(x))


def test_recompute_stash_consume_releases():
    q = ref_quantize(_data((256,), 17), parse_format("int8_b128"))
    stash = RecomputeStash(q, lambda t: t * 2)
    out = stash.recomputed_output()
    assert torch.equal(out, 2 * ref_dequantize(q))
    stash.consume()
    assert stash.q is None


@pytest.mark.parametrize("how", ["stash", "fmt"])
def test_replaced_input_is_freed_after_the_forward(how):
    """The tensor agoq replaced (here a norm output feeding a linear) must not outlive the forward: torch
    keeps the pack hook alive with every SavedVariable until backward, so the hook must not hold it
    (it did until 2026-11-25: ~3 GiB at the 1B H100 peak, docs/benchmarks/planner.md)."""
    import weakref

    fmt = parse_format("int8_b128")
    x = _data((8, 2, 64), 21).requires_grad_()
    gamma = torch.nn.Parameter(torch.ones(64))
    w = torch.nn.Parameter(_data((48, 64), 22))
    y, stash = rmsnorm_saving_input(x, gamma, EPS, fmt, (0, "norm.input"))
    kw = {"stash": stash} if how == "stash" else {"fmt": fmt}
    with quantized_saves(y, **kw):
        out = _LinearLikeMegatron.apply(y, w)
    alive = weakref.ref(y)
    del y
    assert alive() is None, "the replaced input is still referenced after the forward"
    out.sum().backward()  # and backward still works from the stash / the quantized copy
    assert w.grad is not None and x.grad is not None


@pytest.mark.parametrize("prepared", [True, False])
def test_eager_under_compile_runs_its_function_eagerly(prepared):
    """agoq's compile boundary: the wrapped function runs eagerly between graphs (never traced), prepared at
    import (agoq.megatron.layers) or built on its first call inside the compiled region."""
    from agoq.ops.saved_act import eager_under_compile

    compiling_inside = []

    def side(x):
        compiling_inside.append(torch.compiler.is_compiling())
        return x + 1

    boundary = eager_under_compile(side, "test boundary")
    if prepared:
        boundary.prepare()

    def f(x):
        y = x * 2
        y = boundary(y) if torch.compiler.is_compiling() else side(y)
        return y.sin()

    torch._dynamo.reset()
    x = torch.randn(4)
    assert torch.equal(torch.compile(f, backend="eager")(x), f(x))
    assert compiling_inside and not any(compiling_inside)


def test_importing_agoq_ops_does_not_import_dynamo():
    """The compile boundaries are built lazily (agoq.ops.saved_act.eager_under_compile): torch._dynamo costs
    ~1.5 s of import, which agoq.ops alone does not pay."""
    import subprocess
    import sys

    code = ("import sys; import agoq.ops.saved_norm, agoq.ops.saved_swiglu, agoq.ops.custom_ops; "
            "assert 'torch._dynamo' not in sys.modules, 'agoq.ops imported torch._dynamo'")
    subprocess.run([sys.executable, "-c", code], check=True)
