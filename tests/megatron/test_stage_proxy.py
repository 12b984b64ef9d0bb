"""benchmarks/stage_proxy.py (agoq.megatron.stage_proxy): stage 0 of a PP=2 layout built and run alone on one rank.

Against a real 2-rank gloo run of the same model (the trainer's builders, Megatron's own PP=2 process groups): the
proxy builds exactly rank 0's parameters (names and shapes: the embedding, layers 1..L/2, no final norm or output
layer) and Megatron numbers its layers as rank 0's; agoq's plan resolves the same per-layer policy rows (the stage-aware
``agoq`` policy gives the two stages different formats, so a proxy that resolved as PP=1 or as rank 1 would differ);
Megatron's 1F1B on the proxy keeps PP micro-batches' saved activations alive at most (saved-bytes peak = PP x one
micro-batch's, with 4 micro-batches run); forward, backward and the optimizer step run and move the weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
PP, NUM_LAYERS, MICRO_BATCH, GLOBAL_BATCH = 2, 4, 2, 8  # 4 micro-batches per step
# the trainer flags of the tiny model (tests/megatron/_tiny.py's shape with 4 layers) at PP=2, agoq's stage-aware
# policy, 8-bit gradients and agoq's AdamW
FLAGS = ["--num-layers", str(NUM_LAYERS), "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--vocab-size", "128",
         "--pipeline-model-parallel-size", str(PP), "--micro-batch-size", str(MICRO_BATCH),
         "--global-batch-size", str(GLOBAL_BATCH), "--agoq-preset", "agoq-full",
         "--agoq-policy", str(REPO / "configs" / "policy" / "agoq.yaml"),
         "--agoq-device", "cpu", "--lr", "1e-2", "--lr-warmup-iters", "0"]


def _gpt(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _describe(spec_plan) -> dict:
    return {idx: {role: s.describe() for role, s in layer.roles.items()} for idx, layer in spec_plan.layers.items()}


def _real_rank(rank: int, world_size: int) -> dict | None:
    """Rank ``rank`` of a real PP=2 world: the model the trainer's builders make there (its parameters, layer
    numbers and resolved policy rows)."""
    from megatron.core import parallel_state

    from agoq.megatron import model as mmodel
    from agoq.megatron import runtime
    from agoq.megatron.activations import storage_of
    from agoq.megatron.install import install
    from agoq.policy import ScheduleInfo
    from agoq.train.args import parse_args

    args = parse_args(FLAGS)
    handle = install(args.agoq_config)
    try:
        layout = mmodel.ParallelLayout(tp=1, pp=PP)
        runtime.init_model_parallel(layout, seed=1234, device=torch.device("cpu"))
        shape = mmodel.LlamaShape(num_layers=NUM_LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                  ffn_hidden_size=128, seq_length=32, vocab_size=128, rotary_base=args.rotary_base)
        config = mmodel.llama_transformer_config(shape, layout, params_dtype=torch.bfloat16,
                                                 use_cpu_initialization=True)
        schedule = ScheduleInfo(pp_size=PP, vp_size=None, num_microbatches=GLOBAL_BATCH // MICRO_BATCH)
        spec = mmodel.agoq_layer_spec("sdpa", policy=args.agoq_config.policy.spec, schedule=schedule)
        chunk = mmodel.build_model_chunks(shape, config, spec, None)[0]
        out = {"params": {n: tuple(p.shape) for n, p in chunk.named_parameters()},
               "layer_numbers": [layer.layer_number for layer in chunk.decoder.layers],
               "rows": _describe(storage_of(spec))}
        parallel_state.destroy_model_parallel()
        return out if rank == 0 else None
    finally:
        handle.uninstall()


def _proxy(rank: int, world_size: int, microbatches: int) -> dict:
    """The stage proxy of the same flags on a world of one: what it built, then one iteration of ``microbatches``."""
    from megatron.core import parallel_state

    from agoq.megatron import runtime
    from agoq.megatron.activations import storage_of
    from agoq.megatron.install import install
    from agoq.megatron.model import ParallelLayout
    from tests.megatron._bench_scripts import load_bench_script

    proxy = load_bench_script("stage_proxy")
    args = proxy.parse_trainer(FLAGS)
    handle = install(args.agoq_config)
    device = torch.device("cpu")
    try:
        runtime.init_model_parallel(ParallelLayout(), seed=1234, device=device)
        parts = proxy.build_proxy(args, device)
        gpt = _gpt(parts["model"][0])
        plan = storage_of(parts["spec"])
        built = {"params": {n: tuple(p.shape) for n, p in gpt.named_parameters()},
                 "layer_numbers": [layer.layer_number for layer in gpt.decoder.layers], "rows": _describe(plan),
                 "post_process": gpt.post_process, "pre_process": gpt.pre_process}
        before = {n: p.detach().float().clone() for n, p in gpt.named_parameters()}
        meter = proxy.PhaseMeter(device)
        result = proxy.run_iteration(parts, args, device, meter, microbatches, seed=5)
        moved = [n for n, p in gpt.named_parameters() if not torch.equal(before[n], p.detach().float())]
        packed = sum(plan.counter.packed.values())
        parallel_state.destroy_model_parallel()
        return {**built, "result": result, "moved": moved, "all": list(before), "saved_peak": plan.counter.peak,
                "saved_total": packed, "phases": meter.order, "prediction": proxy.prediction(args, parts)}
    finally:
        handle.uninstall()


@pytest.fixture(scope="module")
def runs():
    from agoq.testing.dist import spawn_ranks

    real = spawn_ranks(2, _real_rank, start_method="spawn")[0]
    proxied = spawn_ranks(1, _proxy, args=(4,), start_method="spawn")[0]
    return real, proxied


def test_proxy_builds_exactly_stage_0_of_the_real_pp2_run(runs):
    real, proxied = runs
    assert proxied["params"] == real["params"]  # names and shapes
    assert any(n.startswith("embedding.") for n in proxied["params"])
    assert not any(n.startswith(("output_layer", "decoder.final_layernorm")) for n in proxied["params"])
    assert proxied["pre_process"] and not proxied["post_process"]
    assert proxied["layer_numbers"] == real["layer_numbers"] == [1, 2]  # global numbers of stage 0 (offset 0)


def test_proxy_resolves_stage_0_policy_rows(runs):
    from agoq.policy import ScheduleInfo, auto_names, load_policy

    real, proxied = runs
    assert proxied["rows"] == real["rows"]
    assert set(proxied["rows"]) == {0, 1}
    # the stage-aware policy gives stage 0 a different format than stage 1: the rows are stage 0's, not PP=1's
    names = auto_names(load_policy(REPO / "configs" / "policy" / "agoq.yaml"), ScheduleInfo(PP, None, 4))
    assert names[0] != names[1]
    assert all(row["mlp.swiglu_input"] == names[0] for row in proxied["rows"].values()), proxied["rows"]


def test_proxy_keeps_pp_microbatches_in_flight_and_steps(runs):
    _, proxied = runs
    result = proxied["result"]
    assert result["forwards"] == 4 and result["output_grads"] == 4  # Megatron's 1F1B ran all four
    assert result["update_successful"]
    per_microbatch = proxied["saved_total"] // 4
    assert per_microbatch > 0 and proxied["saved_total"] % 4 == 0
    assert proxied["saved_peak"] == PP * per_microbatch  # warm-up PP-1 forwards + one: PP alive, never 4
    # every parameter of the stage got a gradient and was updated
    assert sorted(proxied["moved"]) == sorted(proxied["all"])
    # 1F1B on stage 0 of 2 with 4 micro-batches: F (warm-up) F B F B F B B (cool-down), then the step
    assert proxied["phases"] == ["forward", "backward"] * 3 + ["optimizer step"]
    pred = proxied["prediction"]
    assert len(pred["all_stages_gib"]) == PP and pred["peak_gib"] == pred["all_stages_gib"][0]


@pytest.mark.parametrize("kw, needle", [
    (dict(tp=2, pp=2), "--tensor-model-parallel-size 2"),
    (dict(tp=1, pp=2, vpp=2), "VPP=2"),
    (dict(tp=1, pp=1), "PP=1 layout"),
])
def test_layouts_the_proxy_cannot_represent_are_refused(kw, needle):
    from agoq.megatron.model import ParallelLayout
    from agoq.megatron.stage_proxy import check_proxy_layout

    with pytest.raises(ValueError, match="stage proxy") as exc:
        check_proxy_layout(ParallelLayout(**kw), data_parallel=1)
    assert needle in str(exc.value)


def test_data_parallel_and_tied_embeddings_are_refused():
    from agoq.megatron.model import ParallelLayout
    from agoq.megatron.stage_proxy import check_proxy_layout

    with pytest.raises(ValueError, match="DP=2: the distributed optimizer"):
        check_proxy_layout(ParallelLayout(tp=1, pp=4), data_parallel=2)
    with pytest.raises(ValueError, match="tied embeddings"):
        check_proxy_layout(ParallelLayout(tp=1, pp=4), data_parallel=1, tied_embeddings=True)


def test_emulating_a_smaller_gpu_needs_a_gpu_and_a_smaller_size():
    """--gpu-memory-gib caps the caching allocator on a GPU; on the CPU, and above the GPU's own memory, it is
    refused with the reason rather than run uncapped."""
    from tests.megatron._bench_scripts import load_bench_script

    proxy = load_bench_script("stage_proxy")
    assert proxy.cap_allocator(torch.device("cpu"), None) is None
    with pytest.raises(ValueError, match="--gpu-memory-gib 79.18: .* this device is cpu, not a GPU"):
        proxy.cap_allocator(torch.device("cpu"), 79.18)
