"""Gradient release: same result as backward-then-step, no gradient left alive, clear conflicts."""

import pytest
import torch

from agoq.optim import AdamW
from agoq.optim.release import GradientRelease, check_release_compatible


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(torch.bfloat16)


def test_release_matches_step_after_backward_and_frees_grads():
    a, b = _model(), _model()
    opt_a, opt_b = AdamW(a.parameters(), lr=1e-2), AdamW(b.parameters(), lr=1e-2)
    release = GradientRelease(opt_b)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
        opt_a.zero_grad()
        a(x).float().pow(2).mean().backward()
        opt_a.step()
        b(x).float().pow(2).mean().backward()  # each param is stepped inside backward
        assert all(p.grad is None for p in b.parameters())
    for p, q in zip(a.parameters(), b.parameters(), strict=False):
        assert torch.equal(p, q)
    release.remove()
    assert not release.handles


@pytest.mark.parametrize("kwargs,flag", [
    (dict(pipeline_parallel=2), "--pipeline-model-parallel-size"),
    (dict(grad_accumulation=4), "accumulation"),
    (dict(data_parallel=2), "data-parallel"),
    (dict(clip_grad=1.0), "--clip-grad"),
])  # fmt: skip
def test_release_conflicts_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        check_release_compatible(**kwargs)
    check_release_compatible()  # the valid setting passes
