"""Issue 43, in-process (no torch launch): what --load means and what --save may be written over
(agoq.train.ckpt_guard), the --save lock (agoq.train.save_lock), the free-space check, and the
messages of finding 5 that need no checkpoint (tokenizer.json, non-finite flag values). The trainer runs of the
same rules: tests/megatron/test_ckpt_safety.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agoq.megatron.ckpt.ckpt_files import PROGRESS_FILE, TRACKER_FILE
from agoq.train import ckpt_guard, save_lock
from agoq.train.ckpt_guard import CheckpointRefusal, resolve_load


def _checkpoints(folder: Path, complete=(2, 4), incomplete=(), tracker: str | None = "4") -> Path:
    for it in (*complete, *incomplete):
        (folder / f"iter_{it:07d}").mkdir(parents=True)
        (folder / f"iter_{it:07d}" / "__0_0.distcp").write_bytes(b"x")
    for it in complete:
        (folder / f"iter_{it:07d}" / PROGRESS_FILE).write_text(json.dumps({"iteration": it, "consumed_samples": 0}))
    if tracker is not None:
        (folder / TRACKER_FILE).write_text(tracker + "\n")
    return folder


# ------------------------------------------------------------------------------------------- finding 1: --load
def test_a_tracker_folder_loads_its_latest_and_an_iteration_folder_exactly_that_iteration(tmp_path):
    ck = _checkpoints(tmp_path / "ck")
    assert resolve_load(str(ck), str(ck)) == ckpt_guard.LoadTarget(ck, None, "")
    pinned = resolve_load(str(ck / "iter_0000004"), str(ck))
    assert (pinned.folder, pinned.iteration) == (ck, 4)
    assert pinned.note.startswith(f"--load {ck / 'iter_0000004'}: an iteration folder: loading iteration 4 of {ck}")
    assert (resolve_load(str(ck / "iter_0000002"), None).iteration) == 2  # without --save: loads, no fresh start


def test_iteration_folders_without_a_usable_tracker_stop_naming_the_newest_complete_one(tmp_path):
    ck = _checkpoints(tmp_path / "ck", complete=(2, 4), incomplete=(6,), tracker=None)
    with pytest.raises(CheckpointRefusal) as err:
        resolve_load(str(ck), str(ck))
    text = str(err.value)
    assert "holds checkpoints (iter_0000002, iter_0000004) but no usable tracker" in text
    assert f"resume it with --load {ck / 'iter_0000004'}" in text
    (ck / TRACKER_FILE).write_text("four\n")
    with pytest.raises(CheckpointRefusal, match=r"expected an iteration number, found 'four'.*--load .*iter_0000004"):
        resolve_load(str(ck), None)
    with pytest.raises(CheckpointRefusal, match="no such iteration folder; complete checkpoints in .*iter_0000004"):
        resolve_load(str(ck / "iter_0000008"), None)
    with pytest.raises(CheckpointRefusal, match="save did not complete"):
        resolve_load(str(ck / "iter_0000006"), None)


def test_a_fresh_start_only_where_neither_load_nor_save_holds_a_checkpoint(tmp_path):
    empty, ck = tmp_path / "new", _checkpoints(tmp_path / "ck")
    fresh = resolve_load(str(empty), str(empty))
    assert fresh.folder is None and fresh.note == f"--load {empty}: no checkpoint yet, starting from scratch"
    assert resolve_load(None, None).folder is None
    only_interrupted = _checkpoints(tmp_path / "interrupted", complete=(), incomplete=(2,), tracker=None)
    assert resolve_load(str(only_interrupted), str(only_interrupted)).folder is None  # a save that never finished
    for load in (None, str(empty)):  # --save holds checkpoints this run would not load
        with pytest.raises(CheckpointRefusal, match=f"--save {ck}: holds checkpoints .*Resume them with --load {ck}"):
            resolve_load(load, str(ck))
    with pytest.raises(CheckpointRefusal, match="of another run than the one loaded"):
        resolve_load(str(_checkpoints(tmp_path / "other")), str(ck))
    # --allow-fresh-start: --load's checkpoints are not read; --save's are still never written over
    skipped = resolve_load(str(ck), str(empty), allow_fresh_start=True)
    assert skipped.folder is None and "--allow-fresh-start" in skipped.note
    with pytest.raises(CheckpointRefusal, match="would write over"):
        resolve_load(str(ck), str(ck), allow_fresh_start=True)


def test_each_trainer_refuses_the_others_checkpoints_by_name(tmp_path):
    """Checkpoint interop: megatron.training (the door) and scripts/pretrain_llama.py write different layouts; each
    refuses the other's folder, naming the trainer that wrote it, before anything is read."""
    from agoq.train.megatron_lm import RefusedFlags, refuse_agoq_trainer_checkpoint

    megatron = _checkpoints(tmp_path / "megatron", complete=(), incomplete=(2, 4))  # a tracker, no progress records
    with pytest.raises(CheckpointRefusal, match=r"iter_0000004 was written by megatron\.training .*python -m "
                                                r"agoq\.megatron_lm"):
        resolve_load(str(megatron), None)
    agoq = _checkpoints(tmp_path / "agoq")
    for load in (agoq, agoq / "iter_0000004"):
        with pytest.raises(RefusedFlags, match=r"written by agoq's own trainer .*scripts/pretrain_llama\.py --load"):
            refuse_agoq_trainer_checkpoint(str(load))
    refuse_agoq_trainer_checkpoint(str(megatron))  # megatron.training's own folder passes
    refuse_agoq_trainer_checkpoint(None)
    # an agoq folder whose newest save was interrupted is still agoq's: resolved as before, not called foreign
    mixed = _checkpoints(tmp_path / "mixed", complete=(2,), incomplete=(4,), tracker="4")
    assert resolve_load(str(mixed), str(mixed)).folder == mixed


def test_newer_checkpoints_than_the_loaded_one_are_never_written_over(tmp_path):
    ck = _checkpoints(tmp_path / "ck", complete=(2, 4, 6), tracker="6")
    ckpt_guard.check_overwrite(str(ck), ck, 6)
    ckpt_guard.check_overwrite(str(tmp_path / "elsewhere"), ck, 2)  # saving elsewhere: nothing to write over
    with pytest.raises(CheckpointRefusal) as err:
        ckpt_guard.check_overwrite(str(ck), ck, 2)  # --load ck/iter_0000002, or a fallback past 4 and 6
    assert "holds newer checkpoints than the loaded iteration 2 (iter_0000004, iter_0000006)" in str(err.value)
    assert f"--load {ck / 'iter_0000006'}" in str(err.value)


# ------------------------------------------------------------------------------------------- finding 2: the lock
def _holder(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_lock_names_its_holder_to_a_second_job_and_is_released(tmp_path):
    first = save_lock.SaveLock(tmp_path, {"SLURM_JOB_ID": "4242"}).acquire()
    lock = tmp_path / save_lock.LOCK_FILE
    assert _holder(lock)["pid"] == os.getpid() and _holder(lock)["slurm_job_id"] == "4242"
    with pytest.raises(save_lock.SaveLocked) as err:
        save_lock.SaveLock(tmp_path, {}).acquire()
    assert f"another job is using this folder (pid {os.getpid()} on host {socket.gethostname()}, Slurm job 4242" in \
        str(err.value)
    assert "--force-unlock" in str(err.value)
    other = save_lock.SaveLock(tmp_path, {})
    other.release()  # not its lock: left alone
    assert lock.exists()
    first.release()
    assert not lock.exists() and list(tmp_path.iterdir()) == []  # no temporary files left either
    save_lock.SaveLock(tmp_path, {}).acquire().release()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _foreign_lock(folder: Path, *, host: str, pid: int, age_s: float = 0.0) -> Path:
    lock = folder / save_lock.LOCK_FILE
    lock.write_text(json.dumps({"host": host, "pid": pid, "started": time.time() - age_s, "slurm_job_id": None,
                                "token": "f" * 32}))
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_dead_holder_on_this_host_is_reported_and_taken_over(tmp_path):
    pid = _dead_pid()
    _foreign_lock(tmp_path, host=socket.gethostname(), pid=pid)
    lock = save_lock.SaveLock(tmp_path, {}).acquire()
    assert len(lock.notes) == 1 and f"took over the lock of pid {pid} on host {socket.gethostname()}" in lock.notes[0]
    assert lock.notes[0].endswith(f"stale, its process {pid} no longer runs on this host")
    assert _holder(tmp_path / save_lock.LOCK_FILE)["pid"] == os.getpid()
    lock.release()


def test_another_hosts_lock_is_stale_only_after_its_heartbeat_stopped(tmp_path):
    _foreign_lock(tmp_path, host="node-17", pid=1, age_s=60)
    with pytest.raises(save_lock.SaveLocked, match="pid 1 on host node-17"):
        save_lock.SaveLock(tmp_path, {}).acquire()
    _foreign_lock(tmp_path, host="node-17", pid=1, age_s=save_lock.STALE_AFTER_S + 5)
    lock = save_lock.SaveLock(tmp_path, {}).acquire()
    assert "its heartbeat stopped" in lock.notes[0] and "node-17" in lock.notes[0]
    lock.release()
    _foreign_lock(tmp_path, host="node-17", pid=1, age_s=1)
    forced = save_lock.SaveLock(tmp_path, {}).acquire(force=True)
    assert "removed by --force-unlock" in forced.notes[0]
    forced.release()


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(save_lock, "HEARTBEAT_S", 0.05)
    lock = save_lock.SaveLock(tmp_path, {}).acquire()
    path = tmp_path / save_lock.LOCK_FILE
    os.utime(path, (1.0, 1.0))
    deadline = time.time() + 5
    while path.stat().st_mtime < 2.0 and time.time() < deadline:
        time.sleep(0.05)
    lock.release()
    assert time.time() - path.stat().st_mtime < 60 if path.exists() else True
    assert deadline - time.time() > 0, "the heartbeat did not refresh the lock's mtime"


def test_the_lock_is_created_atomically_without_flock(tmp_path):
    """Six processes race for one folder while the winner holds it: exactly one wins (os.link / O_EXCL, no
    flock), the others are refused naming it."""
    code = ("import sys, time; from agoq.train.save_lock import SaveLock, SaveLocked\n"
            "try:\n    lock = SaveLock(sys.argv[1], {}).acquire(); print('won', flush=True); time.sleep(4); "
            "lock.release()\nexcept SaveLocked:\n    print('lost')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(6)]
    outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outcomes == ["lost"] * 5 + ["won"]
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- finding 4: save targets
def test_a_save_path_that_is_a_file_or_cannot_be_created_is_refused(tmp_path):
    file = tmp_path / "ckpt"
    file.write_text("not a folder")
    with pytest.raises(CheckpointRefusal, match=f"--save {file}: is a file, not a folder"):
        ckpt_guard.check_save_folder(str(file))
    with pytest.raises(CheckpointRefusal, match=r"cannot create the folder \(ENOTDIR 20: Not a directory"):
        ckpt_guard.check_save_folder(str(file / "sub"))
    ckpt_guard.check_save_folder(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()


def test_free_space_must_hold_the_predicted_checkpoint(tmp_path, monkeypatch):
    from agoq.config import AgoqConfig

    torch_adam = ckpt_guard.optimizer_state_bytes_per_param(AgoqConfig.from_flags({}), fp32_params=False)
    flash = ckpt_guard.optimizer_state_bytes_per_param(AgoqConfig.from_flags({"agoq_optimizer": "adamw"}), False)
    assert torch_adam == 12.0 and flash == pytest.approx(3.125)  # tests/megatron/test_ckpt_bytes.py
    needed = ckpt_guard.predicted_checkpoint_bytes(10**9, weight_bytes=2, optimizer_bytes_per_param=12.0)
    assert 14 * 10**9 < needed < 15 * 10**9
    usage = type("Usage", (), {"free": needed - 1, "total": 10 * needed, "used": 0})
    monkeypatch.setattr(ckpt_guard.shutil, "disk_usage", lambda _: usage)
    with pytest.raises(CheckpointRefusal, match=r"GiB free, a checkpoint of this run takes about 13\.\d+ GiB .* not "
                                                r"enough for one checkpoint"):
        ckpt_guard.check_free_space(str(tmp_path), needed)
    usage.free = needed
    assert "GiB free" in ckpt_guard.check_free_space(str(tmp_path), needed)


# ----------------------------------------------------------------------------------------- finding 5: messages
def test_a_broken_tokenizer_json_is_reported_as_json(tmp_path):
    from agoq.data.tokenizer import Tokenizer

    broken = tmp_path / "tokenizer.json"
    broken.write_text('{\n  "model": {"type": "BPE",\n  "added_tokens": [\n')
    with pytest.raises(ValueError) as err:
        Tokenizer.load(broken)
    assert str(err.value).startswith(f"{broken}:4:1: invalid JSON (Expecting value)"), err.value
    assert "SentencePiece" not in str(err.value)
    other = tmp_path / "config.json"
    other.write_text('{"vocab_size": 10}')
    with pytest.raises(ValueError, match="valid JSON, but not a Hugging Face tokenizers file"):
        Tokenizer.load(other)


@pytest.mark.parametrize("flag, value", [("--lr", "nan"), ("--min-lr", "inf"), ("--clip-grad", "-inf")])
def test_a_non_finite_flag_value_is_named_without_self_defeating_advice(capsys, flag, value):
    from agoq.train.args import parse_args

    with pytest.raises(SystemExit):
        parse_args([f"{flag}={value}"])
    err = capsys.readouterr().err
    assert f"error: {flag} {value}: must be a finite number" in err, err
    assert "nan" not in err.split("finite number")[1].replace("not nan or inf", "")
