"""benchmarks/megatron_gpt_upstream.py under context parallelism, on CPU (two gloo ranks, CP=2, own processes): the
loss each CP rank hands Megatron's schedule, summed over the ranks (what the schedule's x CP and the gradient
reduction's / (DP x CP) leave), is the whole sequence's masked mean; the reported loss is that mean on both ranks; every
rank writes its per-rank record (its CP rank and peaks) and the last rank the losses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from agoq.testing.procs import REPO_ROOT, child_env

pytestmark = [pytest.mark.megatron]

SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, os, sys, torch, torch.distributed as dist
    from agoq.megatron import cpu_mode
    cpu_mode.enter_cpu_mode()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
    from megatron.core.utils import get_batch_on_this_cp_rank
    spec = importlib.util.spec_from_file_location("driver", "benchmarks/megatron_gpt_upstream.py")
    driver = importlib.util.module_from_spec(spec); spec.loader.exec_module(driver)
    torch.manual_seed(0)
    losses = torch.rand(1, 16, dtype=torch.float64) * 10  # per-token losses of the whole sequence, same on both ranks
    mask = torch.ones(1, 16); mask[0, [1, 2, 9]] = 0.0  # unequal token counts on the two CP ranks
    full_mean = float((losses * mask).sum() / mask.sum())
    part = get_batch_on_this_cp_rank({"l": losses.clone(), "m": mask.clone()}, is_hybrid_cp=False,
                                     cp_group=parallel_state.get_context_parallel_group())
    loss, report = driver._loss_func(part["m"], True, part["l"])
    summed = loss.detach().clone(); dist.all_reduce(summed)
    torch.cuda.max_memory_allocated = lambda: 1000 + dist.get_rank()
    torch.cuda.max_memory_reserved = lambda: 2000 + dist.get_rank()
    driver._write_records(sys.argv[1])
    print("AGOQ_RESULT", json.dumps({"full": full_mean, "summed": float(summed), "reported": float(report["lm loss"]),
                                     "local_count": float(part["m"].sum())}))
    """
)


def test_cp2_loss_and_records(tmp_path):
    script, record = tmp_path / "cp.py", tmp_path / "rec.json"
    script.write_text(SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(record)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=child_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT="29547"))
             for r in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "AGOQ_RESULT" in out, out[-3000:] + err[-3000:]
        results.append(json.loads(out.split("AGOQ_RESULT", 1)[1]))
    assert sorted(r["local_count"] for r in results) == [6.0, 7.0]  # the split is uneven: the test can see it
    for r in results:
        assert r["summed"] == pytest.approx(r["full"], rel=1e-6)  # not 2x: the old per-rank mean gave ~2x
        assert r["reported"] == pytest.approx(r["full"], rel=1e-6)
    ranks = [json.loads((tmp_path / f"rec.json.rank{r}").read_text()) for r in range(2)]
    assert [(x["cp_rank"], x["pp_stage"], x["dp_rank"], x["peak_allocated_bytes"]) for x in ranks] == \
        [(0, 0, 0, 1000), (1, 0, 0, 1001)]
    assert json.loads(record.read_text())["peak_reserved_bytes"] == 2001  # the last rank's main record
