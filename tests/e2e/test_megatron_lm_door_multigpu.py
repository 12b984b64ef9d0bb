"""The Megatron-LM door on two GPUs (issue 46 item 3): ``torchrun -m agoq.megatron_lm pretrain_gpt.py`` (a
pretrain_gpt.py of megatron.training 0.19's shapes, tests/megatron/_pretrain_gpt_shapes.py, no agoq in it) against
scripts/pretrain_llama.py, agoq full (8-bit gradients, FlashAdamW), the tiny LLaMA on the default dataset, NCCL,
20 iterations, at DP=2 with the distributed optimizer and ``--overlap-grad-reduce`` (as Megatron-LM users run data
parallelism) and at PP=2.

Losses must be the same bits at every iteration, as on one GPU (tests/gpu/test_megatron_lm_gpu.py): both trainers
build the same model, samples and agoq modules and run the same kernels and reductions in the same order. The door's
start-up report must name agoq's layers, DDP and optimizer on the door's side.

Run: ``pytest tests/e2e/test_megatron_lm_door_multigpu.py -m multigpu`` on a machine with 2 GPUs (needs
megatron-core 0.19.2's megatron.training).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.megatron._bench_scripts import load_bench_script, megatron_lm_bench

ITERS = 20
SHAPES = "tests/megatron/_pretrain_gpt_shapes.py"
LAYOUTS = {  # name -> (flags of both trainers, base port, the optimizer class the door's report names)
    "dp2_distopt": (["--use-distributed-optimizer", "--overlap-grad-reduce"], 29800, "AgoqDistributedOptimizer"),
    "pp2": (["--pipeline-model-parallel-size", "2"], 29810, "AgoqMegatronOptimizer"),
}
AGOQ_MODULES = ("AgoqTransformerLayer", "AgoqDistributedDataParallel")


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory):
    return megatron_lm_bench(tmp_path_factory)


def on_two_gpus(command: list[str], script: str | None = None) -> list[str]:
    """A bench_megatron_lm command on 2 processes; ``script``: ``-m agoq.megatron_lm SCRIPT`` in place of the
    command's script (the zero-edit door)."""
    command = list(command)
    command[command.index("--nproc-per-node") + 1] = "2"
    if script is not None:
        at = next(i for i, word in enumerate(command) if word.endswith(".py"))
        command[at:at + 1] = ["-m", "agoq.megatron_lm", script]
    return command


def test_the_commands_run_two_processes_through_the_door():  # CPU: the GPU test's commands are what it says
    bench = load_bench_script("bench_megatron_lm")
    base = bench.megatron_command("tiny", 2, [], {"prefix": "p", "tokenizer": "t"}, "log.jsonl", 1)
    door = on_two_gpus(base, SHAPES)
    assert door[door.index("--nproc-per-node") + 1] == "2"
    assert door[door.index("-m", 2):door.index("-m", 2) + 3] == ["-m", "agoq.megatron_lm", SHAPES]
    assert str(bench.MEGATRON_SCRIPT) not in door and len(door) == len(base) + 2


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_door_trains_as_pretrain_llama_on_two_gpus(bench_env, tmp_path, layout):
    import subprocess

    bench, env, data = bench_env
    flags, port, optimizer = LAYOUTS[layout]
    flags = [*bench.VARIANTS["agoq_full"], *flags]
    door = on_two_gpus(bench.megatron_command("tiny", ITERS, flags, data, tmp_path / "m.jsonl", port), SHAPES)
    own = on_two_gpus(bench.agoq_command("tiny", ITERS, flags, data, tmp_path / "a.jsonl", port + 2))

    def run(command, log):
        proc = subprocess.run(command, env=dict(env, AGOQ_TEST_SHAPE="builder"), capture_output=True, text=True,
                              timeout=600, cwd=str(bench.MEGATRON_SCRIPT.parent.parent))
        losses, peak = bench.read_losses(log)
        return {"returncode": proc.returncode, "losses": losses, "peak_bytes": peak, "stdout": proc.stdout,
                "output_tail": (proc.stdout + proc.stderr)[-6000:]}

    with ThreadPoolExecutor(2) as pool:  # the two runs share the two GPUs (tiny model)
        theirs, ours = pool.map(lambda job: run(*job), [(door, tmp_path / "m.jsonl"), (own, tmp_path / "a.jsonl")])
    for row in (theirs, ours):
        assert row["returncode"] == 0, row["output_tail"]
        assert len(row["losses"]) == ITERS, row["losses"]
    comparison = bench.compare(theirs, ours)
    assert comparison["bit_identical"], (comparison, theirs["losses"], ours["losses"])
    built = next((line for line in theirs["stdout"].splitlines() if "built as asked" in line), "")
    for name in (*AGOQ_MODULES, optimizer):
        assert name in built, (layout, name, built)
