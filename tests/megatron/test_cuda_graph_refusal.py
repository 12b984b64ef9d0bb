"""Megatron's CUDA graphs with agoq's features: what is refused, by name, and why (issue 24 item 1,
agoq/megatron/graphs.py). Features whose graph path is built but not yet validated on a GPU are refused unless
the validation test lifts the refusal (``allow_unvalidated``, a context manager; no flag); features graphs cannot
hold (8-bit gradient store, gradient release) are refused always; agoq's features under another implementation
than 'local' are refused. One gloo rank on the CPU: Megatron's own graph manager needs CUDA to build, so where a
layer is expected to build it is replaced by a no-op."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.dist]


def _try(build) -> str:
    try:
        build()
        return "built"
    except NotImplementedError as err:
        return str(err)


def _rank(rank: int, world: int) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from agoq.config.sections import GradsConfig
    from agoq.megatron import runtime
    from agoq.megatron.grads.ddp import wrap_ddp_agoq
    from agoq.megatron.graphs import allow_unvalidated
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.policy import FP8Spec
    from agoq.policy.stages import ScheduleInfo
    from agoq.train.args import DEFAULT_POLICY
    from tests.megatron._tiny import tiny_shape

    shape, layout = tiny_shape(), ParallelLayout(tp=1, pp=1)
    runtime.init_model_parallel(layout, seed=1234, device=torch.device("cpu"))
    plain = llama_transformer_config(shape, layout, params_dtype=torch.float32, use_cpu_initialization=True)
    # set after construction: __post_init__ would also derive the inference graph scope, which agoq does not read
    graphed, te_graphed = copy.copy(plain), copy.copy(plain)
    graphed.cuda_graph_impl, te_graphed.cuda_graph_impl = "local", "transformer_engine"
    TransformerLayer.create_mcore_cudagraph_manager = lambda self, config: None  # needs CUDA (module docstring)
    schedule = ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=2)  # the default policy's "auto" needs it
    bf16 = DEFAULT_POLICY.parent / "bf16.yaml"

    def layer(config, policy=DEFAULT_POLICY, smooth=None):  # one agoq layer from the spec, as Megatron's block does
        compute = FP8Spec(smooth_swiglu=smooth) if smooth else None
        return lambda: build_module(agoq_layer_spec("sdpa", policy, schedule, compute=compute), config=config,
                                    layer_number=1)

    out = {"layers": _try(layer(graphed)), "smooth": _try(layer(graphed, bf16, "per-token")),
           "bf16_layers": _try(layer(graphed, bf16)), "te": _try(layer(te_graphed))}
    with allow_unvalidated():
        out["layers_allowed"] = _try(layer(graphed))
        out["smooth_allowed"] = _try(layer(graphed, bf16, "per-token"))
        out["te_allowed"] = _try(layer(te_graphed))
    with allow_unvalidated("smooth_per_token"):
        out["layers_other_allowed"] = _try(layer(graphed))
    agoq_spec = agoq_layer_spec("sdpa", DEFAULT_POLICY, schedule)
    out["agoq_layers_without_graphs"] = len(build_model_chunks(shape, plain, agoq_spec, None))
    # Megatron's modules (built without graphs); the DDP wrapper gets the graphed config
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, check_for_nan_in_grad=False)
    for mode in ("store", "reduce"):
        chunks = build_model_chunks(shape, plain, agoq_layer_spec("sdpa"), None)
        grad = GradsConfig(format="int8_b256", mode=mode, transport="nccl")
        out[f"grads_{mode}"] = _try(lambda c=chunks, g=grad: wrap_ddp_agoq(c, graphed, ddp_cfg, torch.device("cpu"), g))
    with allow_unvalidated():  # (reduce mode, allowed, goes on into Megatron's DDP, which needs CUDA with graphs on)
        out["grads_store_allowed"] = _try(lambda: wrap_ddp_agoq(chunks, graphed, ddp_cfg, torch.device("cpu"),
                                                                GradsConfig(format="int8_b256", transport="nccl")))
    return out


def test_agoq_features_under_cuda_graphs_are_refused_by_name():
    from agoq.testing.dist import spawn_ranks

    [out] = spawn_ranks(1, _rank, "gloo", timeout_s=300)
    named = "cuda_graph_impl='local'"
    # validated on GPUs (agoq.megatron.graphs.VALIDATED): built with no override
    assert out["layers"] == out["smooth"] == out["layers_other_allowed"] == "built", out
    what, fix = "reduce mode", "drop --agoq-grads"  # not validated: refused until it is
    assert all(s in out["grads_reduce"] for s in (what, "not yet supported", named, "--cuda-graph-impl", fix)), out
    for key in ("grads_store", "grads_store_allowed"):  # incompatible: the override does not lift it
        assert all(s in out[key] for s in ("cannot run", named, "param.main_grad", "drop --agoq-grads")), (key, out)
    for key in ("te", "te_allowed"):
        assert "'transformer_engine'" in out[key] and "use --cuda-graph-impl local" in out[key], out[key]
    # no agoq feature in use (bf16 policy, no FP8 / Smooth-SwiGLU): Megatron's code, graphs are Megatron's business
    assert out["bf16_layers"] == "built"
    assert out["layers_allowed"] == out["smooth_allowed"] == "built"
    assert out["agoq_layers_without_graphs"] == 1


def test_feature_table_and_override_semantics():
    from agoq.megatron import graphs
    from agoq.megatron.graphs import FEATURES, INCOMPATIBLE, VALIDATED, allow_unvalidated, check_cuda_graphs

    local, off = type("C", (), {"cuda_graph_impl": "local"})(), type("C", (), {"cuda_graph_impl": "none"})()
    check_cuda_graphs(off, FEATURES)  # graphs off: nothing is refused
    check_cuda_graphs(local, [])  # no agoq feature in use
    assert VALIDATED <= set(FEATURES) and not (VALIDATED & {n for n, f in FEATURES.items() if f.status == INCOMPATIBLE})
    unvalidated = [n for n, f in FEATURES.items() if f.status == graphs.UNVALIDATED and n not in VALIDATED]
    for name in unvalidated:
        with pytest.raises(NotImplementedError, match="not yet supported"):
            check_cuda_graphs(local, [name])
    with allow_unvalidated():
        check_cuda_graphs(local, unvalidated)
        for name in ("grads_store", "gradient_release"):
            with pytest.raises(NotImplementedError, match="cannot run"):
                check_cuda_graphs(local, [name])
    with pytest.raises(NotImplementedError, match="not yet supported"):  # the override ends with its block
        check_cuda_graphs(local, unvalidated[:1])
    with pytest.raises(ValueError, match="unknown features"):
        with allow_unvalidated("no_such_feature"):
            pass


def test_pp_graphs_give_each_micro_batch_its_own_rotary_table():
    """Local graphs at PP > 1 (agoq.megatron.graphs.rope_per_microbatch): the trainer's forward step drops
    megatron-core's cached rotary table before each micro-batch, so no two micro-batches' graph runners share it;
    without graphs, or at PP=1, the cache is left alone."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from agoq.megatron import graphs
    from agoq.megatron.cpu_mode import enter_cpu_mode, exit_cpu_mode

    def config(impl, pp):
        return type("C", (), {"cuda_graph_impl": impl, "pipeline_model_parallel_size": pp})()

    assert graphs.needs_rope_per_microbatch(config("local", 2))
    assert not graphs.needs_rope_per_microbatch(config("local", 1))
    assert not graphs.needs_rope_per_microbatch(config("none", 4))
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    batch = {k: torch.zeros(1, 4, dtype=torch.long) for k in ("tokens", "labels", "position_ids", "loss_mask")}
    enter_cpu_mode()  # megatron-core moves the table to torch.cuda.current_device() (agoq.megatron.cpu_mode)
    try:
        tables_by_mode = {fresh: _rope_tables(rope, batch, fresh) for fresh in (True, False)}
    finally:
        exit_cpu_mode()
    for fresh, tables in tables_by_mode.items():
        assert all(torch.equal(t, tables[0]) for t in tables)  # same values either way
        assert len({id(t) for t in tables}) == (3 if fresh else 1), fresh  # one tensor per micro-batch, or shared


def _rope_tables(rope, batch, fresh: bool) -> list:
    from agoq.train.training import make_forward_step

    tables = []

    def model(tokens, position_ids, attention_mask, labels):
        tables.append(rope(16))  # what GPTModel.forward asks for, once per micro-batch
        return torch.zeros(1, 4)

    step = make_forward_step(torch.device("cpu"), rope_per_microbatch=fresh)
    for _ in range(3):
        step(iter([batch]), model)
    return tables
