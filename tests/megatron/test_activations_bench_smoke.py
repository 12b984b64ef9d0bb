"""benchmarks/bench_memory.py --smoke runs on CPU (several micro-batch sizes, the @legacy A/B row) and reports
the agoq policy exactly as the planner predicts; benchmarks/bench_launch.py --smoke runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agoq.testing.procs import REPO_ROOT, child_env

pytestmark = pytest.mark.megatron


def test_bench_memory_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = child_env()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)  # an in-process megatron test may have set them (its port is still taken)
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_memory.py"), "--smoke",
                           "--policies", "bf16", "agoq", "agoq@legacy", "--mbs", "1", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    all_rows = json.loads(out.read_text())["rows"]
    expected = [(m, p) for m in (1, 2) for p in ("bf16", "agoq", "agoq@legacy")]
    assert [(r["mbs"], r["policy"]) for r in all_rows] == expected
    for mbs in (1, 2):
        rows = {r["policy"]: r for r in all_rows if r["mbs"] == mbs}
        assert rows["agoq"]["planner_error"] == 0.0  # CPU: every layer save of the agoq policy is modelled exactly
        assert rows["agoq"]["activation_ratio_vs_bf16"] < 0.5
        assert rows["agoq@legacy"]["held_layer_bytes"] == rows["agoq"]["held_layer_bytes"]  # same storage, old code
        for row in rows.values():  # the interleaved timing rounds ran for every policy
            assert row["interleaved_rounds"] == 5 and row["step_s_interleaved"] > 0
        assert rows["bf16"]["step_time_ratio_interleaved"] == 1.0


def test_bench_launch_smoke(tmp_path):
    out = tmp_path / "launch.json"
    script = str(REPO_ROOT / "benchmarks" / "bench_launch.py")
    proc = subprocess.run([sys.executable, script, "--smoke", "--json", str(out)], capture_output=True, text=True,
                          timeout=300, env=child_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["host_us_per_call"]
    for pair in ("rmsnorm", "rmsnorm_linear", "rmsnorm_linear_node", "swiglu", "swiglu_linear", "swiglu_linear_node",
                 "linear_quantized_scope", "linear_quantized_node"):
        assert rows[f"ratio_{pair}"] > 0 and rows[f"ratio_{pair}_legacy"] > 0
    assert rows["rmsnorm_saving_then_linear_fwd_bwd_legacy"] > 0 and rows["torch_add"] > 0


def test_bench_host_profile_smoke(tmp_path):
    """benchmarks/bench_host_profile.py --smoke: every wrapped function that runs in the agoq policy's step is
    reported (the timers reach agoq's and Megatron's functions), and the bf16 policy calls none of agoq's."""
    out = tmp_path / "host.json"
    env = child_env()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_host_profile.py"), "--smoke",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["policy"]: {f["function"] for f in r["functions"]} for r in json.loads(out.read_text())["results"]}
    assert {"megatron_linear.forward", "megatron_linear.backward"} <= results["bf16"]
    agoq_sites = ("rmsnorm", "swiglu", "replace_saved", "linear_save_scope", "norm_linear_node", "quantized_linear")
    assert not any(name.startswith(agoq_sites) for name in results["bf16"])
    # the default path: each pre-norm and its QKV / fc1 as one node (agoq.ops.norm_linear), SwiGLU and fc2 as one
    # (agoq.ops.swiglu_linear), the out-projection storing its input as one (agoq.ops.quant_linear): no norm or
    # SwiGLU function, no hook scope, no stash
    assert {"norm_linear_node.forward", "norm_linear_node.backward", "swiglu_linear_node.forward",
            "swiglu_linear_node.backward", "quantized_linear_node.forward", "quantized_linear_node.backward",
            "counter.add"} <= results["agoq"]
    assert not any(name.startswith(("rmsnorm_function", "swiglu_function", "linear_save_scope", "stash."))
                   for name in results["agoq"])
