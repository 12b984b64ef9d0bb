"""AdamW, Lion and SGD over agoq state formats (see agoq.optim.base for the options and layout)."""

from __future__ import annotations

from agoq.optim.base import QuantizedOptimizer
from agoq.ref import optim as ref_optim

# FlashOptim defaults (arXiv 2602.23349): companded int8 m, sqrt-companded uint8 v, groups of 32
FLASH_M = "cint8_b32"
FLASH_V = "cuint8_b32"


def _kernels():
    from agoq.kernels import optim  # Triton imported only when a fused step runs

    return optim


class AdamW(QuantizedOptimizer):
    """AdamW (decoupled decay) with quantized m / v and a split master.

    Defaults: m cint8_b32, v cuint8_b32, master split24 (FlashAdamW: 5.125 B/param + grads).
    """

    STATE_NAMES = ("exp_avg", "exp_avg_sq")
    DEFAULT_FORMATS = {"exp_avg": FLASH_M, "exp_avg_sq": FLASH_V}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **options):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyperparameters lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **options))

    def _update(self, p, grad, master, states, group, step) -> None:
        fn = _kernels().adamw_step if group["fused"] else ref_optim.ref_adamw_step
        b1, b2 = group["betas"]
        fn(p, grad, master, states["exp_avg"], states["exp_avg_sq"], lr=group["lr"], beta1=b1, beta2=b2,
           eps=group["eps"], weight_decay=group["weight_decay"], step=step)  # fmt: skip

    def kernel_args(self, group, step):
        b1, b2 = group["betas"]
        return "adamw", _kernels().adamw_scalar_args(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                                                     weight_decay=group["weight_decay"], step=step), {}  # fmt: skip


class Lion(QuantizedOptimizer):
    """Lion (Chen et al. 2023) with a quantized momentum (FlashLion: cint8_b32)."""

    STATE_NAMES = ("exp_avg",)
    DEFAULT_FORMATS = {"exp_avg": FLASH_M}

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **options):
        if lr < 0 or not (0 <= betas[0] <= 1 and 0 <= betas[1] <= 1):
            raise ValueError(f"invalid Lion hyperparameters lr={lr}, betas={betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, **options))

    def _update(self, p, grad, master, states, group, step) -> None:
        fn = _kernels().lion_step if group["fused"] else ref_optim.ref_lion_step
        b1, b2 = group["betas"]
        fn(p, grad, master, states["exp_avg"], lr=group["lr"], beta1=b1, beta2=b2,
           weight_decay=group["weight_decay"])  # fmt: skip

    def kernel_args(self, group, step):
        b1, b2 = group["betas"]
        return "lion", _kernels().lion_scalar_args(lr=group["lr"], beta1=b1, beta2=b2,
                                                   weight_decay=group["weight_decay"]), {}  # fmt: skip


class SGD(QuantizedOptimizer):
    """SGD with (Nesterov) momentum, torch.optim.SGD semantics with dampening 0; the momentum buffer is
    quantized (FlashSGD: cint8_b32). momentum=0 keeps no state."""

    STATE_NAMES = ("momentum_buffer",)
    DEFAULT_FORMATS = {"momentum_buffer": FLASH_M}

    def __init__(self, params, lr=1e-2, momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0, **options):
        if dampening != 0.0:
            raise NotImplementedError("SGD dampening != 0 is not supported; use dampening=0")
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum requires momentum > 0")
        super().__init__(
            params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, **options)
        )

    def active_states(self, group: dict) -> tuple[str, ...]:
        return self.STATE_NAMES if group["momentum"] != 0.0 else ()

    def _update(self, p, grad, master, states, group, step) -> None:
        fn = _kernels().sgd_step if group["fused"] else ref_optim.ref_sgd_step
        fn(p, grad, master, states.get("momentum_buffer"), lr=group["lr"], momentum=group["momentum"],
           weight_decay=group["weight_decay"], nesterov=group["nesterov"])  # fmt: skip

    def kernel_args(self, group, step):
        scalars = _kernels().sgd_scalar_args(lr=group["lr"], momentum=group["momentum"],
                                             weight_decay=group["weight_decay"])  # fmt: skip
        return "sgd", scalars, dict(has_wd=group["weight_decay"] != 0.0, nesterov=group["nesterov"])
