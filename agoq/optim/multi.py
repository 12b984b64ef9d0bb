"""Multi-tensor step plans: the host side of agoq.kernels.optim_multi for QuantizedOptimizer.step().

A fused param group (``fused=True``, ``multi_tensor=True``, the defaults for fused) is stepped by one
kernel launch per *bucket*: the group's params that have a gradient, split by (device, param dtype,
grad dtype, state formats + master), e.g. Megatron's decay / no-decay groups give 2-3 launches per
step (matrices with FlashOptim states; small tensors with fp32 states and split32 masters).

The plan (tables of offsets, bases) is cached per param group and rebuilt only when the set of params
with gradients, any param or grad address, a state dict or any object in it changes (load_state_dict,
Megatron's checkpoint loads, a new grad allocation after zero_grad(set_to_none=True) at a different
address); the check is one identity comparison per state entry, so a state tensor replaced in place of
another is noticed. Re-pointing a state tensor's storage (``t.set_(...)``) is not: call
``optimizer.drop_plans()`` after doing that.

Step counts: each param's state["step"] stays a 0-dim fp32 CPU tensor (Megatron and checkpoints read it),
but inside a plan they are views of one CPU buffer, so a step costs one add and one min/max instead of
two tensor ops per param; the AdamW bias correction is computed once per bucket on the host (no device
sync, no per-tensor Python). Buckets are also split by step count, so params whose counts differ (a param
that had no gradient for some steps) get their own launch.

Per-tensor fallbacks (logged once per reason, agoq.optim logger): a bucket whose operands cannot share
a launch (mixed dtypes inside one operand, misaligned views, >2**31 programs), non-contiguous grads,
and all non-fused groups. Per-parameter entry points stay per tensor by design: ``step_param`` (used by
gradient release hooks, agoq.optim.release, and the 8-bit grad reader of agoq.megatron.grads.grad_reader,
which materialises one parameter's gradient at a time so it cannot batch launches).
"""

from __future__ import annotations

import logging
import operator

import torch

log = logging.getLogger("agoq.optim")
_LOGGED: set[str] = set()


def log_fallback_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.warning("agoq.optim: per-tensor fused step for %s (multi-tensor launch not applicable)", reason)


class GroupPlan:
    """Cached multi-tensor launches of one param group (see the module docstring)."""

    def __init__(self, opt, group: dict, params: list, grads: list):
        from agoq.kernels.optim_multi import MultiTensorLaunch, OperandError

        self.ids = tuple(map(id, params))
        self.params = params
        self.ptrs = _ptrs(params, grads)
        states = [opt.init_state(p, group) for p in params]
        self.state_dicts = states
        buckets: dict[tuple, list[int]] = {}
        self.per_tensor: list[int] = []
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g.is_sparse:
                raise NotImplementedError("sparse gradients are not supported")
            if not g.is_contiguous():
                log_fallback_once("non-contiguous gradients (they would be copied each step)")
                self.per_tensor.append(i)
                continue
            master = states[i].get("master")
            key = (p.device, p.dtype, g.dtype, states[i]["formats"], None if master is None else master.dtype,
                   float(states[i]["step"]))  # fmt: skip
            buckets.setdefault(key, []).append(i)
        self.launches = []  # (launch, step buffer whose views are the bucket's state["step"])
        for key, idx in buckets.items():
            qs = [opt.quantized_states(params[i]) for i in idx]
            s1, s2 = ([None if name is None else q.get(name) for q in qs] for name in opt.multi_state_names(group))
            try:
                launch = MultiTensorLaunch.build([params[i] for i in idx], [grads[i] for i in idx],
                                                 [states[i].get("master") for i in idx], s1, s2)  # fmt: skip
            except OperandError as e:
                log_fallback_once(f"a bucket of {key[3]} ({e})")
                self.per_tensor.extend(idx)
                continue
            buf = torch.full((len(idx),), key[-1], dtype=torch.float32)
            for j, i in enumerate(idx):
                states[i]["step"] = buf[j]
            self.launches.append((launch, buf))
        self.signatures = [tuple(st.values()) for st in states]

    def current(self, opt, params: list, grads: list) -> bool:
        if tuple(map(id, params)) != self.ids or _ptrs(params, grads) != self.ptrs:
            return False
        state = opt.state
        for p, st, sig in zip(params, self.state_dicts, self.signatures, strict=True):
            # the same state dict holding the same objects: the tables point into these tensors
            if state.get(p) is not st or not all(map(operator.is_, sig, st.values())) or len(sig) != len(st):
                return False
        for _, buf in self.launches:  # step counts changed behind the plan's back: rebuild (buckets by step)
            lo, hi = buf.aminmax()
            if lo != hi:
                return False
        return True

    def step(self, opt, group: dict, grads: list) -> None:
        for launch, buf in self.launches:
            buf.add_(1)
            opt_name, scalars, flags = opt.kernel_args(group, int(buf[0]))
            launch.run(opt_name, scalars, **flags)
        for i in self.per_tensor:
            opt.step_param(self.params[i], grads[i], group)


def _ptrs(params: list, grads: list) -> tuple:
    return tuple([p.data_ptr() for p in params] + [g.data_ptr() for g in grads])
