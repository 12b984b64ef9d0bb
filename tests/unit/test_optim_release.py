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


def test_release_reads_the_current_group_after_a_scheduler_write_and_load_state_dict():
    """torch's load_state_dict re-creates the param-group dicts and a scheduler writes lr into them: the hooks
    look the group up when they fire, so both reach the step (a hook holding the old dict would use lr 1e-2)."""
    a, b = _model(), _model()
    opt_a, opt_b = AdamW(a.parameters(), lr=1e-2), AdamW(b.parameters(), lr=1e-2)
    GradientRelease(opt_b)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
        if step == 1:
            opt_b.load_state_dict(opt_b.state_dict())
            for opt in (opt_a, opt_b):
                for group in opt.param_groups:
                    group["lr"] = 1e-3
        opt_a.zero_grad()
        a(x).float().pow(2).mean().backward()
        opt_a.step()
        b(x).float().pow(2).mean().backward()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_before_step_runs_first_and_can_stop_the_step():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2)
    seen = []

    def before_step(p, grad):
        seen.append(grad is p.grad and grad is not None)
        raise RuntimeError("bad gradient")

    release = GradientRelease(opt, before_step=before_step)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="bad gradient"):
        model(torch.ones(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    assert seen == [True] and release.stepped == 0 and not opt.state
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters(), strict=True))
