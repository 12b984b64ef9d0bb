"""A resumed run's weight decay: the checkpoint's schedule (agoq's default, Megatron-LM's
--use-checkpoint-opt_param-scheduler) includes it, every optimizer step follows the value in force, and a changed
--weight-decay is named in the start-up line instead of being dropped without a word (2026-11-27 review: the first
resumed step of agoq's optimizer used the command line's value, every later one the checkpoint's)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from agoq.megatron.ckpt.load import _pin_group_lr_bounds
from agoq.megatron.ckpt.resume import schedule_line

pytestmark = pytest.mark.megatron
GBS = 4


def _scheduler(optimizer, weight_decay: float, *, use_checkpoint: bool) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2 * GBS,
                                   lr_decay_steps=10 * GBS, lr_decay_style="cosine", start_wd=weight_decay,
                                   end_wd=weight_decay, wd_incr_steps=10 * GBS, wd_incr_style="constant",
                                   use_checkpoint_opt_param_scheduler=use_checkpoint)


@pytest.mark.parametrize("megatron_groups", [False, True])  # agoq's optimizer's groups / Megatron's (max_lr, min_lr)
def test_resumed_groups_take_the_weight_decay_in_force(megatron_groups):
    def optimizer():
        group = {"params": [torch.nn.Parameter(torch.ones(2))], "wd_mult": 1.0}
        if megatron_groups:
            group.update(max_lr=3e-3, min_lr=3e-4)
        return torch.optim.SGD([group], lr=0.0)

    saved = _scheduler(optimizer(), 0.1, use_checkpoint=False)
    saved.step(3 * GBS)
    live_optimizer = optimizer()
    resumed = _scheduler(live_optimizer, 0.0, use_checkpoint=True)  # the command line asks for 0.0
    requested = resumed.state_dict()
    resumed.load_state_dict(saved.state_dict())
    _pin_group_lr_bounds(live_optimizer, resumed)
    (group,) = live_optimizer.param_groups
    assert group["weight_decay"] == resumed.get_wd() == 0.1  # the checkpoint's, from the first resumed step on
    assert group["lr"] == pytest.approx(saved.get_lr(saved.optimizer.param_groups[0]))
    line = schedule_line(resumed.state_dict(), requested, override=False, global_batch_size=GBS, train_iters=10)
    assert "not used from this command line: --weight-decay (--override-opt-param-scheduler" in line, line


def test_schedule_line_names_each_differing_flag_once():
    in_force = dict(max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=8, lr_decay_steps=40, lr_decay_style="cosine",
                    start_wd=0.1, end_wd=0.1)
    requested = {**in_force, "max_lr": 1e-3, "start_wd": 0.0, "end_wd": 0.0}
    line = schedule_line(in_force, requested, override=False, global_batch_size=GBS, train_iters=10)
    assert "not used from this command line: --lr, --weight-decay (" in line, line
    assert "--weight-decay" not in schedule_line(in_force, in_force, override=False, global_batch_size=GBS,
                                                 train_iters=10)


def _report(policy_path, pp: int = 2) -> str:
    from agoq.policy import ScheduleInfo
    from agoq.policy.load import load_policy
    from agoq.policy.resolve import model_sites, policy_table, to_json

    spec = load_policy(policy_path)
    schedule = ScheduleInfo(pp_size=pp, vp_size=None, num_microbatches=8)
    return to_json(policy_table(spec, model_sites(4, schedule), schedule), spec, schedule)


def test_policy_note_ignores_the_policy_files_path_and_names_a_changed_table(tmp_path):
    """The saved report holds the policy file's path; the same table read from a checkout at another path (another
    node's mount, a moved folder) is no difference (it printed a note on every such resume); another table is."""
    import shutil
    from pathlib import Path

    from agoq.megatron.ckpt.resume import policy_note

    policies = Path(__file__).resolve().parents[2] / "configs" / "policy"
    moved = tmp_path / "elsewhere" / "agoq.yaml"
    moved.parent.mkdir()
    shutil.copy(policies / "agoq.yaml", moved)
    saved, same_elsewhere = _report(policies / "agoq.yaml"), _report(moved)
    assert saved != same_elsewhere  # the path differs in the document
    assert policy_note("ck", saved, same_elsewhere) is None
    note = policy_note("ck", saved, _report(policies / "bf16.yaml"))
    assert note.startswith("ck: the resolved policy table differs from the checkpoint's")
    assert policy_note("ck", saved, _report(moved, pp=1)) is not None  # the same file, another stage layout
