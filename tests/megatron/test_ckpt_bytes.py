"""Optimizer checkpoint bytes per parameter on disk (agoq.testing.ckpt_bytes), tiny model, CPU, DP = 2:
Megatron's Adam (distributed optimizer: fp32 main params + m + v) vs agoq's FlashAdamW with and
without the distributed optimizer. An accounting of bytes written by torch_dist, not a GPU timing.
The measured numbers are in docs/numerics.md (the test prints them: pytest -s)."""

from __future__ import annotations

import json

import pytest

from agoq.testing.ckpt_bytes import checkpoint_bytes
from agoq.testing.procs import TINY_CONFIG, child_env, run_pretrain

pytestmark = [pytest.mark.megatron, pytest.mark.dist, pytest.mark.slow]

TINY = ["--config", str(TINY_CONFIG), "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "2",
        "--exit-interval", "1"]  # fmt: skip
RUNS = {
    "megatron_adam_distopt": ["--use-distributed-optimizer"],
    "agoq_adamw_distopt": ["--agoq-optimizer", "adamw", "--use-distributed-optimizer"],
    "agoq_adamw": ["--agoq-optimizer", "adamw"],
}
# FlashAdamW: int8 remainder (1) + two 8-bit moments with an fp16 scale per 32 (2 x 1.0625) = 3.125
FLASH_STATE_BYTES = 3.125
MEGATRON_ADAM_STATE_BYTES = 12.0  # fp32 main param + exp_avg + exp_avg_sq


def test_optimizer_checkpoint_bytes_per_param(tmp_path, agoq_cache):
    env = child_env(AGOQ_CACHE=str(agoq_cache))
    sizes = {}
    for name, extra in RUNS.items():
        ckpt = tmp_path / name
        run_pretrain(2, TINY + extra + ["--save", str(ckpt)], env=env)
        sizes[name] = checkpoint_bytes(str(ckpt / "iter_0000001"))
    print(json.dumps(sizes, indent=1))
    params = {s["model_params"] for s in sizes.values()}
    assert len(params) == 1
    mega = sizes["megatron_adam_distopt"]
    assert mega["optimizer_tensor_bytes_per_param"] == pytest.approx(MEGATRON_ADAM_STATE_BYTES, rel=0.02)
    for name in ("agoq_adamw_distopt", "agoq_adamw"):
        s = sizes[name]
        # small tensors (norm gains: < 0.1 % of params) keep fp32 states and an int16 remainder
        assert FLASH_STATE_BYTES <= s["optimizer_tensor_bytes_per_param"] < FLASH_STATE_BYTES + 0.05, name
        assert s["optimizer_bytes"] < 0.35 * mega["optimizer_bytes"], name
    # the distributed layout saves the same global tensors as the non-distributed one
    assert sizes["agoq_adamw_distopt"]["optimizer_tensor_bytes"] == sizes["agoq_adamw"]["optimizer_tensor_bytes"]


def test_mid_run_save_does_not_touch_the_live_optimizer_state(tmp_path, agoq_cache):
    """A --save-interval save (non-distributed agoq optimizer) used to pop "step" from the live states
    (torch's state_dict() returns them by reference): the next step raised KeyError. Losses after the
    save equal a run without saves."""
    env = child_env(AGOQ_CACHE=str(agoq_cache))
    args = ["--config", str(TINY_CONFIG), "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "3",
            "--agoq-optimizer", "adamw"]  # fmt: skip
    from agoq.testing.procs import iteration_records

    saved = iteration_records(run_pretrain(1, args + ["--save", str(tmp_path / "c"), "--save-interval", "1"],
                                           env=env).stdout)  # fmt: skip
    plain = iteration_records(run_pretrain(1, args, env=env).stdout)
    assert [r["loss"] for r in saved] == [r["loss"] for r in plain] and len(plain) == 3
