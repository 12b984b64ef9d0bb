"""agoq.kernels.optim_multi (one launch, many tensors) vs agoq.ref.optim per tensor: bit-identical
params, remainders and state codes / scales, for tensors of odd sizes, tails, zero size, views into one
flat buffer (DDP-like, unaligned offsets) and separate allocations.

CPU: ``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_optim_multi.py`` (own process).
"""

import copy
import os

import pytest
import torch

from agoq.ref import optim as ref
from agoq.ref.quant import ref_quantize

pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# odd sizes: one element, a tail group, zero size, exactly one program, more than one program with a tail
SIZES = [1, 7 * 33, 0, 512, 2048 + 5, 64, 3]
HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _kernels():
    from agoq.kernels import optim, optim_multi  # late import: TRITON_INTERPRET is read when Triton jits

    return optim, optim_multi


def _q(x, fmt):
    q = ref_quantize(x, fmt, seed=0)
    q.codes, q.scales = q.codes.to(DEVICE), q.scales.to(DEVICE)
    return q


def _tensors(sizes, param_dtype, master_dtype, m_fmt, v_fmt, *, flat_views: bool, seed=0):
    """Per tensor: [param, grad, master, m, v]; flat_views puts params, grads and masters in one buffer
    each at element offsets that are not multiples of 16 bytes (as views of a DDP buffer can be)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + 3 * len(sizes)

    def storage(dtype):
        return torch.zeros(total + 8, dtype=dtype, device=DEVICE)

    bufs = {"p": storage(param_dtype), "g": storage(torch.bfloat16), "m": storage(master_dtype or torch.float32)}
    out, at = [], 1
    for n in sizes:
        theta = torch.randn(n, generator=gen)
        vals = {"p": theta.to(param_dtype), "g": torch.randn(n, generator=gen).to(torch.bfloat16)}
        if master_dtype == torch.float32:
            vals["m"] = theta.clone()
        elif master_dtype is not None:
            vals["m"] = torch.randint(-100, 101, (n,), generator=gen).to(master_dtype)
        ts = {}
        for key, v in vals.items():
            if flat_views:
                ts[key] = bufs[key][at : at + n]
                ts[key].copy_(v.to(DEVICE))
            else:
                ts[key] = v.to(DEVICE)
        at += n + 3
        m = _q(torch.randn(n, generator=gen) * 0.1, m_fmt)
        v = _q(torch.rand(n, generator=gen) * 0.01, v_fmt) if v_fmt else None
        out.append([ts["p"], ts["g"], ts.get("m"), m, v])
    return out


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if x is None:
            assert y is None
        elif isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(x.codes, y.codes)
            assert torch.equal(x.scales.view(torch.uint8), y.scales.view(torch.uint8))


def _deep(tensors):
    """Copies that keep the flat-buffer layout: clone each buffer once, re-view it."""
    memo = {}
    return copy.deepcopy(tensors, memo)


@pytest.mark.parametrize("flat_views", [True, False])
@pytest.mark.parametrize(
    "param_dtype,master_dtype,m_fmt,v_fmt",
    [
        (torch.bfloat16, torch.int8, "cint8_b32", "cuint8_b32"),  # FlashAdamW
        (torch.bfloat16, torch.int16, "fp32", "fp32"),  # small-tensor rule: fp32 states, split32
        (torch.float16, torch.int8, "nf4_b32", "cuint8_b32"),
        (torch.bfloat16, torch.float32, "bf16", "bf16"),
        (torch.float32, None, "int8_b64_sp2", "fp32"),
    ],
)
def test_multi_adamw_equals_ref(flat_views, param_dtype, master_dtype, m_fmt, v_fmt):
    ko, km = _kernels()
    a = _tensors(SIZES, param_dtype, master_dtype, m_fmt, v_fmt, flat_views=flat_views)
    b = _deep(a)
    launch = km.MultiTensorLaunch.build(*[[t[i] for t in b] for i in range(5)])
    assert launch.num_tensors == len([n for n in SIZES if n])
    for step in (1, 2):
        for p, g, mst, m, v in a:
            ref.ref_adamw_step(p, g, mst, m, v, **HP, step=step)
        launch.run("adamw", ko.adamw_scalar_args(**HP, step=step))
    for x, y in zip(a, b, strict=True):
        _assert_same([x[0], x[2], x[3], x[4]], [y[0], y[2], y[3], y[4]])


@pytest.mark.parametrize("which", ["lion", "sgd_nesterov", "sgd_plain"])
def test_multi_lion_sgd_equals_ref(which):
    ko, km = _kernels()
    m_fmt = None if which == "sgd_plain" else "cint8_b32"
    a = _tensors(SIZES, torch.bfloat16, torch.int8, m_fmt or "fp32", None, flat_views=True)
    if m_fmt is None:
        for t in a:
            t[3] = None
    b = _deep(a)
    launch = km.MultiTensorLaunch.build(*[[t[i] for t in b] for i in range(4)], None)
    for _ in range(2):
        if which == "lion":
            hp = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
            for p, g, mst, m, _v in a:
                ref.ref_lion_step(p, g, mst, m, **hp)
            launch.run("lion", ko.lion_scalar_args(**hp))
        else:
            hp = dict(lr=0.05, momentum=0.0 if m_fmt is None else 0.9, weight_decay=0.01)
            nesterov = which == "sgd_nesterov"
            for p, g, mst, m, _v in a:
                ref.ref_sgd_step(p, g, mst, m, **hp, nesterov=nesterov)
            launch.run("sgd", ko.sgd_scalar_args(**hp), has_wd=True, nesterov=nesterov)
    for x, y in zip(a, b, strict=True):
        _assert_same([x[0], x[2], x[3]], [y[0], y[2], y[3]])


def test_multi_rejects_mixed_formats_and_dtypes():
    _, km = _kernels()
    a = _tensors([64, 64], torch.bfloat16, torch.int8, "cint8_b32", "cuint8_b32", flat_views=False)
    b = _tensors([64], torch.bfloat16, torch.int8, "fp32", "fp32", flat_views=False)
    mixed = a + b
    with pytest.raises(km.OperandError, match="state formats"):
        km.MultiTensorLaunch.build(*[[t[i] for t in mixed] for i in range(5)])
    a[1][1] = a[1][1].float()
    with pytest.raises(km.OperandError, match="mixed dtypes"):
        km.MultiTensorLaunch.build(*[[t[i] for t in a] for i in range(5)])


def _model():
    torch.manual_seed(0)
    # matrices >= small_numel (FlashOptim states), a small matrix and 1-D params (fp32 states, split32)
    return (
        torch.nn.Sequential(
            torch.nn.Linear(96, 80), torch.nn.LayerNorm(80), torch.nn.Linear(80, 72), torch.nn.Linear(72, 8)
        )
        .to(torch.bfloat16)
        .to(DEVICE)
    )


def _groups(model):
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd"])
def test_optimizer_multi_equals_per_tensor_and_ref(name):
    """Optimizer classes: multi-tensor launches == per-tensor launches == reference, over 4 steps with
    two param groups, a param without a gradient at step 2 (its step count falls behind: separate
    bucket afterwards), grads re-allocated each step and a state_dict round trip at step 3."""
    from agoq.optim import SGD, AdamW, Lion

    cls, hp = {"adamw": (AdamW, dict(lr=1e-2)), "lion": (Lion, dict(lr=1e-3)),
               "sgd": (SGD, dict(lr=1e-2, momentum=0.9, nesterov=True))}[name]  # fmt: skip
    runs = []
    for fused, multi in ((False, False), (True, False), (True, True)):
        model = _model()
        opt = cls(_groups(model), fused=fused, multi_tensor=multi, **hp)
        gen = torch.Generator().manual_seed(1)
        for it in range(4):
            x = torch.randn(5, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
            opt.zero_grad(set_to_none=True)
            model(x).float().pow(2).mean().backward()
            if it == 1:
                model[2].bias.grad = None
            if it == 2:
                sd = copy.deepcopy(opt.state_dict())
                opt.load_state_dict(sd)
            opt.step()
        runs.append((model, opt))
    (m0, o0) = runs[0]
    for m1, o1 in runs[1:]:
        for p, q in zip(m0.parameters(), m1.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
            for k, v in o0.state[p].items():
                w = o1.state[q][k]
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v.view(torch.uint8) if v.ndim else v, w.view(torch.uint8) if w.ndim else w), k
    plan_steps = {float(o1.state[q]["step"]) for q in m1.parameters()}
    assert plan_steps == {3.0, 4.0}  # model[2].bias skipped one step
    assert len(runs[2][1]._plans) == 2


def test_non_contiguous_grad_falls_back_per_tensor_and_says_so(caplog):
    """Non-contiguous gradients (the matrices') are stepped by the per-tensor kernel (logged once), the 1-D
    params by one launch; the result equals the reference step."""
    from agoq.optim import AdamW, multi

    multi._LOGGED.discard("non-contiguous gradients (they would be copied each step)")
    runs = []
    for fused in (False, True):
        model = _model()
        opt = AdamW(_groups(model), fused=fused, lr=1e-2)
        gen = torch.Generator().manual_seed(2)
        for p in model.parameters():
            g = torch.randn(tuple(reversed(p.shape)), generator=gen).to(torch.bfloat16).to(DEVICE)
            p.grad = g.t() if p.ndim == 2 else g
        assert not model[0].weight.grad.is_contiguous()
        with caplog.at_level("WARNING", logger="agoq.optim"):
            opt.step()
        runs.append((model, opt))
    assert "per-tensor fused step for non-contiguous gradients" in caplog.text
    plan = runs[1][1]._plans[0]
    assert len(plan.per_tensor) == 3 and len(plan.launches) == 0  # every matrix grad is a transposed view
    assert len(runs[1][1]._plans[1].launches) == 1 and not runs[1][1]._plans[1].per_tensor
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize(
    "master_dtype,m_fmt,v_fmt,shape",
    [
        (torch.int8, "cint8_b32", "cuint8_b32", "SHAPE_DEFAULT"),  # FlashAdamW
        (torch.int8, "fp8e4m3_b128", "fp8e5m2_b128", "SHAPE_DEFAULT"),
        (torch.int16, "cint8_b32", "cuint8_b32", "SHAPE_NF4_OR_SPLIT32"),  # split32: a division per element
        (torch.int8, "nf4_b32", "cuint8_b32", "SHAPE_NF4_OR_SPLIT32"),  # NF4: the midpoint search
        (torch.float32, "fp32", "fp32", "SHAPE_FP32_STATES"),
        (torch.int8, "bf16", "bf16", "SHAPE_DEFAULT"),
    ],
)
def test_launch_shape_per_format(master_dtype, m_fmt, v_fmt, shape):
    """The per-format launch shape table (docs/benchmarks/log.md "Device time"); the sweep's override wins."""
    _, km = _kernels()
    b = _tensors([64, 96], torch.bfloat16, master_dtype, m_fmt, v_fmt, flat_views=False)
    launch = km.MultiTensorLaunch.build(*[[t[i] for t in b] for i in range(5)])
    assert km.launch_shape(launch.constexprs) == getattr(km, shape)
    previous, km.LAUNCH_OVERRIDE = km.LAUNCH_OVERRIDE, (4, None)
    try:
        assert km.launch_shape(launch.constexprs) == (4, None)
    finally:
        km.LAUNCH_OVERRIDE = previous
