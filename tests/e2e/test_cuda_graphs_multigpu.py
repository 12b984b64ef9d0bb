"""Two GPUs: agoq under megatron-core's CUDA graphs with pipeline parallelism (PP=2, 1F1B) trains exactly as eager
(issue 24 item 1; the one-GPU cases and the method: tests/gpu/test_cuda_graphs_gpu.py, tests/gpu/_cuda_graph_runs.py).

With PP > 1 Megatron gives each graphed layer one runner (a forward and a backward graph) per micro-batch in flight
of the first iteration (runners are not shared, their memory pools order the micro-batches), and replays them in
turn afterwards. Each stage holds 2 of the 4 layers; 4 micro-batches per step, so 2 x 4 runners per stage, all of
which must be captured. Losses (last stage) and gradient norms must be the same bits at every iteration (the tiny
bf16 shape is deterministic; PP=2 only moves whole micro-batches between the GPUs).

Run (~3 minutes, 6 trainer runs, 2 at a time, each on both GPUs):
    pytest tests/e2e/test_cuda_graphs_multigpu.py -m multigpu -s -rA
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._cuda_graph_runs import TINY, run_cases, summary_lines, write_report

pytestmark = [pytest.mark.multigpu]

ITERS = 8
MICRO_BATCHES = 4
LAYOUT = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size",
          str(2 * MICRO_BATCHES), "--train-iters", str(ITERS)]
CASES = {"baseline": ["--agoq-disable"], "agoq_default": [], "fp8_delayed_smooth_per_token":
         ["--agoq-fp8", "delayed", "--agoq-smooth-swiglu", "per-token"]}
RUNNERS_PER_STAGE = 2 * MICRO_BATCHES  # 2 layers per stage x one runner per micro-batch (module docstring)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    workdir = tmp_path_factory.mktemp("cuda_graphs_pp2")
    out = run_cases(CASES, 2, TINY + LAYOUT, workdir, parallel=2, timeout_s=600)
    paths = write_report(out, workdir / "cuda_graphs_pp2.json")
    print("\n".join(["", *summary_lines(out), *(f"report: {p}" for p in paths)]))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_pp2_graphs_train_exactly_as_eager(results, case):
    got = results[case]
    for mode in ("eager", "graphs"):
        row = got[mode]
        assert row["returncode"] == 0 and len(row["losses"]) == ITERS, (mode, row.get("output_tail", row))
    # the logging rank is the last stage: its runners
    assert got["graphs"]["cuda_graphs"] == {"runners": RUNNERS_PER_STAGE, "captured": RUNNERS_PER_STAGE}, got
    assert got["comparison"]["bit_identical"], (got["comparison"], got["eager"]["losses"], got["graphs"]["losses"])
