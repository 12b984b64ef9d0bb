"""benchmarks/stage_proxy.py's --gpu-memory-gib on a GPU: the caching allocator, capped to stand in for a smaller GPU,
refuses what the smaller GPU could not reserve and grants what it could, with the default allocator and with
expandable segments (each in a fresh process: the allocator's settings are read once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from agoq.testing.procs import REPO_ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# a 4 GiB "GPU": 4 - 1.29 (OUTSIDE_ALLOCATOR_GIB) = 2.71 GiB for PyTorch; 2.5 GiB fits in one block, 3 GiB does not
PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.megatron._bench_scripts import load_bench_script
proxy = load_bench_script("stage_proxy")
dev = torch.device("cuda", 0)
capped = proxy.cap_allocator(dev, 4.0)
out = {"capped": capped}
for gib in (2.5, 3.0):
    try:
        t = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=dev)
        out[str(gib)] = "granted"
        del t
        torch.cuda.empty_cache()
    except torch.OutOfMemoryError:
        out[str(gib)] = "refused"
print(json.dumps(out))
"""


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_cap_stands_in_for_a_smaller_gpu(alloc_conf):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO_ROOT)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["capped"]["allocator_cap_gib"] == pytest.approx(4.0 - out["capped"]["outside_allocator_gib"])
    assert (out["2.5"], out["3.0"]) == ("granted", "refused")
