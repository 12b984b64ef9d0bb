"""agoq.kernels.optim vs agoq.ref.optim: bit-identical params, remainders and state codes/scales.

CPU: ``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_optim_kernels.py`` (own process).
GPU: ``python -m pytest tests/kernels/test_optim_kernels.py`` (adds fp8 states and a large tensor).
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
FP8_GPU = pytest.mark.gpu(reason="interpreter fp8 cast does not round ties to even (Triton 3.8)")

# (m format, v format): FlashOptim, full precision, bf16, 4-bit m, pow2/fp32 scales, fp8 (GPU)
STATE_FORMATS = [
    ("cint8_b32", "cuint8_b32"),
    ("fp32", "fp32"),
    ("bf16", "bf16"),
    ("nf4_b32", "cuint8_b32"),
    ("int8_b64_sp2", "fp32"),
    pytest.param("fp8e4m3_b128", "fp8e5m2_b128", marks=FP8_GPU),
]
# (param dtype, master): none, split24, split32, fp32 master, fp16 split, fp32 param
MASTERS = [
    (torch.bfloat16, None),
    (torch.bfloat16, torch.int8),
    (torch.bfloat16, torch.int16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.int8),
    (torch.float32, None),
]
SHAPES = [(1,), (7, 33), (2048 + 5,)]  # single element, tail group, more than one program


def _kernels():
    from agoq.kernels import optim  # late import: TRITON_INTERPRET is read when Triton jits

    return optim


def _setup(shape, param_dtype, master_dtype, m_fmt, v_fmt, seed=0):
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(shape, generator=gen)
    param = theta.to(param_dtype)
    if master_dtype is None:
        master = None
    elif master_dtype == torch.float32:
        master = theta.clone()
    else:
        master = torch.randint(-100, 101, shape, generator=gen).to(master_dtype)
    m = ref_quantize(torch.randn(shape, generator=gen) * 0.1, m_fmt, seed=0)
    v = ref_quantize(torch.rand(shape, generator=gen) * 0.01, v_fmt, seed=0) if v_fmt else None
    tensors = [param, master, m, v]
    return [_to(t) for t in tensors]


def _to(t):
    if t is None or isinstance(t, torch.Tensor):
        return None if t is None else t.to(DEVICE)
    t = copy.deepcopy(t)
    t.codes, t.scales = t.codes.to(DEVICE), t.scales.to(DEVICE)
    return t


def _assert_same(a, b):
    for x, y in zip(a, b, strict=False):
        if x is None:
            assert y is None
        elif isinstance(x, torch.Tensor):
            # exact (rtol = atol = 0); NaN bit patterns differ between PyTorch's own CPU cast paths
            # (0xFFFF vectorised, 0x7FC0 scalar), so NaNs are compared as NaNs
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(x.codes, y.codes)
            _assert_same_bits_nan_as_nan(x.scales, y.scales)


def _assert_same_bits_nan_as_nan(x: torch.Tensor, y: torch.Tensor) -> None:
    """Bit-identical (so -0.0 != 0.0), except that any NaN equals any NaN: the GPU kernel writes the
    canonical NaN where the CPU reference's cast may keep a sign or payload (seen on H100: fp16 scale)."""
    if not x.is_floating_point():
        assert torch.equal(x, y)
        return
    nan_x, nan_y = torch.isnan(x.float()), torch.isnan(y.float())
    assert torch.equal(nan_x, nan_y)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    assert torch.equal(x.view(bits)[~nan_x], y.view(bits)[~nan_y])


def _grads(shape, steps=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen)).to(torch.bfloat16).to(DEVICE) for _ in range(steps)]


@pytest.mark.parametrize("m_fmt,v_fmt", STATE_FORMATS)
@pytest.mark.parametrize("param_dtype,master_dtype", MASTERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_adamw_equals_ref(m_fmt, v_fmt, param_dtype, master_dtype, shape):
    k = _kernels()
    a = _setup(shape, param_dtype, master_dtype, m_fmt, v_fmt)
    b = [copy.deepcopy(x) for x in a]
    for t, g in enumerate(_grads(shape), start=1):
        hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=t)
        ref.ref_adamw_step(a[0], g, a[1], a[2], a[3], **hp)
        k.adamw_step(b[0], g, b[1], b[2], b[3], **hp)
    _assert_same(a, b)


@pytest.mark.parametrize("m_fmt", ["cint8_b32", "fp32", "nf4_b64"])
@pytest.mark.parametrize("param_dtype,master_dtype", MASTERS[:3] + MASTERS[5:])
def test_fused_lion_equals_ref(m_fmt, param_dtype, master_dtype):
    k = _kernels()
    a = _setup((7, 33), param_dtype, master_dtype, m_fmt, None)
    b = [copy.deepcopy(x) for x in a]
    for g in _grads((7, 33)):
        hp = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
        ref.ref_lion_step(a[0], g, a[1], a[2], **hp)
        k.lion_step(b[0], g, b[1], b[2], **hp)
    _assert_same(a, b)


@pytest.mark.parametrize("momentum,nesterov,weight_decay", [(0.0, False, 0.0), (0.9, False, 0.01), (0.9, True, 0.0)])
@pytest.mark.parametrize("param_dtype,master_dtype", MASTERS[1:3] + MASTERS[5:])
def test_fused_sgd_equals_ref(momentum, nesterov, weight_decay, param_dtype, master_dtype):
    k = _kernels()
    a = _setup((7, 33), param_dtype, master_dtype, "cint8_b32", None)
    if momentum == 0.0:
        a[2] = None
    b = [copy.deepcopy(x) for x in a]
    for g in _grads((7, 33)):
        hp = dict(lr=0.05, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        ref.ref_sgd_step(a[0], g, a[1], a[2], **hp)
        k.sgd_step(b[0], g, b[1], b[2], **hp)
    _assert_same(a, b)


def test_fused_non_finite_grad_poisons_group_like_ref():
    k = _kernels()
    a = _setup((100,), torch.bfloat16, torch.int8, "cint8_b32", "cuint8_b32")
    b = [copy.deepcopy(x) for x in a]
    g = torch.randn(100).to(DEVICE)
    g[40] = float("nan")
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    ref.ref_adamw_step(a[0], g, a[1], a[2], a[3], **hp)
    k.adamw_step(b[0], g, b[1], b[2], b[3], **hp)
    _assert_same(a, b)
    assert torch.isnan(a[2].scales[1].float())  # group 1 (elements 32..63) holds the NaN


def test_fused_rejects_mixed_blocks_and_stochastic_formats():
    k = _kernels()
    a = _setup((64,), torch.bfloat16, torch.int8, "cint8_b32", "int8_b64")
    with pytest.raises(NotImplementedError, match="one block size"):
        k.adamw_step(a[0], a[0].float(), a[1], a[2], a[3], lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8,
                     weight_decay=0.0, step=1)  # fmt: skip
    a = _setup((64,), torch.bfloat16, torch.int8, "cint8_b32_sr", "cuint8_b32")
    with pytest.raises(NotImplementedError, match="stochastic"):
        k.adamw_step(a[0], a[0].float(), a[1], a[2], a[3], lr=1e-3, beta1=0.9, beta2=0.9, eps=1e-8,
                     weight_decay=0.0, step=1)  # fmt: skip


@pytest.mark.gpu
def test_fused_adamw_equals_ref_large_gpu():
    k = _kernels()
    shape = (4096, 1027)
    a = _setup(shape, torch.bfloat16, torch.int8, "cint8_b32", "cuint8_b32")
    b = [copy.deepcopy(x) for x in a]
    g = _grads(shape, steps=1)[0]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
    ref.ref_adamw_step(a[0], g, a[1], a[2], a[3], **hp)
    k.adamw_step(b[0], g, b[1], b[2], b[3], **hp)
    _assert_same(a, b)


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd"])
def test_optimizer_class_fused_equals_unfused(name):
    """agoq.optim classes: fused=True (Triton) and fused=False (ref) give identical models and states."""
    from agoq.optim import SGD, AdamW, Lion

    make = {
        "adamw": lambda ps, f: AdamW(ps, lr=1e-2, weight_decay=0.1, fused=f),
        "lion": lambda ps, f: Lion(ps, lr=1e-3, weight_decay=0.1, fused=f),
        "sgd": lambda ps, f: SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, fused=f),
    }[name]
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 8)).to(torch.bfloat16).to(DEVICE)
        opt = make(model.parameters(), fused)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
        runs.append((model, opt))
    (m0, o0), (m1, o1) = runs
    for p, q in zip(m0.parameters(), m1.parameters(), strict=False):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        for k, v in o0.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(
                    v.view(torch.uint8) if v.ndim else v, o1.state[q][k].view(torch.uint8) if v.ndim else o1.state[q][k]
                )


# bf16 subnormal theta' is left out: the Triton 3.8 interpreter's bf16 -> fp32 cast gets those wrong
SPLIT_TIE_CASES = [
    (torch.float16, torch.int16, -27, -24),
    (torch.float16, torch.int8, -27, -24),
    (torch.float16, torch.int16, -24, -14),
    (torch.bfloat16, torch.int16, -3, 3),
    (torch.bfloat16, torch.int8, -126, -120),
]


@pytest.mark.parametrize("narrow_dtype,rho_dtype,lo,hi", SPLIT_TIE_CASES)
def test_fused_split_rounds_rho_like_ref_on_ties(narrow_dtype, rho_dtype, lo, hi):
    """Issue 21: rho = round_half_away(e * N) of the exact product (reference: fp64; kernel: fp32 with the
    exact Fast2Sum residual, _rho_exact). Masters whose e * N lies within 2 fp32 ulps of a .5 tie, written by
    one SGD step from theta = 0 with lr = 1 (theta_new = -g exactly)."""
    from agoq.ref.master import ref_master_split
    from agoq.testing.numerics import split_tie_inputs

    k = _kernels()
    target = split_tie_inputs(narrow_dtype, 32767 if rho_dtype == torch.int16 else 127, lo, hi, count=1024)
    a = [torch.zeros(target.shape, dtype=narrow_dtype, device=DEVICE)]
    a.append(torch.zeros(target.shape, dtype=rho_dtype, device=DEVICE))
    b = [x.clone() for x in a]
    hp = dict(lr=1.0, momentum=0.0, weight_decay=0.0, nesterov=False)
    ref.ref_sgd_step(a[0], -target.to(DEVICE), a[1], None, **hp)
    k.sgd_step(b[0], -target.to(DEVICE), b[1], None, **hp)
    _assert_same(a, b)
    narrow, rho = ref_master_split(target, narrow_dtype, rho_dtype)
    assert torch.equal(a[0].cpu(), narrow) and torch.equal(a[1].cpu(), rho)
