"""The optimizer paths that move weights outside torch's ``Optimizer.step`` invalidate agoq's FP8 weight casts.

agoq's FP8 linears keep each weight's FP8 casts until :func:`agoq.ops.fp8_weight_cache.fp8_weights_changed` is
called; torch's optimizer step post-hook calls it after every ``Optimizer.step``. Two of agoq's Megatron paths
update the weights without ``Optimizer.step``: the 8-bit gradient store's per-parameter step
(``grad_reader.step_with_ready_grads``, agoq full: ``--agoq-grads int8_b256 --agoq-optimizer adamw``) and gradient
release (the step inside backward). agoq's own trainer also invalidates at every step start; Megatron-LM's trainer
(the door) does not, so there these paths must do it themselves: without it an H100 run of agoq full + FP8 through
``scripts/pretrain_gpt_agoq.py`` kept the initial weights' FP8 casts and learned far slower (loss 6.22 at iteration 3
against 2.44-2.55 for every other FP8 or bf16 row, benchmarks/results/te.json).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.megatron]

from agoq.megatron.grads import grad_reader  # noqa: E402
from agoq.megatron.optim.release import AgoqReleaseOptimizer  # noqa: E402
from agoq.ops.fp8_weight_cache import weight_generation  # noqa: E402
from agoq.optim import AdamW  # noqa: E402


class _Reader:
    """The 8-bit store's reader as step_with_ready_grads uses it: one dequantized gradient per parameter."""

    clip_coeff = 1.0

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        return torch.full_like(param, 0.5, dtype=torch.float32)


def test_store_mode_step_invalidates_fp8_weight_casts():
    param = torch.nn.Parameter(torch.ones(64, 64))
    before_weights = param.detach().clone()
    inner = AdamW([param], lr=1e-2)
    optimizer = SimpleNamespace(grad_reader=_Reader(), optimizer=inner)
    generation = weight_generation()
    assert grad_reader.step_with_ready_grads(optimizer) is True
    assert not torch.equal(param.detach(), before_weights), "the step did not move the weight"
    assert weight_generation() > generation, "weights moved but FP8 weight casts stay valid"


def test_release_step_invalidates_fp8_weight_casts():
    param = torch.nn.Parameter(torch.ones(4))
    release_optimizer = SimpleNamespace(release=SimpleNamespace(stepped=1), num_params=1, param_names={},
                                        optimizer=SimpleNamespace(param_groups=[{"params": [param]}]))
    generation = weight_generation()
    assert AgoqReleaseOptimizer.step(release_optimizer) == (True, None, None)
    assert weight_generation() > generation, "weights moved in backward but FP8 weight casts stay valid"
