"""benchmarks/planner_history.py's STATE_INIT_BYTES_PER_ELEMENT measured: the temporaries of agoq's optimizer
creating one parameter's states (the first step), on the CPU allocator (agoq.testing.memory.cpu_allocation_peak).

"split_fp64" is the init_state of fb51259..98c84d5 (``git show 98c84d5^:agoq/optim/base.py``): the moments quantized
from fp32 zeros, the split24 remainder through ``ref_master_split(p.float())``, both still the references in
agoq.ref; "zeros" is today's ``QuantizedOptimizer.init_state``. Exact byte counts (rule 3: sizes are compared
exactly; the allocator reports every storage).
"""

from __future__ import annotations

import torch

from agoq.formats import parse_format
from agoq.optim import AdamW
from agoq.ref.master import ref_master_split
from agoq.ref.quant import ref_quantize
from agoq.testing.memory import cpu_allocation_peak
from tests.megatron._bench_scripts import load_bench_script

STATE_INIT_BYTES_PER_ELEMENT = load_bench_script("planner_history").STATE_INIT_BYTES_PER_ELEMENT

SHAPE = (1024, 1024)  # a matrix (1-D params get fp32 states: SMALL_TENSOR_RULE); whole blocks of 32
NUMEL = SHAPE[0] * SHAPE[1]
MOMENTS = ("cint8_b32", "cuint8_b32")  # AdamW's defaults (FlashAdamW), the planner's Recipe.moments
KEPT_BYTES_PER_ELEMENT = 1 + 1 + 1 + 2 * 2 / 32  # split24 remainder + two int8 codes + fp16 scale per 32


def _param() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(SHAPE).to(torch.bfloat16)


def _transient_and_kept_bytes(init) -> tuple[int, int]:
    with cpu_allocation_peak() as peak:
        kept = init()
    assert kept  # alive until the measurement ends
    return peak.bytes - peak.net, peak.net


def test_state_init_before_98c84d5_peaks_at_the_planner_constant():
    p = _param()

    def old_init_state():
        state = {}
        for name in MOMENTS:
            q = ref_quantize(torch.zeros(p.shape, dtype=torch.float32), parse_format(name))
            state[f"{name}.codes"], state[f"{name}.scales"] = q.codes, q.scales
        _, state["master"] = ref_master_split(p.detach().float(), p.dtype, torch.int8)
        return state

    transient, kept = _transient_and_kept_bytes(old_init_state)
    assert kept == KEPT_BYTES_PER_ELEMENT * NUMEL
    assert transient == STATE_INIT_BYTES_PER_ELEMENT["split_fp64"] * NUMEL


def test_state_init_today_has_no_temporaries():
    p = torch.nn.Parameter(_param())
    opt = AdamW([p], state_formats=dict(zip(("exp_avg", "exp_avg_sq"), MOMENTS, strict=True)), master="split24")
    transient, kept = _transient_and_kept_bytes(lambda: opt.init_state(p, opt.param_groups[0]))
    assert kept == KEPT_BYTES_PER_ELEMENT * NUMEL + 4  # + the fp32 step count
    # zero_quantized quantizes one block of zeros and repeats it: that block's temporaries are gone before the
    # full-size states are allocated, so nothing is ever alive beyond what is kept
    assert STATE_INIT_BYTES_PER_ELEMENT["zeros"] == 0 == transient
