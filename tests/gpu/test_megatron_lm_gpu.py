"""GPU: agoq through Megatron-LM's trainer (scripts/pretrain_gpt_agoq.py, ``megatron.training.pretrain``) trains
exactly as agoq through its own trainer (scripts/pretrain_llama.py): same model, seed and data (the default
dataset), one GPU, 20 iterations. Run: ``pytest tests/gpu -m gpu`` (needs megatron-core 0.19.2).

Losses must be the same bits at every iteration: both trainers build the same TransformerConfig, weights
(Megatron's CUDA RNG tracker, same seed), GPTDataset samples, gradients and optimizer steps (CPU twin:
tests/megatron/test_megatron_lm.py, bit-identical too).

Peaks (torch.cuda.max_memory_allocated at the end): the model, gradient buffers, optimizer states and saved
activations are the same tensors in both (allocator traces in benchmarks/results/megatron_lm.json,
tiny_agoq_default_peak_trace); each trainer's own loop adds its temporaries, which can move the peak:
* megatron.training's loop (loss and grad-norm bookkeeping, its NaN check by norm): at most
  MEGATRON_LOOP_BYTES above pretrain_llama.py (measured up to 3.2 MiB, benchmarks/results/megatron_lm.json);
* pretrain_llama.py's non-finite check of the float gradient buffer (agoq.ops.nonfinite.nonfinite_in: 4 blocks,
  33.70 MiB alive at its peak for the 19.26 MiB fp32 buffer in the trace, i.e. 7 bytes per element): at most
  MEGATRON_LOOP_BYTES + NONFINITE_BYTES_PER_ELEMENT x parameters above megatron.training (measured 14.2 MiB
  for the tiny agoq_default run, where the check sets pretrain_llama.py's peak).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.megatron._bench_scripts import megatron_lm_bench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ITERS = 20
MEGATRON_LOOP_BYTES = 4 * 2**20  # module docstring (measured <= 3.2 MiB)
NONFINITE_BYTES_PER_ELEMENT = 7  # module docstring (measured in the allocator trace)


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory):
    return megatron_lm_bench(tmp_path_factory)


@pytest.mark.parametrize("variant", ["baseline", "agoq_default", "agoq_full"])
def test_megatron_training_matches_agoq_trainer(bench_env, tmp_path, variant):
    bench, env, data = bench_env
    flags = bench.VARIANTS[variant]
    port = 29700 + sorted(bench.VARIANTS).index(variant) * 2
    jobs = [(f"{variant}/megatron_training", bench.megatron_command("tiny", ITERS, flags, data, tmp_path / "m.jsonl",
                                                                    port), tmp_path / "m.jsonl"),
            (f"{variant}/pretrain_llama", bench.agoq_command("tiny", ITERS, flags, data, tmp_path / "a.jsonl",
                                                             port + 1), tmp_path / "a.jsonl")]
    with ThreadPoolExecutor(2) as pool:
        mlm, own = pool.map(lambda j: bench.run_row(*j, env, 400), jobs)
    for row in (mlm, own):
        assert row["returncode"] == 0, f"{row['name']} failed:\n{row.get('output_tail', '')}"
        assert len(row["losses"]) == ITERS, row
    comparison = bench.compare(mlm, own)
    assert comparison["bit_identical"], (comparison, mlm["losses"], own["losses"])
    peaks = f"peak bytes: megatron.training {mlm['peak_bytes']}, pretrain_llama.py {own['peak_bytes']}"
    layers, hidden, heads, groups, ffn, seq, _, _ = bench.SIZES["tiny"]
    from agoq.megatron.model import LlamaShape

    params = LlamaShape(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                        ffn_hidden_size=ffn, seq_length=seq, vocab_size=4096).num_parameters()
    assert mlm["peak_bytes"] - own["peak_bytes"] <= MEGATRON_LOOP_BYTES, peaks
    assert own["peak_bytes"] - mlm["peak_bytes"] <= MEGATRON_LOOP_BYTES + NONFINITE_BYTES_PER_ELEMENT * params, peaks


SHAPES = "tests/megatron/_pretrain_gpt_shapes.py"  # a pretrain_gpt.py of megatron.training 0.19's shapes, no agoq


def _door_command(bench, command: list[str], recipe: bool) -> list[str]:
    """``bench.megatron_command`` with ``torchrun -m agoq.megatron_lm SHAPES`` in place of scripts/pretrain_gpt_agoq.py;
    ``recipe``: Megatron-LM's LLaMA recipe flags (Megatron's defaults) in place of pretrain_llama.py's equivalents."""
    at = command.index(str(bench.MEGATRON_SCRIPT))
    command = [*command[:at], "-m", "agoq.megatron_lm", SHAPES, *command[at + 1:]]
    if recipe:
        from tests.megatron._megatron_lm_runs import LLAMA_RECIPE_FLAGS

        start = command.index(bench.MEGATRON_EQUIVALENCE_FLAGS[0])
        command = [*command[:start], *LLAMA_RECIPE_FLAGS, *command[start + len(bench.MEGATRON_EQUIVALENCE_FLAGS):]]
    return command


def _door_row(bench, name: str, command: list[str], log, env: dict) -> dict:
    """``bench.run_row`` that keeps the output (the door's start-up report)."""
    import subprocess

    log.unlink(missing_ok=True)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400,
                          cwd=str(bench.MEGATRON_SCRIPT.parent.parent))
    losses, peak = bench.read_losses(log)
    return {"name": name, "returncode": proc.returncode, "losses": losses, "peak_bytes": peak,
            "output_tail": (proc.stdout + proc.stderr)[-6000:], "stdout": proc.stdout}


@pytest.mark.parametrize("shape", ["builder", "provider"])
def test_zero_edit_door_on_one_gpu(bench_env, tmp_path, shape):
    """``torchrun -m agoq.megatron_lm pretrain_gpt.py`` (the zero-edit door) on megatron.training's two construction
    paths, agoq full (8-bit gradients, FlashAdamW): agoq's layers, DDP and optimizer are built (the door's report)
    and the losses are pretrain_llama.py's, bit for bit; Megatron-LM's recipe flags (its fusions, the loader's mask,
    --persist-layer-norm, --gradient-accumulation-fusion, --eval-iters 0) run too."""
    bench, env, data = bench_env
    flags = bench.VARIANTS["agoq_full"]
    port = 29760 + (shape == "provider") * 4
    run_env = dict(env, AGOQ_TEST_SHAPE=shape)
    door = _door_command(bench, bench.megatron_command("tiny", ITERS, flags, data, tmp_path / "m.jsonl", port), False)
    recipe = _door_command(bench, bench.megatron_command("tiny", ITERS, flags, data, tmp_path / "r.jsonl", port + 2),
                           True)
    own = bench.agoq_command("tiny", ITERS, flags, data, tmp_path / "a.jsonl", port + 1)
    jobs = [(f"{shape}/door", door, tmp_path / "m.jsonl"), (f"{shape}/pretrain_llama", own, tmp_path / "a.jsonl"),
            (f"{shape}/door_recipe", recipe, tmp_path / "r.jsonl")]
    with ThreadPoolExecutor(3) as pool:
        rows = list(pool.map(lambda j: _door_row(bench, *j, run_env), jobs))
    for row in rows:
        assert row["returncode"] == 0, f"{row['name']} failed:\n{row['output_tail']}"
        assert len(row["losses"]) == ITERS, row["losses"]
    comparison = bench.compare(rows[0], rows[1])
    assert comparison["bit_identical"], (comparison, rows[0]["losses"], rows[1]["losses"])
    for row in (rows[0], rows[2]):
        built = next((line for line in row["stdout"].splitlines() if "built as asked" in line), "")
        for name in ("AgoqTransformerLayer", "SDPACoreAttention", "AgoqDistributedDataParallel",
                     "AgoqMegatronOptimizer"):
            assert name in built, (row["name"], name, built)
    assert "taken over" in rows[2]["stdout"]  # --gradient-accumulation-fusion, Megatron-LM's default
