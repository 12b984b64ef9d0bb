"""benchmarks/trace_summary.py on traces whose answers are known: kernels assigned to the step that launched them
(also when they run after its host window), overlapping kernels counted once in the busy time, categories by name
(agoq's own Triton kernels read from agoq/kernels), and the comparison of two traces."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.megatron._bench_scripts import load_bench_script

ts = load_bench_script("trace_summary")


def _step(n: int, start: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": start, "dur": dur}


def _launch(corr: int, at: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": at, "dur": 5, "args":
            {"correlation": corr}}


def _gpu(corr: int, name: str, start: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "args": {"correlation": corr}}


def _trace(gemm_us: float) -> list[dict]:
    """Two steps of 10 ms host time. Step 1: a gemm and an agoq quantize kernel overlapping by 1 ms on two streams,
    a copy; step 2: the same gemm launched at the end of its window, running after it."""
    return [
        _step(1, 0, 10_000), _step(2, 10_000, 10_000),
        _launch(1, 100), _gpu(1, "sm90_xmma_gemm_bf16bf16_bf16f32", 1_000, gemm_us),
        _launch(2, 200), _gpu(2, "_quantize_fwd_kernel", 1_000 + gemm_us - 1_000, 2_000),
        _launch(3, 300), _gpu(3, "Memcpy DtoD (Device -> Device)", 9_000, 500, cat="gpu_memcpy"),
        _launch(4, 19_990), _gpu(4, "sm90_xmma_gemm_bf16bf16_bf16f32", 21_000, gemm_us),
        _gpu(99, "ncclDevKernel_AllReduce", 30_000, 100),  # launched before the profiled steps
    ]


def test_steps_busy_time_and_categories():
    s = ts.summarize(_trace(4_000), agoq_names=ts.agoq_kernel_names())
    assert s["steps"] == 2 and s["gpu_events_outside_steps"] == 1
    one, two = s["per_step"]
    assert one["by_category_ms"] == {"gemm": 4.0, "agoq": 2.0, "copy": 0.5}
    assert one["gpu_busy_ms"] == pytest.approx(4.0 + 2.0 - 1.0 + 0.5)  # the 1 ms overlap once
    assert one["gpu_span_ms"] == pytest.approx(8.5) and one["gpu_idle_ms"] == pytest.approx(8.5 - 5.5)
    assert two["by_category_ms"] == {"gemm": 4.0} and two["host_ms"] == 10.0  # ran after its window: still step 2
    assert s["mean_by_category_ms"]["gemm"] == 4.0 and s["mean_by_category_ms"]["agoq"] == 1.0
    top = s["top_kernels"][0]
    assert top["name"].startswith("sm90_xmma_gemm") and top["calls_per_step"] == 1.0 and top["ms_per_step"] == 4.0


@pytest.mark.parametrize("name, expected", [
    ("_quantize_fwd_kernel", "agoq"), ("_optim_step_kernel", "agoq"), ("ncclDevKernel_ReduceScatter_Sum_bf16", "nccl"),
    ("flash_fwd_kernel", "attention"), ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
    ("void transformer_engine::detail::cast_transpose_kernel<...>", "te_fp8_cast"),
    ("void transformer_engine::rmsnorm_fwd_tuned_kernel<...>", "te_other"),
    ("void multi_tensor_apply_kernel<AdamFunctor>", "optimizer"), ("triton_poi_fused_mul_silu_0", "compiled"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"), ("some_kernel", "other"),
])
def test_categories(name, expected):
    assert ts.category(name, "kernel", ts.agoq_kernel_names()) == expected


def test_agoq_names_come_from_the_kernels_source():
    names = ts.agoq_kernel_names()
    assert {"_quantize_fwd_kernel", "_optim_step_kernel", "_multi_step_kernel"} <= names
    assert all(n.endswith("_kernel") for n in names)


def test_two_traces_compared_from_gzip_files(tmp_path, capsys):
    for name, gemm in (("a", 4_000), ("b", 5_000)):
        with gzip.open(tmp_path / f"{name}.json.gz", "wt") as fh:
            json.dump({"traceEvents": _trace(gemm)}, fh)
    out = tmp_path / "cmp.json"
    assert ts.main([str(tmp_path / "b.json.gz"), "--against", str(tmp_path / "a.json.gz"), "--json", str(out)]) == 0
    diff = json.loads(out.read_text())["comparison"]
    assert diff["by_category_ms"]["gemm"]["b_minus_a"] == pytest.approx(1.0)
    assert diff["by_category_ms"]["agoq"]["b_minus_a"] == pytest.approx(0.0)
    assert "gemm" in capsys.readouterr().out
