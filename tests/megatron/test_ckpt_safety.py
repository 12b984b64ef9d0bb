"""Issue 43, "never lose a checkpoint": scripts/pretrain_llama.py under torchrun on CPU (gloo), the tiny model.

One uninterrupted 1-rank run (6 iterations, checkpoints at 2, 4, 6) is shared by the module; each test works on a
copy. Findings: 1 --load of an iteration folder, 2 a second job on one --save folder, 3 a changed --seed,
4 save targets (a file, a save that fails on one rank), 5 a damaged shard named by file. The rules themselves,
in-process: tests/unit/test_ckpt_guard.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from agoq.testing.procs import TINY_CONFIG, child_env, iteration_records, run_pretrain

pytestmark = [pytest.mark.megatron, pytest.mark.dist]
BASE = ["--config", str(TINY_CONFIG), "--train-iters", "6", "--lr", "1e-2"]
LOCK = "agoq_save.lock"
SHORT = ["--train-iters", "3", "--lr-decay-iters", "6"]  # one iteration after a resume at 2, the same LR schedule


def _records(log: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return child_env(AGOQ_CACHE=str(tmp_path_factory.mktemp("agoq_cache")))


@pytest.fixture(scope="module")
def trained(env, tmp_path_factory):
    """(checkpoint folder, iteration -> loss) of 6 uninterrupted iterations saving at 2, 4, 6."""
    out = tmp_path_factory.mktemp("trained")
    proc = run_pretrain(1, BASE + ["--save", str(out / "ckpt"), "--save-interval", "2", "--log-json",
                                   str(out / "log.jsonl")], env=env)
    assert not (out / "ckpt" / LOCK).exists(), "the --save lock outlived its job"
    assert "starting from scratch" not in proc.stdout  # no --load: nothing to say
    return out / "ckpt", _records(out / "log.jsonl")


def _copy(ckpt: Path, tmp_path: Path, *, latest: int, keep=(2, 4, 6)) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    for path in copy.glob("iter_*"):
        if int(path.name[5:]) not in keep:
            shutil.rmtree(path)
    (copy / "latest_checkpointed_iteration.txt").write_text(f"{latest}\n")
    return copy


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.glob("iter_*/**/*")) if p.is_file()}


def test_load_of_an_iteration_folder_loads_it_and_writes_over_nothing(env, trained, tmp_path):
    """Finding 1: ``--load CK/iter_0000004 --save CK`` used to print "no checkpoint yet", train from iteration 1 and
    overwrite iter_2, iter_4 and the tracker. Now it loads iteration 4 and says so, continues with the
    uninterrupted run's losses, and the existing iter_* files stay byte for byte; loading the older iteration 2
    into the same --save (iter_4 would be written over) stops before training."""
    ckpt, full = trained
    ck = _copy(ckpt, tmp_path, latest=4, keep=(2, 4))
    before = _hashes(ck)
    log = tmp_path / "resumed.jsonl"
    proc = run_pretrain(1, BASE + ["--load", str(ck / "iter_0000004"), "--save", str(ck), "--save-interval", "2",
                                   "--log-json", str(log)], env=env)
    out = proc.stdout
    assert f"--load {ck / 'iter_0000004'}: an iteration folder: loading iteration 4 of {ck}" in out
    assert f"resumed from {ck} at iteration 4" in out and "starting from scratch" not in out
    assert _records(log) == {5: full[5], 6: full[6]}
    assert "data order: the checkpoint's (--seed 1234, --split 969,30,1, --data-path the built-in corpus, " \
           "--seq-length 128, --global-batch-size 16)" in out
    after = _hashes(ck)
    assert {k: after[k] for k in before} == before  # iter_2 and iter_4 untouched
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "6\n" and not (ck / LOCK).exists()

    older = run_pretrain(1, BASE + ["--load", str(ck / "iter_0000002"), "--save", str(ck)], env=env, check=False)
    assert older.returncode != 0, older.stderr[-2000:]
    assert "holds newer checkpoints than the loaded iteration 2 (iter_0000004, iter_0000006)" in older.stderr
    assert iteration_records(older.stdout) == [] and _hashes(ck) == after
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "6\n"


def test_a_second_job_on_a_save_folder_stops_naming_the_holder(env, trained, tmp_path):
    """Finding 2: a job holds --save (its lock: this test process, alive on this host); a second job given the same
    folder stops before training, naming the holder, and leaves the checkpoints and the lock alone."""
    ck = _copy(trained[0], tmp_path, latest=6)
    lock = ck / LOCK
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                                "slurm_job_id": "777", "token": "a" * 32}))
    held, before = lock.read_text(), _hashes(ck)
    proc = run_pretrain(1, BASE + ["--load", str(ck), "--save", str(ck)], env=env, check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert (f"--save {ck}: another job is using this folder (pid {os.getpid()} on host {socket.gethostname()}, "
            "Slurm job 777") in proc.stderr
    assert iteration_records(proc.stdout) == [] and "setup done" not in proc.stdout
    assert lock.read_text() == held and _hashes(ck) == before


def test_a_changed_seed_on_resume_is_named_with_its_consequence(env, trained, tmp_path):
    """Finding 3: --seed 99 on a checkpoint saved with 1234 used to resume without a word (and another data order).
    Accepted, as in Megatron-LM, with one line that names the change and what it does."""
    ck = _copy(trained[0], tmp_path, latest=2, keep=(2,))
    proc = run_pretrain(1, BASE + ["--load", str(ck), "--seed", "99", *SHORT], env=env)
    assert ("data order: --seed changed since the checkpoint (saved 1234, now 99): the data order after iteration 2 "
            "changes") in proc.stdout
    assert "resume with --seed 1234 to keep the checkpoint's" in proc.stdout
    assert "data order: the checkpoint's (--split 969,30,1," in proc.stdout


def test_a_save_path_that_is_a_file_stops_before_training(env, tmp_path):
    """Finding 4: --save at a file used to train and then die at the first save with a raw traceback."""
    target = tmp_path / "ckpt"
    target.write_text("a file")
    proc = run_pretrain(1, BASE + ["--save", str(target)], env=env, check=False)
    assert proc.returncode != 0
    assert f"pretrain_llama.py: error: --save {target}: is a file, not a folder" in proc.stderr
    assert iteration_records(proc.stdout) == [] and target.read_text() == "a file"


@pytest.mark.slow
def test_a_save_that_fails_on_one_rank_stops_every_rank_and_keeps_the_tracker(env, tmp_path):
    """Finding 4: a save that fails on rank 1 only (its shard path is taken by a folder: EISDIR; a full disk fails
    the same way) used to end in raw tracebacks. Every rank stops with one line naming the path and the errno; the
    tracker stays on the last complete checkpoint; torchrun returns (no hang)."""
    ck = tmp_path / "ckpt"
    (ck / "iter_0000002" / "__1_0.distcp").mkdir(parents=True)  # an interrupted save's leftover, in the way
    args = ["--config", str(TINY_CONFIG), "--pipeline-model-parallel-size", "2", "--train-iters", "2",
            "--lr-warmup-iters", "1", "--save", str(ck), "--save-interval", "1"]
    proc = run_pretrain(2, args, env=env, check=False, timeout=240)
    assert proc.returncode != 0
    assert f"saving checkpoint {ck / 'iter_0000002'} failed (rank 1: EISDIR" in proc.stderr, proc.stderr[-3000:]
    assert f"{ck / 'latest_checkpointed_iteration.txt'} still names iteration 1" in proc.stderr
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert "pretrain_llama.py\", line" not in proc.stderr and "[rank0]: Traceback" not in proc.stderr
    assert proc.stderr.count("pretrain_llama.py: stopped: saving checkpoint") == 1
    assert not (ck / LOCK).exists()


def test_a_damaged_shard_during_fallback_names_the_file(env, trained, tmp_path):
    """Finding 5: a truncated shard used to be reported as "CheckpointException ranks:dict_keys([0])" and torch's
    traceback; now the file, its size and the error, in one line, and the run falls back."""
    ck = _copy(trained[0], tmp_path, latest=4, keep=(2, 4))
    shard = ck / "iter_0000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run_pretrain(1, BASE + ["--load", str(ck), *SHORT], env=env)
    line = next(x for x in proc.stdout.splitlines() if "skipping" in x)
    assert line.startswith(f"agoq checkpoint: skipping {ck / 'iter_0000004'}: {shard} is truncated (1000 of the ")
    assert "dict_keys" not in proc.stdout and "Traceback" not in proc.stdout
    assert f"resumed from {ck} at iteration 2" in proc.stdout
