"""scripts/pretrain_llama.py with agoq's not-yet-validated CUDA-graph features allowed, for their GPU
validation only: tests/gpu/test_cuda_graphs_gpu.py, tests/e2e/test_cuda_graphs_multigpu.py and the ``graphs`` suite
of benchmarks/bench_pretrain.py run it in place of the script.

    torchrun --nproc-per-node 1 --standalone agoq/testing/unvalidated_cuda_graphs.py --cuda-graph-impl local ...

Every flag is the script's. The whole run is inside ``agoq.megatron.graphs.allow_unvalidated()``: the features
whose graph path is built but has not passed the GPU test (``agoq.megatron.graphs.FEATURES``, status
"unvalidated") build under ``--cuda-graph-impl local`` instead of being refused; those graphs cannot hold stay
refused. There is no flag or environment variable for this on purpose: a user's run of the script refuses them
until :data:`agoq.megatron.graphs.VALIDATED` lists them.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

PRETRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_llama.py"


def main(argv: list[str]) -> None:
    from agoq.megatron.graphs import allow_unvalidated

    sys.argv = [str(PRETRAIN_SCRIPT), *argv]
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path[0] = str(PRETRAIN_SCRIPT.parent)  # as when the script itself is launched
    with allow_unvalidated():
        runpy.run_path(str(PRETRAIN_SCRIPT), run_name="__main__")  # exits through SystemExit, as the script


if __name__ == "__main__":
    main(sys.argv[1:])
