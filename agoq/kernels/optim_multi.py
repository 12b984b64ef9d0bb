"""Multi-tensor fused optimizer step: one launch updates many tensors of one format combination.

Twin of calling :mod:`agoq.kernels.optim` (and so :mod:`agoq.ref.optim`) once per tensor: every
tile runs the same ``step_tile`` body with the same scalars, so codes, scales, params and
remainders are bit-identical to the per-tensor kernel (tests/kernels/test_optim_kernels.py).

Layout. Each operand (param, grad, master, state-1 codes / scales, state-2 codes / scales) is passed
as one *base* tensor (the lowest address among the tensors of that operand, all of one dtype) plus
a device table of per-tensor element offsets from that base, stored in units of ``A_*`` elements,
the largest power of two (<= 16 bytes) dividing every tensor's byte distance from the base and the
base itself, so Triton's alignment analysis still sees 16-byte aligned rows and vectorises loads.
Operands of different allocations are reached by address arithmetic from one base (one virtual
address space; the interpreter reads raw host addresses likewise).

    table    int64 [T, NCOL]: numel, rows (= ceil(numel / BLOCK)), then one offset per operand
    starts   int32 [T]: first program of each tensor
    owner    int16 (int32 past 32767 tensors) [programs]: the tensor of each program

Program ``pid`` reads its tensor ``t = owner[pid]`` (one load; 2 bytes per 512 elements, 4 MB of
int16 per 1e9 parameters: an earlier branch-free binary search over ``starts`` made the multi-tensor
step's device time 8 % above the per-tensor kernel's), then updates tile ``pid - starts[t]`` of it.
Full tiles pass a constant element limit (vectorised, unmasked-equivalent loads); only a tensor's last
tile is masked.
Host cost: the tables are built once (:class:`MultiTensorLaunch`) and reused while the tensors'
addresses stay the same; a step is then one kernel launch with its fp32 scalars as arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agoq.kernels import optim as k
from agoq.kernels.optim import step_tile
from agoq.ref.master import MASTER_NS

__all__ = ["MultiTensorLaunch", "OperandError", "NCOL"]

INT32_MAX = 2**31 - 1
INT16_MAX = 2**15 - 1
# Launch shape of the multi-tensor step: ELEMS_PER_PROGRAM (agoq.kernels.optim) elements on `num_warps` warps with
# at most `maxnreg` registers per thread, per state-format family. Chosen by `benchmarks/bench_optim.py --launch-sweep`
# on an H100 (2026-11-25, 1e9 params; benchmarks/results/optim_sweep_multi.json for FlashAdamW over elements x warps x
# caps, optim_sweep_formats.json per format): ptxas's own choice at 2 warps (96 registers for FlashAdamW, 20
# resident warps per SM) ran 7.31 ms against 5.68 ms at 1 warp x 80 registers. Results do not depend on it
# (checked bit for bit per shape).
SHAPE_DEFAULT = (1, 80)  # companded / fp8 / bf16 states with split24 or no master, Lion: 5.21-5.68 ms
SHAPE_NF4_OR_SPLIT32 = (2, 64)  # NF4 m (midpoint search) or split32 (a division per element): 6.24 / 5.95 ms
SHAPE_FP32_STATES = (2, None)  # fp32 m and v: 9.32 ms (1 x 80: 10.08)
LAUNCH_OVERRIDE: tuple | None = None  # (num_warps, maxnreg) for every format: bench_optim.py --launch-sweep


def launch_shape(consts: dict) -> tuple:
    """(num_warps, maxnreg) of a multi-tensor launch from its constexprs (see the table above)."""
    if LAUNCH_OVERRIDE is not None:
        return LAUNCH_OVERRIDE
    if all(consts[f"K{i}"] == -1 and consts[f"PK{i}"] == 0 for i in (1, 2)):
        return SHAPE_FP32_STATES
    if consts["K1"] == 1 or consts["K2"] == 1 or (consts["MASTER"] == k.MASTER_IDS["split"]
                                                 and consts["MASTER_N"] != k.INT8_MASTER_N):
        return SHAPE_NF4_OR_SPLIT32
    return SHAPE_DEFAULT
MAX_ALIGN_BYTES = 16  # Triton specialises pointers on 16-byte alignment (its widest vector load)
OPERANDS = ("param", "grad", "master", "s1_codes", "s1_scales", "s2_codes", "s2_scales")
NCOL = 2 + len(OPERANDS)


@triton.jit
def _multi_step_kernel(
    table_ptr,  # int64 [T, NCOL]
    starts_ptr,  # int32 [T]
    owner_ptr,  # int16 / int32 [programs]: tensor index of each program
    param_ptr, grad_ptr, master_ptr, frac_ptr,  # operand bases; frac_ptr: agoq.kernels.optim._rho_fracs
    s1_codes_ptr, s1_scales_ptr, s1_lut_ptr, s1_mids_ptr,
    s2_codes_ptr, s2_scales_ptr, s2_lut_ptr, s2_mids_ptr,
    c0, c1, c2, c3, c4, c5, c6, c7,
    A_P: tl.constexpr, A_G: tl.constexpr, A_M: tl.constexpr,  # offset units (elements) per operand
    A_C1: tl.constexpr, A_S1: tl.constexpr, A_C2: tl.constexpr, A_S2: tl.constexpr,
    OPT: tl.constexpr, MASTER: tl.constexpr, MASTER_N: tl.constexpr, PARAM_KIND: tl.constexpr,
    MANT: tl.constexpr, E_MIN: tl.constexpr, HAS_S1: tl.constexpr, HAS_WD: tl.constexpr, NESTEROV: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
    K1: tl.constexpr, B1: tl.constexpr, SC1: tl.constexpr, P01: tl.constexpr, P11: tl.constexpr,
    F81: tl.constexpr, Q1: tl.constexpr, PK1: tl.constexpr,
    K2: tl.constexpr, B2: tl.constexpr, SC2: tl.constexpr, P02: tl.constexpr, P12: tl.constexpr,
    F82: tl.constexpr, Q2: tl.constexpr, PK2: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.load(owner_ptr + pid).to(tl.int32)
    row = table_ptr + t.to(tl.int64) * 9  # NCOL columns (asserted below)
    numel = tl.load(row)
    num_rows = tl.load(row + 1)
    first_row = (pid - tl.load(starts_ptr + t)).to(tl.int64) * ROWS
    p = param_ptr + tl.load(row + 2) * A_P
    g = grad_ptr + tl.load(row + 3) * A_G
    m = master_ptr + tl.load(row + 4) * A_M
    c1p = s1_codes_ptr + tl.load(row + 5) * A_C1
    s1p = s1_scales_ptr + tl.load(row + 6) * A_S1
    c2p = s2_codes_ptr + tl.load(row + 7) * A_C2
    s2p = s2_scales_ptr + tl.load(row + 8) * A_S2
    if (first_row + ROWS) * BLOCK <= numel:  # full tile: constant limits
        step_tile(
            p, g, m, frac_ptr, c1p, s1p, s1_lut_ptr, s1_mids_ptr, c2p, s2p, s2_lut_ptr, s2_mids_ptr,
            first_row, ROWS * BLOCK, ROWS,
            c0, c1, c2, c3, c4, c5, c6, c7, OPT, MASTER, MASTER_N, PARAM_KIND, MANT, E_MIN, HAS_S1, HAS_WD, NESTEROV,
            BLOCK, ROWS, K1, B1, SC1, P01, P11, F81, Q1, PK1, K2, B2, SC2, P02, P12, F82, Q2, PK2,
        )  # fmt: skip
    else:  # the tensor's last tile
        step_tile(
            p, g, m, frac_ptr, c1p, s1p, s1_lut_ptr, s1_mids_ptr, c2p, s2p, s2_lut_ptr, s2_mids_ptr,
            first_row, (numel - first_row * BLOCK).to(tl.int32), (num_rows - first_row).to(tl.int32),
            c0, c1, c2, c3, c4, c5, c6, c7, OPT, MASTER, MASTER_N, PARAM_KIND, MANT, E_MIN, HAS_S1, HAS_WD, NESTEROV,
            BLOCK, ROWS, K1, B1, SC1, P01, P11, F81, Q1, PK1, K2, B2, SC2, P02, P12, F82, Q2, PK2,
        )  # fmt: skip


class OperandError(ValueError):
    """The tensors cannot share one multi-tensor launch (dtype, device or alignment); the caller falls
    back to per-tensor launches and says so."""


def _operand(tensors: list[torch.Tensor | None], dummy: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """(base tensor, per-tensor offsets in units, unit in elements) for one operand; absent -> dummy."""
    present = [t for t in tensors if t is not None and t.numel() > 0]
    if not present:
        return dummy, [0] * len(tensors), 1
    dtypes = {t.dtype for t in present}
    if len(dtypes) > 1:
        raise OperandError(f"mixed dtypes {sorted(map(str, dtypes))}")
    base = min(present, key=lambda t: t.data_ptr())
    size = base.element_size()
    b0 = base.data_ptr()
    align = MAX_ALIGN_BYTES
    for t in present:
        align = math.gcd(align, t.data_ptr() - b0, b0)
    if align % size:
        raise OperandError(f"a {base.dtype} tensor is not {size}-byte aligned relative to the others")
    unit = align // size
    offsets = [0 if t is None or t.numel() == 0 else (t.data_ptr() - b0) // size // unit for t in tensors]
    return base, offsets, unit


@dataclass
class MultiTensorLaunch:
    """The cached tables and launch arguments of one multi-tensor step (see the module docstring).

    Build it with :meth:`build` from per-tensor lists (same length; a state list is None or all None
    when that state is absent); call :meth:`run` each step. ``key`` is the tuple of every operand's
    data_ptr: rebuild when :meth:`key_of` of the current tensors differs."""

    table: torch.Tensor
    starts: torch.Tensor
    owner: torch.Tensor
    bases: tuple
    units: tuple
    constexprs: dict
    programs: int
    num_tensors: int

    @staticmethod
    def build(params, grads, masters, s1s, s2s) -> MultiTensorLaunch:
        n = len(params)
        s1s = s1s if s1s is not None else [None] * n
        s2s = s2s if s2s is not None else [None] * n
        if not (len(grads) == len(masters) == len(s1s) == len(s2s) == n) or n == 0:
            raise ValueError("multi-tensor step: one grad, master and state entry per param (and >= 1 param)")
        device = params[0].device
        if any(t.device != device for t in params):
            raise OperandError("params on more than one device")
        for p, g, mst, q1, q2 in zip(params, grads, masters, s1s, s2s, strict=True):
            k.check_pair(p, g, mst)
            k._check_state(q1, p.numel())
            k._check_state(q2, p.numel())
            if not g.is_contiguous():
                raise OperandError("a non-contiguous gradient")
        block = k.fused_block(s1s[0], s2s[0])
        fmts = {(None if a is None else a.fmt, None if b is None else b.fmt) for a, b in zip(s1s, s2s, strict=True)}
        if len(fmts) != 1:
            raise OperandError("tensors with different state formats")
        master_kinds = {(None if m is None else m.dtype) for m in masters}
        if len(master_kinds) != 1 or len({p.dtype for p in params}) != 1:
            raise OperandError("tensors with different param dtypes or master kinds")
        rows_per_prog = max(1, k.ELEMS_PER_PROGRAM // block)
        dev = str(device)
        dummy = k._dummy(dev)
        a1, k1 = k._state_args(s1s[0], device)
        a2, k2 = k._state_args(s2s[0], device)

        def codes(qs, i):
            return [None if q is None else k._state_args(q, device)[0][i] for q in qs]

        cols = [
            _operand(params, dummy),
            _operand([g.reshape(-1) for g in grads], dummy),
            _operand(masters, dummy),
            _operand(codes(s1s, 0), dummy),
            _operand(codes(s1s, 1) if k1["K"] != -1 else [None] * n, dummy),
            _operand(codes(s2s, 0), dummy),
            _operand(codes(s2s, 1) if k2["K"] != -1 else [None] * n, dummy),
        ]
        live = [i for i, p in enumerate(params) if p.numel() > 0]  # zero-size tensors: nothing to launch
        rows = [-(-params[i].numel() // block) for i in live]
        progs = [-(-r // rows_per_prog) for r in rows]
        table = [[params[i].numel(), r] + [c[1][i] for c in cols] for i, r in zip(live, rows, strict=True)]
        starts = [0] * max(len(progs), 1)
        acc = 0
        for j, pr in enumerate(progs):
            starts[j] = acc
            acc += pr
        if acc >= INT32_MAX:
            raise OperandError(f"{acc} programs exceed int32")
        owner_dtype = torch.int16 if len(progs) <= INT16_MAX else torch.int32
        owner = torch.repeat_interleave(torch.arange(len(progs), dtype=owner_dtype),
                                        torch.tensor(progs, dtype=torch.int64))
        p0 = params[0]
        mdt = masters[0].dtype if masters[0] is not None else None
        master_kind = "none" if mdt is None else ("fp32" if mdt == torch.float32 else "split")
        mant, e_min = k.NARROW_CONSTS[p0.dtype]
        consts = dict(
            A_P=cols[0][2], A_G=cols[1][2], A_M=cols[2][2], A_C1=cols[3][2], A_S1=cols[4][2], A_C2=cols[5][2],
            A_S2=cols[6][2],
            MASTER=k.MASTER_IDS[master_kind], MASTER_N=MASTER_NS.get(mdt, 1),
            PARAM_KIND=k._PARAM_KINDS[p0.dtype], MANT=mant, E_MIN=e_min, HAS_S1=s1s[0] is not None,
            BLOCK=block, ROWS=rows_per_prog,
            K1=k1["K"], B1=k1["B"], SC1=k1["SC"], P01=k1["P0"], P11=k1["P1"], F81=k1["F8"], Q1=k1["Q"], PK1=k1["PK"],
            K2=k2["K"], B2=k2["B"], SC2=k2["SC"], P02=k2["P0"], P12=k2["P1"], F82=k2["F8"], Q2=k2["Q"], PK2=k2["PK"],
        )  # fmt: skip
        bases = (cols[0][0], cols[1][0], cols[2][0], k.frac_table(masters[0], device), cols[3][0], cols[4][0],
                 a1[2], a1[3],
                 cols[5][0], cols[6][0], a2[2], a2[3])  # fmt: skip
        table_t = torch.tensor(table or [[0] * NCOL], dtype=torch.int64).to(device)
        starts_t = torch.tensor(starts, dtype=torch.int32).to(device)
        owner_t = (owner if acc else torch.zeros(1, dtype=owner_dtype)).to(device)
        return MultiTensorLaunch(table_t, starts_t, owner_t, bases, tuple(c[2] for c in cols), consts, acc, len(live))

    def run(self, opt: str, scalars, *, has_wd: bool = False, nesterov: bool = False) -> None:
        """One step of every tensor: ``scalars`` as agoq.kernels.optim's (see its *_scalar_args)."""
        if self.programs == 0:
            return
        warps, maxnreg = launch_shape(self.constexprs)
        _multi_step_kernel[(self.programs,)](
            self.table, self.starts, self.owner, *self.bases, *scalars,
            OPT=k.OPT_IDS[opt], HAS_WD=has_wd, NESTEROV=nesterov,
            **self.constexprs, num_warps=warps, enable_fp_fusion=False, maxnreg=maxnreg,
        )  # fmt: skip


assert NCOL == 9, "the kernel indexes the table with 9 columns"
