"""Read a Weights & Biases offline run file (``WANDB_MODE=offline``: ``<dir>/wandb/offline-run-*/run-*.wandb``) for
tests: its history rows and config updates. The file is wandb's record log (a LevelDB-style log: a 7-byte header
``:W&B`` + magic + version, then 32 KiB blocks of records with a 7-byte header each, CRC32 / length / type, a record
split over blocks as FIRST, MIDDLE..., LAST); each record is a ``wandb_internal_pb2.Record``. wandb 0.31 ships no
Python reader (its core writes the file), hence this one; the CRCs are not checked."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_file(save_dir: str | Path, timeout_s: float = 30.0) -> Path:
    """The one offline run file under ``save_dir`` (wandb's ``dir``), once complete: ``run.finish()`` can return
    before wandb's service has written a second run of the same process (seen with wandb 0.31: 7 bytes, the
    header, right after finish; complete a moment later), so this waits for the run's ``exit`` record."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(Path(save_dir).glob("wandb/offline-run-*/run-*.wandb"))
        if len(files) > 1:
            raise AssertionError(f"expected one offline run file under {save_dir}, found {files}")
        if files and any(r.WhichOneof("record_type") == "exit" for r in records(files[0])):
            return files[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no complete offline run file under {save_dir} after {timeout_s} s: {files}")
        time.sleep(0.1)


def records(path: str | Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run file (header {data[:HEADER]!r})")
    pos, buf = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:  # zero padding
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        buf = chunk if kind in (FULL, FIRST) else buf + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def history(path: str | Path) -> list[dict]:
    """The logged rows, values decoded from JSON, wandb's own keys (``_step``, ``_runtime``, ...) kept."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def config_updates(path: str | Path) -> dict:
    """The run config as written: the run record's initial config, then every config update, merged."""
    out = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        out.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return out


def run_names(path: str | Path) -> tuple[str, str]:
    """(project, display name) of the run."""
    run = next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
    return run.project, run.display_name
