"""runtime.shutdown on the way out of an exception (agoq/megatron/runtime.py): NCCL process groups are not
destroyed (ncclCommDestroy waits for peers that may be stuck in a receive, so the failing rank would never exit
and the launcher never stop the job); gloo's local teardown still runs; a clean exit destroys both. The
process-group calls are replaced by recorders: no group is created."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.megatron]


@pytest.fixture
def calls(monkeypatch):
    from agoq.megatron import runtime

    made: list[str] = []
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime.dist, "destroy_process_group", lambda: made.append("destroy_process_group"))
    monkeypatch.setattr(runtime.parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(runtime.parallel_state, "destroy_model_parallel", lambda: made.append("destroy_model_parallel"))
    return made


@pytest.mark.parametrize("backend, after_error, destroyed", [
    ("nccl", True, False), ("nccl", False, True), ("gloo", True, True), ("gloo", False, True)])
def test_nccl_groups_are_left_to_the_process_exit_after_an_error(calls, monkeypatch, backend, after_error, destroyed):
    from agoq.megatron import runtime

    monkeypatch.setattr(runtime.dist, "get_backend", lambda group=None: backend)
    runtime.shutdown(after_error=after_error)
    assert calls == (["destroy_model_parallel", "destroy_process_group"] if destroyed else [])


def test_the_trainer_tears_down_as_failed_when_the_job_raises(monkeypatch):
    """pretrain() passes after_error=True when its run raises, False when it returns."""
    from agoq.train import pretrain as trainer

    seen = []
    # pretrain() installs its stop handlers and ignores SIGUSR1 on the way out: here that would stay in the
    # pytest worker, and a bash started later with SIGUSR1 ignored cannot trap it (the slurm dry-run tests failed)
    monkeypatch.setattr(trainer.signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(trainer.runtime, "shutdown", lambda after_error=False: seen.append(after_error))
    monkeypatch.setattr(trainer.runtime, "init_distributed", lambda device, launch: None)
    monkeypatch.setattr(trainer.runtime, "choose_device", lambda device, local_rank: "cpu")
    monkeypatch.setattr(trainer, "install", lambda config: None)
    # the --save / --load start-up checks are tests/unit/test_ckpt_guard.py's; here only the teardown flag matters
    monkeypatch.setattr(trainer.CheckpointGuard, "start", classmethod(lambda cls, args: type("G", (), {
        "release": lambda self: None})()))

    class Args:
        agoq_config = type("C", (), {"device": "cpu"})()

    def boom(*a, **k):
        raise RuntimeError("a rank-local failure")

    monkeypatch.setattr(trainer, "_run", boom)
    with pytest.raises(RuntimeError, match="rank-local"):
        trainer.pretrain(Args(), None, None, None, None, None)
    monkeypatch.setattr(trainer, "_run", lambda *a, **k: None)
    trainer.pretrain(Args(), None, None, None, None, None)
    assert seen == [True, False]
