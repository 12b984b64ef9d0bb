"""QuantizedOptimizer: a torch.optim.Optimizer whose states are agoq formats and whose master weight
may be split (FlashOptim). AdamW / Lion / SGD subclass it with their update (agoq.optim.optimizers).

Per-group options (any param group may override them):
    state_formats  {state name: format name}, e.g. {"exp_avg": "cint8_b32", "exp_avg_sq": "cuint8_b32"}
    master         "none" (update the param in its own dtype), "fp32" (separate fp32 copy),
                   "split24" (bf16 param + int8 remainder), "split32" (bf16 param + int16 remainder)
    fused          True: Triton (agoq.kernels.optim); False: plain PyTorch (agoq.ref.optim), one call per tensor
    multi_tensor   with fused=True: step() launches one kernel per bucket of the group (agoq.optim.multi,
                   agoq.kernels.optim_multi) instead of one per tensor (default True; False asks for the
                   per-tensor launches, e.g. to compare)
    small_numel    tensors with ndim < 2 or numel < small_numel keep fp32 states and a split32 master
                   (see SMALL_TENSOR_RULE)

State layout (plain tensors, so state_dict / torch.save / dist_checkpointing see ordinary tensors):
    state[p]["step"]                 0-dim fp32 CPU tensor (Megatron reads it as a tensor); with multi-tensor
                                     launches a view of one buffer per launch bucket (agoq.optim.multi)
    state[p][f"{name}.codes"]        uint8 packed codes (fmt.code_bytes(numel))
    state[p][f"{name}.scales"]       per-group scales (fp16 / fp32 / uint8), empty for plain formats
    state[p]["master"]               int8 / int16 remainder or fp32 master (absent for "none")
Formats are recorded per param in state[p]["formats"] (a str "name=fmt,...;master=...").

Savings (bytes/param, excluding grads): fp32 AdamW 12 (4 master + 4 m + 4 v) vs split24 + cint8_b32 +
cuint8_b32: 2 (bf16 param) + 1 (rho) + 1.0625 + 1.0625 = 5.125; see state_bytes().
Caveats: split24 stalls updates below ULP(theta')/(2*127) ~ |theta| * 2**-16 (FlashOptim §caveat);
stalled_fraction() measures it. Fused states of one tensor must share a block size.
"""

from __future__ import annotations

import functools
import math

import torch

from agoq.formats import QuantFormat, parse_format
from agoq.ref.master import MASTER_NS, ref_master_merge
from agoq.ref.quant import QuantizedTensor, ref_quantize

MASTER_CHOICES = ("none", "fp32", "split24", "split32")
MASTER_DTYPES = {"split24": torch.int8, "split32": torch.int16, "fp32": torch.float32}
# Small tensors (RMSNorm gains, biases) are < 0.1 % of a LLaMA's parameters, so full-precision states
# cost nothing measurable; gains sit near 1.0 where split24's smallest step (2**-16) exceeds late
# cosine-decayed AdamW steps (lr 3e-5 * ~1) and would stall (FlashOptim caveat, arXiv 2602.23349).
SMALL_TENSOR_RULE = "ndim < 2 or numel < small_numel -> fp32 states, split32 master (if bf16/fp16)"
DEFAULT_SMALL_NUMEL = 4096
LOGICAL_SHAPE_ATTR = "agoq_logical_shape"  # set on flat param shards by agoq.megatron.optim.dist_optimizer


def check_master(master: str) -> str:
    if master not in MASTER_CHOICES:
        raise ValueError(f"master={master!r} is not supported; use one of {list(MASTER_CHOICES)}")
    return master



def zero_quantized(shape: torch.Size, fmt: QuantFormat, device: torch.device) -> QuantizedTensor:
    """``ref_quantize(torch.zeros(shape), fmt)`` without its full-size fp32 input and temporaries: every block of
    zeros encodes alike, so one block's codes and scale are repeated (block-quantized formats pad to whole
    blocks). Plain formats (fp32 states of small tensors) take the reference path."""
    numel = math.prod(shape)
    if not fmt.quantized:
        return ref_quantize(torch.zeros(shape, dtype=torch.float32, device=device), fmt)
    one = ref_quantize(torch.zeros(fmt.block, dtype=torch.float32, device=device), fmt)
    blocks = fmt.num_blocks(numel)
    return QuantizedTensor(one.codes.repeat(blocks), one.scales.repeat(blocks), fmt, torch.Size(shape), torch.float32)

class QuantizedOptimizer(torch.optim.Optimizer):
    """Base class: state allocation, (de)serialisation, accounting. Subclasses set STATE_NAMES and
    implement _update(p, grad, master, states, group, step)."""

    STATE_NAMES: tuple[str, ...] = ()
    DEFAULT_FORMATS: dict[str, str] = {}

    def __init__(self, params, defaults: dict):
        defaults.setdefault("state_formats", dict(self.DEFAULT_FORMATS))
        defaults.setdefault("master", "split24")
        defaults.setdefault("fused", False)
        defaults.setdefault("small_numel", DEFAULT_SMALL_NUMEL)
        defaults.setdefault("multi_tensor", True)
        self._plans: dict = {}  # param-group index -> agoq.optim.multi.GroupPlan (cached launch tables)
        super().__init__(params, defaults)
        # Where step() reads gradients: "grad", or "decoupled_grad" when a wrapper keeps a gradient
        # whose dtype differs from the param (Megatron's precision-aware distributed optimizer).
        self.grad_attr = "grad"
        self.grad_source = None  # callable param -> gradient (or None): step() reads gradients from it
        for group in self.param_groups:
            self._check_group(group)

    def _check_group(self, group: dict) -> None:
        check_master(group["master"])
        unknown = set(group["state_formats"]) - set(self.STATE_NAMES)
        if unknown:
            raise ValueError(f"{type(self).__name__} has states {list(self.STATE_NAMES)}, not {sorted(unknown)}")
        for name, fmt in group["state_formats"].items():
            parse_format(fmt)
            if parse_format(fmt).rounding == "stochastic":
                raise NotImplementedError(f"state format {fmt!r} ({name}): stochastic rounding is not supported")

    # ---------------------------------------------------------------- per-param decisions
    def is_small(self, p: torch.Tensor, group: dict) -> bool:
        """SMALL_TENSOR_RULE on the logical shape: a flat shard of a matrix (distributed optimizer)
        sets ``p.agoq_logical_shape`` to the matrix's shape, so its rule does not depend on sharding."""
        shape = getattr(p, LOGICAL_SHAPE_ATTR, p.shape)
        return len(shape) < 2 or math.prod(shape) < group["small_numel"]

    def formats_for(self, p: torch.Tensor, group: dict) -> dict[str, QuantFormat]:
        if self.is_small(p, group):
            return {name: parse_format("fp32") for name in self.active_states(group)}
        return {
            name: parse_format(group["state_formats"].get(name, self.DEFAULT_FORMATS[name]))
            for name in self.active_states(group)
        }

    def master_for(self, p: torch.Tensor, group: dict) -> str:
        """fp32 params are their own master; small 16-bit tensors get split32 (SMALL_TENSOR_RULE)."""
        if p.dtype == torch.float32:
            return "none"
        if group["master"] != "none" and self.is_small(p, group):
            return "split32"
        return group["master"]

    def active_states(self, group: dict) -> tuple[str, ...]:
        return self.STATE_NAMES

    def multi_state_names(self, group: dict) -> tuple[str | None, str | None]:
        """The states in the fused kernel's slots 1 and 2 (None: absent)."""
        names = self.active_states(group)
        return (names[0] if names else None, names[1] if len(names) > 1 else None)

    def kernel_args(self, group: dict, step: int) -> tuple[str, tuple, dict]:  # pragma: no cover - abstract
        """(kernel optimizer name, fp32 scalars c0..c7, flags) of the fused step at ``step``."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.drop_plans()

    def drop_plans(self) -> None:
        """Forget the cached multi-tensor launch tables (rebuilt at the next step)."""
        self.__dict__.setdefault("_plans", {}).clear()

    # ---------------------------------------------------------------- state
    def init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state:
            return state
        fmts = self.formats_for(p, group)
        master = self.master_for(p, group)
        state["step"] = torch.zeros((), dtype=torch.float32)
        for name, fmt in fmts.items():
            q = zero_quantized(p.shape, fmt, p.device)
            state[f"{name}.codes"], state[f"{name}.scales"] = q.codes, q.scales
        if master in ("split24", "split32"):
            # theta' = p is the master at start: p is bf16/fp16 (master_for gives fp32 params none), so the
            # remainder is exactly zero; ref_master_split would say so through ~8 float64 temporaries of p's
            # size (4 GiB each for the 8B shape's 525M-element embedding: it ran one 80 GB H100 out of memory)
            state["master"] = torch.zeros(p.shape, dtype=MASTER_DTYPES[master], device=p.device)
        elif master == "fp32":
            state["master"] = p.detach().float().clone()
        state["formats"] = ";".join([f"{n}={f.name}" for n, f in fmts.items()] + [f"master={master}"])
        return state

    def quantized_states(self, p: torch.Tensor) -> dict[str, QuantizedTensor]:
        state = self.state[p]
        return {
            name: QuantizedTensor(state[f"{name}.codes"], state[f"{name}.scales"], fmt, p.shape, torch.float32)
            for name, fmt in parse_formats(state["formats"])
        }

    def fp32_master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master value of p (merge of param + remainder, or the fp32 copy, or p itself)."""
        master = self.state[p].get("master") if p in self.state else None
        if master is None:
            return p.detach().float()
        if master.dtype == torch.float32:
            return master.clone()
        return ref_master_merge(p.detach(), master)

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        attr = self.grad_attr
        if getattr(self, "grad_source", None) is not None:  # absent after unpickling
            self._step_from_source()
            return loss
        for index, group in enumerate(self.param_groups):
            params, grads = [], []
            for p in group["params"]:
                grad = getattr(p, attr, None)
                if grad is not None:
                    params.append(p)
                    grads.append(grad)
            if not params:
                continue
            if group["fused"] and group["multi_tensor"]:
                self._step_multi(index, group, params, grads)
            else:
                for p, grad in zip(params, grads, strict=True):
                    self.step_param(p, grad, group)
        return loss

    def _step_from_source(self) -> None:
        """One parameter at a time, each gradient from ``grad_source`` (built, used, dropped in turn:
        agoq/megatron/grads/grad_reader.py's 8-bit shard reads); no multi-tensor launch, which needs them all."""
        for group in self.param_groups:
            for p in group["params"]:
                grad = self.grad_source(p)
                if grad is not None:
                    self.step_param(p, grad, group)

    def _step_multi(self, index: int, group: dict, params: list, grads: list) -> None:
        from agoq.optim.multi import GroupPlan

        plans = self.__dict__.setdefault("_plans", {})  # absent after unpickling (torch's __setstate__)
        plan = plans.get(index)
        if plan is None or not plan.current(self, params, grads):
            plan = plans[index] = GroupPlan(self, group, params, grads)
        plan.step(self, group, grads)

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        """Update one parameter (also used by gradient release hooks)."""
        if grad.is_sparse:
            raise NotImplementedError("sparse gradients are not supported")
        state = self.init_state(p, group)
        state["step"] += 1
        self._update(p, grad, state.get("master"), self.quantized_states(p), group, int(state["step"]))

    def _update(self, p, grad, master, states, group, step) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---------------------------------------------------------------- (de)serialisation
    def load_state_dict(self, state_dict: dict) -> None:
        """Like torch.optim.Optimizer.load_state_dict, but state tensors keep their dtype (torch's
        version casts every floating state to the param dtype: fp16 scales / fp32 masters would break)."""
        saved_groups = state_dict["param_groups"]
        self.drop_plans()
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        id_to_param = {
            pid: p
            for saved, group in zip(saved_groups, self.param_groups, strict=False)
            for pid, p in zip(saved["params"], group["params"], strict=False)
        }
        for pid, saved_state in state_dict["state"].items():
            p = id_to_param[pid]
            self.state[p] = {
                k: (v.detach().clone().to(p.device) if isinstance(v, torch.Tensor) else v)
                for k, v in saved_state.items()
            }
            if "step" in self.state[p]:
                self.state[p]["step"] = self.state[p]["step"].to("cpu", torch.float32)

    # ---------------------------------------------------------------- accounting
    def state_bytes(self) -> dict[str, int]:
        """Exact bytes held: params (as stored), master remainders/copies, each state (codes + scales)."""
        out = {"params": 0, "master": 0}
        for group in self.param_groups:
            for p in group["params"]:
                out["params"] += p.numel() * p.element_size()
                st = self.state.get(p, {})
                for k, v in st.items():
                    if not isinstance(v, torch.Tensor) or k == "step":
                        continue
                    key = "master" if k == "master" else k.split(".")[0]
                    out[key] = out.get(key, 0) + v.numel() * v.element_size()
        return out

    def stalled_fraction(self, step_size: float) -> float:
        """Fraction of elements whose master cannot move by an update of magnitude step_size: the
        update is below half of the master's resolution (ULP(theta')/(2N) for split, ULP/2 for a plain
        16-bit param). FlashOptim's check_numerics idea, measured per element instead of estimated."""
        stalled = total = 0
        for group in self.param_groups:
            for p in group["params"]:
                res = _resolution(p, self.master_for(p, group))
                stalled += int((res / 2 > step_size).sum())
                total += p.numel()
        return stalled / max(total, 1)


@functools.lru_cache(maxsize=64)
def parse_formats(formats: str) -> tuple[tuple[str, QuantFormat], ...]:
    """state["formats"] ("exp_avg=cint8_b32;...;master=split24") -> the (name, format) of each state."""
    items = (item.split("=") for item in formats.split(";"))
    return tuple((name, parse_format(fmt)) for name, fmt in items if name != "master")


def _resolution(p: torch.Tensor, master: str) -> torch.Tensor:
    """Per-element spacing of the master value: fp32 ulp, 16-bit ulp, or ULP(theta') / N for a split."""
    from agoq.ref.master import half_ulp_exponent, pow2_f32

    if p.dtype == torch.float32 or master == "fp32":
        field = (p.detach().float().view(torch.int32) >> 23) & 0xFF
        return pow2_f32(torch.clamp_min(field - 127, -126) - 23)
    ulp = pow2_f32(half_ulp_exponent(p.detach()) + 1)
    return ulp if master == "none" else ulp / (2 * MASTER_NS[MASTER_DTYPES[master]])
