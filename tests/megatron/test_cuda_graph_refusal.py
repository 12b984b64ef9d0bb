"""Megatron's CUDA graphs with agoq's features are refused by name (issue 24 item 1, agoq/megatron/graphs.py):
agoq's layers, 8-bit gradients and gradient release keep host-side state a graph replay would skip. Megatron's
layers build without graphs. One gloo rank on the CPU (Megatron's own graphed layers need CUDA to build)."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.megatron, pytest.mark.dist]


def _rank(rank: int, world: int) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.spec_utils import build_module

    from agoq.megatron import runtime
    from agoq.megatron.ddp import GradConfig, wrap_ddp_agoq
    from agoq.megatron.model import ParallelLayout, agoq_layer_spec, build_model_chunks, llama_transformer_config
    from agoq.megatron.train.args import DEFAULT_POLICY
    from agoq.policy.stages import ScheduleInfo
    from tests.megatron._tiny import tiny_shape

    shape, layout = tiny_shape(), ParallelLayout(tp=1, pp=1)
    runtime.init_model_parallel(layout, seed=1234, device=torch.device("cpu"))
    plain = llama_transformer_config(shape, layout, params_dtype=torch.float32, use_cpu_initialization=True)
    # set after construction: __post_init__ would also derive the inference graph scope, which agoq does not read
    graphed = copy.copy(plain)
    graphed.cuda_graph_impl = "local"
    schedule = ScheduleInfo(pp_size=1, vp_size=None, num_microbatches=2)  # the default policy's "auto" needs it
    out = {}
    try:  # one agoq layer from the spec, as Megatron's block builds it (the block's own graph manager needs CUDA)
        build_module(agoq_layer_spec("sdpa", DEFAULT_POLICY, schedule), config=graphed, layer_number=1)
        out["layers"] = "built"
    except NotImplementedError as err:
        out["layers"] = str(err)
    agoq_spec = agoq_layer_spec("sdpa", DEFAULT_POLICY, schedule)
    out["agoq_layers_without_graphs"] = len(build_model_chunks(shape, plain, agoq_spec, None))
    # Megatron's modules (built without graphs: its graph manager needs CUDA); the DDP wrapper gets the graphed config
    megatron_chunks = build_model_chunks(shape, plain, agoq_layer_spec("sdpa"), None)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, check_for_nan_in_grad=False)
    try:
        wrap_ddp_agoq(megatron_chunks, graphed, ddp_cfg, torch.device("cpu"), GradConfig(fmt="int8_b256"))
        out["grads"] = "built"
    except NotImplementedError as err:
        out["grads"] = str(err)
    return out


def test_agoq_features_under_cuda_graphs_are_refused_by_name():
    from agoq.testing.dist import spawn_ranks

    [out] = spawn_ranks(1, _rank, "gloo", timeout_s=300)
    for key, flag in (("layers", "--agoq-disable"), ("grads", "drop --agoq-grads")):
        assert "cuda_graph_impl='local'" in out[key] and "--cuda-graph-impl" in out[key] and flag in out[key], out
    assert out["agoq_layers_without_graphs"] == 1
