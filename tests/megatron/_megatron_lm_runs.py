"""Launching ``megatron.training`` runs on the CPU (tests/megatron/_megatron_lm_cpu.py) and agoq's own trainer beside
them, for tests/megatron/test_megatron_lm.py and tests/megatron/test_megatron_lm_door.py: the tiny model's flags, the
commands, and a runner that returns the exit status, the output and the ``--agoq-log-json`` / ``--log-json`` records.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agoq.testing.procs import REPO_ROOT, child_env, torchrun_command
from tests.megatron._bench_scripts import load_bench_script

DRIVER = REPO_ROOT / "tests" / "megatron" / "_megatron_lm_cpu.py"
SCRIPT = REPO_ROOT / "scripts" / "pretrain_gpt_agoq.py"
SHAPES = REPO_ROOT / "tests" / "megatron" / "_pretrain_gpt_shapes.py"  # Megatron-LM 0.19-shaped pretrain_gpt.py
BENCH = load_bench_script("bench_megatron_lm")

CPU_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
             "--ffn-hidden-size", "192", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "1",
             "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234", "--split", "969,30,1"]
# Megatron-LM flags a LLaMA run needs with agoq on beside the model size (a LLaMA-3 recipe's): Megatron's defaults
# for everything else (its fusions, --persist-layer-norm, --gradient-accumulation-fusion, the data loader's attention
# mask, linear decay, Adam beta2 0.999), no agoq-specific flag
LLAMA_RECIPE_FLAGS = ["--transformer-impl", "local", "--normalization", "RMSNorm", "--swiglu",
                      "--disable-bias-linear", "--position-embedding-type", "rope",
                      "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
                      "--bf16", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1"]
CPU_ONLY = ["--distributed-backend", "gloo", "--use-cpu-initialization", "--inference-rng-tracker"]
PORT_ATTEMPTS = 3  # a free port can be taken by a launch beside this one before the child binds it
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")


@dataclass
class Run:
    returncode: int
    output: str
    records: list[dict] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [r["lm_loss"] for r in self.records if "lm_loss" in r and "iteration" in r]

    def megatron_log_lines(self) -> dict[int, str]:
        """iteration -> the lm loss Megatron's log line prints (its %.6E text)."""
        return {int(m.group(1)): m.group(2) for m in LOG_LINE.finditer(self.output)}


def free_port() -> int:
    with socket.socket() as sock:  # xdist runs other modules' launches beside these: no fixed port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command: list[str], tmp_path: Path, log_name: str | None, env: dict | None = None,
           timeout: int = 400) -> Run:
    """Run ``command`` as rank 0 of a world of one (torchrun's environment), AGOQ_CACHE under ``tmp_path``."""
    for _ in range(PORT_ATTEMPTS):
        run_env = child_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port()), AGOQ_CACHE=str(tmp_path / "cache"), **(env or {}))
        proc = subprocess.run(command, env=run_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        if "EADDRINUSE" not in proc.stderr:
            break
    log = tmp_path / log_name if log_name else None
    records = [json.loads(line) for line in log.read_text().splitlines()] if log and log.exists() else []
    return Run(proc.returncode, proc.stdout + proc.stderr, records)


def launch_ranks(nproc: int, command: list[str], tmp_path: Path, log_name: str, env: dict | None = None,
                 timeout: int = 400) -> Run:
    """Run ``command`` (``[python, SCRIPT, *args]``, as the builders below make it) on ``nproc`` gloo ranks under
    ``torchrun --standalone`` (its own free port), AGOQ_CACHE under ``tmp_path``."""
    _python, script, *args = command
    proc = subprocess.run(torchrun_command(nproc, Path(script), args), cwd=REPO_ROOT, capture_output=True, text=True,
                          env=child_env(AGOQ_CACHE=str(tmp_path / "cache"), **(env or {})), timeout=timeout)
    log = tmp_path / log_name
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Run(proc.returncode, proc.stdout + proc.stderr, records)


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-6000:]
    return run


def megatron_cpu_command(data: dict, tmp_path: Path, log_name: str | None, extra: list[str], *,
                         script: Path = SCRIPT, door: bool = False, equivalence: bool = True) -> list[str]:
    """A megatron.training run on the CPU driver: ``script`` run as __main__, through ``python -m agoq.megatron_lm``
    with ``door``; the flags that make it train as pretrain_llama.py with ``equivalence`` (else Megatron-LM's LLaMA
    recipe flags: Megatron's defaults)."""
    entry = ["-m", "agoq.megatron_lm", str(script)] if door else [str(script)]
    model = [*BENCH.MEGATRON_EQUIVALENCE_FLAGS] if equivalence else [*LLAMA_RECIPE_FLAGS]
    log = ["--agoq-log-json", str(tmp_path / log_name)] if log_name else []
    return [sys.executable, str(DRIVER), *entry, *CPU_FLAGS, "--group-query-attention", "--max-position-embeddings",
            "64", *model, "--data-path", data["prefix"], "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", data["tokenizer"], *CPU_ONLY, "--data-cache-path", str(tmp_path / "mcache"), *log,
            *extra]


def pretrain_llama_command(data: dict, tmp_path: Path, log_name: str, extra: list[str]) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "scripts" / "pretrain_llama.py"), *CPU_FLAGS, "--data-path",
            data["prefix"], "--tokenizer-model", data["tokenizer"], "--data-cache-dir", str(tmp_path / "acache"),
            "--log-json", str(tmp_path / log_name), *extra]
