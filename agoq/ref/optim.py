"""Reference optimizer steps over quantized state: dequantize -> fp32 update -> requantize.

The executable spec of agoq.kernels.optim (same signatures, same values bit for bit). One call
updates one tensor in place:

    param    the model parameter (bf16 / fp16 / fp32), updated in place
    grad     its gradient (any float dtype; read as fp32)
    master   None            param is its own master (fp32 param, or a plain 16-bit update)
             fp32 tensor     a separate fp32 master copy; param = RNE(master) after the step
             int8 / int16    FlashOptim remainder rho ("split24" / "split32", agoq.ref.master)
    states   agoq.ref.quant.QuantizedTensor of any agoq format (fp32 / bf16 / cint8_b32 /
             cuint8_b32 / fp8e4m3_b128 / int4_b32 ...), updated in place (codes and scales)

Update math (FlashOptim, arXiv 2602.23349, Alg. 4 / App. A; torch.optim.AdamW / SGD): every
line is one IEEE fp32 operation per element (no fused multiply-add), in exactly this order, so the
Triton kernel can reproduce it. Scalars are rounded to fp32 once, in :func:`adamw_scalars` etc.

    AdamW  m = m*b1 + g*(1-b1);  v = v*b2 + (g*g)*(1-b2);  theta = theta*(1-lr*wd)
           theta = theta - (m / (sqrt(v) + eps*sqrt(1-b2**t))) * (lr*sqrt(1-b2**t) / (1-b1**t))
           (Kingma & Ba 2015, Alg. 1's "more efficient" ordering: the bias corrections folded into the
           two scalars, one division per element instead of torch's two; equal to torch.optim.AdamW's
           m_hat / (sqrt(v_hat) + eps) up to fp32 rounding, see tests/unit/test_optim_ref.py)
    Lion   c = m*b1 + g*(1-b1);  m = m*b2 + g*(1-b2);  theta = theta*(1-lr*wd) - sign(c)*lr
    SGD    g = g + theta*wd;  buf = buf*mu + g;  d = g + buf*mu (nesterov) or buf;  theta -= d*lr
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from agoq.ref.master import MASTER_NS, ref_master_merge, ref_master_split
from agoq.ref.quant import QuantizedTensor, ref_dequantize, ref_quantize, sqrt_rn

__all__ = [
    "AdamWScalars",
    "LionScalars",
    "SGDScalars",
    "adamw_scalars",
    "lion_scalars",
    "sgd_scalars",
    "ref_adamw_step",
    "ref_lion_step",
    "ref_sgd_step",
    "load_master",
    "store_master",
]


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 (RNE), as the kernels receive their scalars."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class AdamWScalars:
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps_scaled: float  # eps * sqrt(1 - beta2**step): eps added to sqrt(v) before its bias correction
    decay: float  # 1 - lr * weight_decay (decoupled)
    step_size: float  # lr * sqrt(1 - beta2**step) / (1 - beta1**step): both bias corrections


@dataclass(frozen=True)
class LionScalars:
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    decay: float
    lr: float


@dataclass(frozen=True)
class SGDScalars:
    momentum: float
    weight_decay: float  # coupled, as torch.optim.SGD
    lr: float


def adamw_scalars(*, lr, beta1, beta2, eps, weight_decay, step) -> AdamWScalars:
    if step < 1:
        raise ValueError(f"AdamW step count must be >= 1 (bias correction), got {step}")
    return AdamWScalars(
        beta1=f32(beta1),
        one_minus_beta1=f32(1.0 - beta1),
        beta2=f32(beta2),
        one_minus_beta2=f32(1.0 - beta2),
        eps_scaled=f32(eps * math.sqrt(1.0 - beta2**step)),
        decay=f32(1.0 - lr * weight_decay),
        step_size=f32(lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)),
    )


def lion_scalars(*, lr, beta1, beta2, weight_decay) -> LionScalars:
    return LionScalars(
        beta1=f32(beta1),
        one_minus_beta1=f32(1.0 - beta1),
        beta2=f32(beta2),
        one_minus_beta2=f32(1.0 - beta2),
        decay=f32(1.0 - lr * weight_decay),
        lr=f32(lr),
    )


def sgd_scalars(*, lr, momentum, weight_decay) -> SGDScalars:
    return SGDScalars(momentum=f32(momentum), weight_decay=f32(weight_decay), lr=f32(lr))


def check_pair(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor | None) -> None:
    if not param.is_contiguous() or grad.numel() != param.numel():
        raise ValueError(
            f"param must be contiguous with grad of the same numel (param {tuple(param.shape)}, "
            f"grad {tuple(grad.shape)}); call .contiguous() on both"
        )
    if master is not None:
        if master.numel() != param.numel():
            raise ValueError(f"master numel {master.numel()} != param numel {param.numel()}")
        if master.dtype not in MASTER_NS and master.dtype != torch.float32:
            raise ValueError(f"master must be fp32, int8 or int16, got {master.dtype}")
        if master.dtype in MASTER_NS and param.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"a split master (int8/int16) needs a bf16/fp16 param, got {param.dtype}")


def load_master(param: torch.Tensor, master: torch.Tensor | None) -> torch.Tensor:
    """The fp32 master value of param (flat)."""
    if master is None:
        return param.reshape(-1).to(torch.float32)
    if master.dtype == torch.float32:
        return master.reshape(-1).clone()
    return ref_master_merge(param.reshape(-1), master.reshape(-1))


def store_master(theta_f32: torch.Tensor, param: torch.Tensor, master: torch.Tensor | None) -> None:
    """Write an fp32 master value back: param = RNE(theta) and the master / remainder."""
    flat = param.view(-1)
    if master is None:
        flat.copy_(theta_f32.to(param.dtype))
    elif master.dtype == torch.float32:
        master.view(-1).copy_(theta_f32)
        flat.copy_(theta_f32.to(param.dtype))
    else:
        narrow, rho = ref_master_split(theta_f32, param.dtype, master.dtype)
        flat.copy_(narrow)
        master.view(-1).copy_(rho)


def load_state(q: QuantizedTensor) -> torch.Tensor:
    return ref_dequantize(q, torch.float32).reshape(-1)


def store_state(q: QuantizedTensor, x_f32: torch.Tensor) -> None:
    new = ref_quantize(x_f32.view(q.shape), q.fmt)
    q.codes.copy_(new.codes)
    q.scales.copy_(new.scales)


def ref_adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: QuantizedTensor,
    exp_avg_sq: QuantizedTensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW step (decoupled weight decay) of one tensor, in place."""
    check_pair(param, grad, master)
    s = adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    g = grad.reshape(-1).to(torch.float32)
    theta = load_master(param, master)
    m = load_state(exp_avg) * s.beta1 + g * s.one_minus_beta1
    v = load_state(exp_avg_sq) * s.beta2 + (g * g) * s.one_minus_beta2
    theta = theta * s.decay
    theta = theta - (m / (sqrt_rn(v) + s.eps_scaled)) * s.step_size
    store_state(exp_avg, m)
    store_state(exp_avg_sq, v)
    store_master(theta, param, master)


def ref_lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: QuantizedTensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion step (Chen et al. 2023, arXiv 2302.06675; decoupled decay) of one tensor, in place."""
    check_pair(param, grad, master)
    s = lion_scalars(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    g = grad.reshape(-1).to(torch.float32)
    theta = load_master(param, master)
    m = load_state(exp_avg)
    c = m * s.beta1 + g * s.one_minus_beta1
    m = m * s.beta2 + g * s.one_minus_beta2
    theta = theta * s.decay - torch.sign(c) * s.lr
    store_state(exp_avg, m)
    store_master(theta, param, master)


def ref_sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    momentum_buffer: QuantizedTensor | None,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
) -> None:
    """One SGD step (torch.optim.SGD semantics, dampening 0; buffer None iff momentum == 0)."""
    check_pair(param, grad, master)
    if (momentum_buffer is None) != (momentum == 0.0):
        raise ValueError("pass a momentum_buffer exactly when momentum != 0")
    s = sgd_scalars(lr=lr, momentum=momentum, weight_decay=weight_decay)
    g = grad.reshape(-1).to(torch.float32)
    theta = load_master(param, master)
    if weight_decay != 0.0:
        g = g + theta * s.weight_decay
    if momentum_buffer is not None:
        buf = load_state(momentum_buffer) * s.momentum + g
        g = g + buf * s.momentum if nesterov else buf
        store_state(momentum_buffer, buf)
    theta = theta - g * s.lr
    store_master(theta, param, master)
