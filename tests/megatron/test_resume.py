"""Checkpoint resume (issue 18): scripts/pretrain_llama.py under torchrun, 2 CPU ranks, the tiny model.

Pattern: one uninterrupted run per layout/optimizer case (6 iterations, checkpoints at 2, 4 and 6),
cached for the module; each test resumes from a copy of its checkpoints. Resumed losses and learning
rates are compared bit for bit with the uninterrupted run's, read from --log-json (full floats): same
data, weights, optimizer states and RNG states give the same arithmetic.

Covered elsewhere (not repeated here): DP=2 with agoq's distributed optimizer, its DP=1 reload and a
changed --agoq-moments refused by the resume record (tests/megatron/test_dist_optimizer.py); gradient
release, which needs one rank (tests/megatron/test_release.py).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from agoq.testing.procs import (
    PRETRAIN_SCRIPT,
    REPO_ROOT,
    TINY_CONFIG,
    child_env,
    iteration_records,
    run_pretrain,
    torchrun_command,
)

pytestmark = [pytest.mark.megatron, pytest.mark.dist]
ITERATIONS, SAVE_INTERVAL, RESUME_AT = 6, 2, 2  # checkpoints at 2, 4 and 6; resumed at 2
GLOBAL_BATCH = 16  # configs/model/tiny.yaml
WARMUP_ITERS, MIN_LR = 3, 3e-4  # configs/model/tiny.yaml
LR = 1e-2
BASE = ["--config", str(TINY_CONFIG), "--train-iters", str(ITERATIONS), "--lr", str(LR)]
PP2 = ["--pipeline-model-parallel-size", "2"]
ADAMW = ["--agoq-optimizer", "adamw"]
CASES = {
    "pp2-megatron-adam": PP2,
    "pp2-agoq-adamw": PP2 + ADAMW,  # finding 2: never loaded before (param groups of rank 0 only)
    "pp2-vpp2-agoq-adamw": PP2 + ADAMW + ["--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2-megatron-adam-distopt": ["--use-distributed-optimizer"],
    # agoq full under the distributed optimizer with both of Megatron-LM's overlaps: with --overlap-param-gather
    # the updated weights reach the other rank only in the next forward, so the save must gather them first
    # (a checkpoint of stale weights resumes off the uninterrupted run from its first iteration)
    "dp2-agoq-full-distopt-overlap": ADAMW + ["--agoq-grads", "int8_b256", "--use-distributed-optimizer",
                                              "--overlap-grad-reduce", "--overlap-param-gather"],
    "tp2-agoq-adamw": ["--tensor-model-parallel-size", "2"] + ADAMW,
}


class Run(NamedTuple):
    ckpt: Path
    records: dict[int, tuple[float, float]]  # iteration -> (loss, lr)


def _records(log: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["iteration"]: (r["lm_loss"], r["lr"]) for r in rows if "lm_loss" in r}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One data cache for the module: the default corpus and tokenizer are built once."""
    return child_env(AGOQ_CACHE=str(tmp_path_factory.mktemp("agoq_cache")))


@pytest.fixture(scope="module")
def uninterrupted(env, tmp_path_factory):
    """case -> Run: 6 uninterrupted iterations saving at 2, 4, 6 (launched once per module)."""
    runs: dict[str, Run] = {}

    def get(case: str) -> Run:
        if case not in runs:
            out = tmp_path_factory.mktemp(case)
            run_pretrain(2, BASE + CASES[case] + ["--save", str(out / "ckpt"), "--save-interval", str(SAVE_INTERVAL),
                                                  "--log-json", str(out / "log.jsonl")], env=env)  # fmt: skip
            runs[case] = Run(out / "ckpt", _records(out / "log.jsonl"))
            assert sorted(runs[case].records) == list(range(1, ITERATIONS + 1))
        return runs[case]

    return get


def _copy(run: Run, tmp_path: Path, *, latest: int | None = RESUME_AT) -> Path:
    """A private copy of the run's checkpoints; ``latest`` rewrites the tracker (None: keep 6)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run.ckpt, ckpt)
    if latest is not None:
        (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{latest}\n")
    return ckpt


def _resume(env, tmp_path: Path, args: list[str], ckpt: Path, check: bool = True):
    log = tmp_path / "resumed.jsonl"
    proc = run_pretrain(2, args + ["--load", str(ckpt), "--log-json", str(log)], env=env, check=check)
    return proc, (_records(log) if log.exists() else {})


# In the extended tier (pyproject.toml): pp2-megatron-adam (Megatron's Adam resumes through this trainer also in
# dp2-megatron-adam-distopt and through megatron.training in tests/megatron/test_megatron_lm.py) and pp2-agoq-adamw
# (agoq's AdamW split over PP=2's param groups resumes also in pp2-vpp2-agoq-adamw, the same split and more, and in
# test_dist_optimizer.py's PP=2 interleaved run)
EXTENDED_CASES = ("pp2-megatron-adam", "pp2-agoq-adamw")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED_CASES else c
                                  for c in CASES])
@pytest.mark.slow
def test_resume_continues_bit_identically(env, uninterrupted, tmp_path, case):
    """Resumed at iteration 2: iterations 3..6 log the uninterrupted run's losses and lrs bit for bit."""
    full = uninterrupted(case)
    proc, resumed = _resume(env, tmp_path, BASE + CASES[case], _copy(full, tmp_path))
    assert f"at iteration {RESUME_AT}" in proc.stdout
    assert resumed == {i: full.records[i] for i in range(RESUME_AT + 1, ITERATIONS + 1)}
    assert "LR schedule: the checkpoint's" in proc.stdout
    assert "corrupt" not in proc.stdout and "skipping" not in proc.stdout
    assert full.records[ITERATIONS][0] < full.records[1][0] - 0.2  # it trains (a lost update stays flat)


@pytest.mark.slow
def test_unreadable_newest_checkpoints_fall_back_and_a_new_lr_keeps_the_checkpoint_schedule(
        env, uninterrupted, tmp_path):
    """Findings 3, 4a, 4d in one launch (Megatron's Adam, PP=2): iter 6 has a garbage progress file,
    rank 1's shard of iter 4 is truncated (rank 0 reads iter 4 fine), so the job resumes from iter 2;
    the new --lr / --min-lr neither break the load nor apply (the checkpoint's schedule is kept), so
    losses and lrs equal the uninterrupted run's. Before the fix rank 0 applied iter 4's state before
    the ranks agreed, and Megatron's optimizer could not pair param groups under another --lr."""
    full = uninterrupted("pp2-megatron-adam")
    ckpt = _copy(full, tmp_path, latest=None)
    progress = ckpt / "iter_0000006" / "agoq_progress.json"
    progress.write_text("{not json")
    shard = ckpt / "iter_0000004" / "__1_0.distcp"  # written (and read) by rank 1 only: stage 1's tensors
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc, resumed = _resume(env, tmp_path, BASE + PP2 + ["--lr", "3e-3", "--min-lr", "1e-4"], ckpt)
    out = proc.stdout
    assert f"skipping {ckpt / 'iter_0000006'}: {progress}: not valid JSON (" in out
    assert f"skipping {ckpt / 'iter_0000004'}: rank 1: {shard} is truncated (" in out and "(EOFError)" in out
    assert "dict_keys" not in out and "Traceback" not in out  # issue 43: the file and the job's rank, one line
    assert f"resumed from {ckpt} at iteration 2" in out
    assert (f"LR schedule: the checkpoint's (lr {LR:.4g} -> min {MIN_LR:.4g}, cosine, warmup {WARMUP_ITERS} / "
            f"decay {ITERATIONS} iterations); not used from this command line: --lr, --min-lr") in out
    assert resumed == {i: full.records[i] for i in range(3, ITERATIONS + 1)}


def _cosine_lr(iteration: int, max_lr: float, decay_iters: int) -> float:
    """Megatron's schedule (warmup from 0, then cosine to MIN_LR), written out as an independent oracle."""
    step, warmup, decay = iteration * GLOBAL_BATCH, WARMUP_ITERS * GLOBAL_BATCH, decay_iters * GLOBAL_BATCH
    if step <= warmup:
        return max_lr * step / warmup
    ratio = (step - warmup) / (decay - warmup)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - MIN_LR)


@pytest.mark.slow
def test_override_opt_param_scheduler_takes_the_command_line_schedule(env, uninterrupted, tmp_path):
    """Finding 4b (agoq AdamW, PP=2): with --override-opt-param-scheduler a new --lr and a longer
    --train-iters are in force from the resume on (before: silently ignored)."""
    full = uninterrupted("pp2-agoq-adamw")
    args = BASE + CASES["pp2-agoq-adamw"] + ["--lr", "3e-3", "--train-iters", "8", "--override-opt_param-scheduler"]
    proc, resumed = _resume(env, tmp_path, args, _copy(full, tmp_path))
    assert ("LR schedule: the command line's (--override-opt-param-scheduler): lr 0.003 -> min 0.0003, cosine, "
            f"warmup {WARMUP_ITERS} / decay 8 iterations") in proc.stdout
    assert sorted(resumed) == list(range(3, 9))
    for iteration, (_, lr) in resumed.items():
        assert lr == pytest.approx(_cosine_lr(iteration, 3e-3, 8), rel=1e-12), iteration
    assert resumed[3][0] == full.records[3][0]  # the loss before the first resumed update: same weights
    assert resumed[4][0] != full.records[4][0]  # the new lr moved the weights


def test_settings_the_checkpoint_cannot_serve_stop_before_training(env, uninterrupted, tmp_path):
    """Finding 4c: a PP=2 Megatron-Adam checkpoint loaded with PP=1 and agoq's AdamW stops before any
    tensor is read, naming each setting with its saved and requested value and the fix; no "corrupt",
    no fallback (every setting is compared, so one launch checks both)."""
    full = uninterrupted("pp2-megatron-adam")
    args = BASE + PP2 + ADAMW + ["--pipeline-model-parallel-size", "1"]
    proc, _ = _resume(env, tmp_path, args, full.ckpt, check=False)
    assert proc.returncode != 0
    assert f"checkpoint {full.ckpt / 'iter_0000006'} cannot be resumed with this run's settings" in proc.stderr
    assert "--pipeline-model-parallel-size: saved 2, requested 1" in proc.stderr, proc.stderr[-3000:]
    assert "--agoq-optimizer: saved 'torch', requested 'adamw'" in proc.stderr
    assert ("Fix: resume with --pipeline-model-parallel-size 2, --agoq-optimizer torch; or start a new run "
            "without --load") in proc.stderr
    assert "corrupt" not in proc.stdout + proc.stderr and "skipping" not in proc.stdout
    assert iteration_records(proc.stdout) == []


@pytest.mark.slow
def test_sigterm_saves_and_the_resumed_run_continues_the_same_losses(env, uninterrupted, tmp_path):
    """SIGTERM to torchrun mid-run: the ranks finish the iteration, save and exit; resuming gives the
    losses of the uninterrupted run (issue 8)."""
    full = uninterrupted("pp2-megatron-adam")
    ckpt = tmp_path / "ckpt"
    saving = BASE + PP2 + ["--save", str(ckpt), "--save-interval", "100"]  # only the signal triggers a save
    proc = subprocess.Popen(torchrun_command(2, PRETRAIN_SCRIPT, saving), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)  # fmt: skip
    seen = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("iteration      2/"):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(seen[-50:])
    output = "".join(seen) + proc.communicate(timeout=120)[0]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < ITERATIONS, output[-3000:]
    assert f"iter_{saved:07d}" in output and "stopping at iteration" in output
    _, resumed = _resume(env, tmp_path, BASE + PP2, ckpt)
    assert resumed == {i: full.records[i] for i in range(saved + 1, ITERATIONS + 1)}


# ------------------------------------------------------------------------------ in-process (no launch)
def _record(**changes):
    """A run record (agoq.megatron.ckpt.resume.run_record) of the tiny model; ``changes``: flag values, or the
    layout's ``pipeline_parallel`` / ``virtual_pipeline``."""
    from types import SimpleNamespace

    from agoq.config import AgoqConfig
    from agoq.megatron.ckpt.resume import run_record

    model = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=192,
                 vocab_size=32768, seq_length=128, rotary_base=10000, norm_epsilon=1e-5, rope_scaling=False,
                 rope_scaling_factor=8.0, share_embeddings_and_output_weights=False, unpadded_vocab_size=32000)
    model.update({k: changes.pop(k) for k in list(changes) if k in model})
    shape = SimpleNamespace(**model)
    layout = dict(tensor_parallel=1, pipeline_parallel=2, virtual_pipeline=None, distributed_optimizer=False)
    layout.update({k: changes.pop(k) for k in list(changes) if k in layout})
    flags = {"agoq_optimizer": "adamw", "agoq_moments": "flash", **changes}
    return run_record(AgoqConfig.from_flags(flags), shape=shape, **layout)


def test_resume_record_allows_what_the_checkpoint_serves_and_names_what_it_does_not():
    from agoq.megatron.ckpt.resume import RECORD_KEY, ResumeMismatch, check_contract

    saved = {RECORD_KEY: _record()}
    assert check_contract("ck", saved, _record()) == []
    assert "predates agoq's resume record" in check_contract("ck", {}, _record())[0]
    notes = check_contract("ck", saved, _record(agoq_grads="int8_b256"))
    assert notes == ["ck: --agoq-grads changed since the checkpoint (saved None, now 'int8_b256'); allowed, the "
                     "checkpoint's tensors do not depend on it"]  # fmt: skip
    # the config's other keys: allowed, reported by their flag; runtime keys: silent
    assert check_contract("ck", saved, _record(agoq_smooth_swiglu="per-token")) == [
        "ck: --agoq-smooth-swiglu changed since the checkpoint (saved 'off', now 'per-token'); allowed, the "
        "checkpoint's tensors do not depend on it"]  # fmt: skip
    assert check_contract("ck", saved, _record(agoq_device="cpu", agoq_unfused=True)) == []
    assert check_contract("ck", saved, _record(agoq_moments="cint8_b32,cuint8_b32")) == []  # = flash
    with pytest.raises(ResumeMismatch) as err:
        check_contract("ck", saved, _record(agoq_moments="bf16", virtual_pipeline=2, pipeline_parallel=1))
    text = str(err.value)
    assert "--agoq-moments: saved 'cint8_b32,cuint8_b32', requested 'bf16,bf16'" in text
    assert "--pipeline-model-parallel-size: saved 2, requested 1" in text
    assert ("Fix: resume with --pipeline-model-parallel-size 2, without --num-layers-per-virtual-pipeline-stage, "
            "--agoq-moments flash; or start a new run without --load") in text
    with pytest.raises(ResumeMismatch, match="--agoq-optimizer: saved 'adamw', requested 'torch'") as err:
        check_contract("ck", saved, _record(agoq_optimizer="torch"))
    assert "--agoq-moments" not in str(err.value)  # follows from the optimizer kind


def test_the_whole_model_shape_is_recorded_and_checked():
    """Issue 42: RoPE base / scaling, norm epsilon and tying are recorded; tying stops a load (other tensors), the
    others are allowed and reported; records saved before these fields (None) are not compared."""
    from agoq.megatron.ckpt.resume import RECORD_KEY, ResumeMismatch, check_contract

    saved = {RECORD_KEY: _record()}
    assert saved[RECORD_KEY]["model"]["rotary_base"] == 10000
    assert check_contract("ck", saved, _record(rotary_base=500000, rope_scaling=True)) == [
        f"ck: {flag} changed since the checkpoint (saved {old}, now {new}); allowed, the checkpoint's tensors do not "
        "depend on it" for flag, old, new in (("--rotary-base", 10000, 500000), ("--use-rope-scaling", False, True))]
    assert check_contract("ck", saved, _record(rope_scaling_factor=32.0, unpadded_vocab_size=32001)) == []
    with pytest.raises(ResumeMismatch, match=r"tied embeddings \(--tie-embeddings-and-output-weights\): saved False, "
                                             r"requested True[\s\S]*Fix: resume with --untie-embeddings-and-output"):
        check_contract("ck", saved, _record(share_embeddings_and_output_weights=True))
    older = _record()
    older["model"] = {k: v for k, v in older["model"].items() if k not in ("rotary_base", "rope_scaling")}
    assert check_contract("ck", {RECORD_KEY: older}, _record(rotary_base=500000, rope_scaling=True)) == []


def test_flat_contract_of_older_and_converted_checkpoints_is_checked_by_its_keys():
    from agoq.megatron.ckpt.resume import CONTRACT_KEY, ResumeContract, ResumeMismatch, check_contract

    flat = ResumeContract.from_record(_record()).as_dict()  # what checkpoints saved before the record
    assert check_contract("ck", {CONTRACT_KEY: dict(flat, future_setting=1)}, _record()) == []
    shape_only = {k: flat[k] for k in ("num_layers", "hidden_size", "vocab_size")}  # a converted checkpoint
    assert check_contract("ck", {CONTRACT_KEY: shape_only}, _record(agoq_optimizer="lion")) == []
    with pytest.raises(ResumeMismatch, match="--hidden-size: saved 64, requested 128"):
        check_contract("ck", {CONTRACT_KEY: dict(shape_only, hidden_size=64)},
                       {**_record(), "model": {**_record()["model"], "hidden_size": 128}})


def test_every_config_key_is_classified_for_resume():
    """A new AgoqConfig field must be placed: in the contract (stops a load when changed), allowed and
    reported, or runtime (silent)."""
    from agoq.megatron.ckpt.resume import CONFIG_IN_CONTRACT, CONFIG_MAY_CHANGE, CONFIG_RUNTIME, config_keys

    keys = set(config_keys(_record()["agoq"]))
    classified = [*CONFIG_IN_CONTRACT, *CONFIG_MAY_CHANGE, *CONFIG_RUNTIME]
    assert len(classified) == len(set(classified))
    assert keys == set(classified)


def test_override_flag_accepts_megatron_lms_spelling(tmp_path):
    from agoq.train.args import parse_args

    load = ["--load", str(tmp_path)]  # without --load the flag is an error (tests/unit/test_args_mistakes.py)
    assert parse_args(["--override-opt_param-scheduler", *load]).override_opt_param_scheduler
    assert parse_args(["--override-opt-param-scheduler", *load]).override_opt_param_scheduler
    assert not parse_args([]).override_opt_param_scheduler
