"""install() is idempotent and undoable; CPU mode patches exactly the listed symbols and restores them."""

from __future__ import annotations

import pytest
import torch

from agoq.config import AgoqConfig
from agoq.config.sections import PolicyConfig
from agoq.megatron.install import install

pytestmark = pytest.mark.megatron

needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode is refused when a GPU is present")


def _patched_symbols():
    return (torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.synchronize,
            torch.Tensor.cuda, torch.Tensor.type)


@needs_cpu
def test_install_twice_then_uninstall_restores_torch():
    before = _patched_symbols()
    handle = install(AgoqConfig(device="cpu"))
    assert install(AgoqConfig(device="cpu")) is handle  # idempotent
    assert [s.name for s in handle.applied] == ["cpu_mode", "fp8_weight_cache"]
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(2, device="cuda").device.type == "cpu"  # device='cuda' rewritten
    assert torch.zeros(2).type() == "torch.cuda.FloatTensor"  # Megatron's optimizer type checks
    assert torch.zeros(2).type(torch.float64).dtype == torch.float64  # the 1-arg form is untouched
    with pytest.raises(RuntimeError, match="different config"):
        install(AgoqConfig(device="cpu", policy=PolicyConfig(path="x.yaml")))
    handle.uninstall()
    assert _patched_symbols() == before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")  # the real error again: no GPU here


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="choose one of"):
        AgoqConfig(device="tpu")


def test_undo_restores_every_runtime_change():
    """Every change agoq makes to Megatron's or torch's process state is recorded and reverted by
    handle.undo(): the bucket-group and distributed-optimizer class swaps, Megatron's checkpoint results
    queue and torch's optimizer step post-hook of the FP8 weight caches; the originals come back
    (the same objects, not copies)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from torch.optim.optimizer import _global_optimizer_post_hooks

    from agoq.config.sections import GradsConfig
    from agoq.megatron import install as install_mod
    from agoq.megatron import runtime
    from agoq.megatron.ckpt import save as ckpt_save
    from agoq.megatron.grads import grad_reader
    from agoq.megatron.grads.ddp import AgoqBucketGroup, GroupGrads, wrap_ddp_agoq
    from agoq.megatron.model import (
        LlamaShape,
        ParallelLayout,
        agoq_layer_spec,
        build_model_chunks,
        llama_transformer_config,
    )
    from agoq.ops import fp8_weight_cache

    device = torch.device("cpu")
    queue_before, hooks_before = filesystem_async._results_queue, dict(_global_optimizer_post_hooks)
    handle = install(AgoqConfig(device="cpu" if not torch.cuda.is_available() else "auto"))
    try:
        assert "fp8_weight_cache" in [s.name for s in handle.applied]
        assert fp8_weight_cache.optimizer_hook_installed()
        assert install_mod.marked_seam(fp8_weight_cache.fp8_weights_changed) == "fp8_weight_cache"
        runtime.init_distributed(device, runtime.SINGLE_PROCESS)
        layout = ParallelLayout()
        runtime.init_model_parallel(layout, seed=1234, device=device)
        shape = LlamaShape(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=2,
                           ffn_hidden_size=64, seq_length=8, vocab_size=64)
        config = llama_transformer_config(shape, layout, params_dtype=torch.float32, use_cpu_initialization=True)
        chunks = build_model_chunks(shape, config, agoq_layer_spec("sdpa"), None)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        model = wrap_ddp_agoq(chunks, config, ddp_cfg, device, GradsConfig(format="int8_b256", transport="nccl"))
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False,
                                                           params_dtype=torch.float32,
                                                           use_distributed_optimizer=True), model)
        grad_reader.attach(optimizer, model)
        ckpt_save.install_results_queue()
        groups = [bg for chunk in model for bg in chunk.bucket_groups]
        dist_opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        assert groups and all(type(bg) is AgoqBucketGroup for bg in groups)
        # one call attached each group: one typed attribute, no loose agoq_* ones
        assert all(isinstance(bg.agoq, GroupGrads) and bg.agoq.grads is model[0].agoq_grads for bg in groups)
        assert not [k for bg in groups for k in vars(bg) if k.startswith("agoq_")]
        assert install_mod.marked_seam(AgoqBucketGroup) == "ddp.bucket_group"
        assert all(install_mod.marked_seam(type(o)) == "grad_reader.distributed_optimizer" for o in dist_opts)
        assert filesystem_async._results_queue is not queue_before
        [server] = ckpt_save._SERVERS
        seams = {c.seam for c in install_mod.runtime_changes()}
        assert seams == {"ddp.bucket_group", "grad_reader.distributed_optimizer", "checkpoint.results_queue"}
    finally:
        runtime.shutdown()
        handle.undo()
    assert all(type(bg) is _ParamAndGradBucketGroup for bg in groups)
    assert all(type(o) is DistributedOptimizer for o in dist_opts)
    assert filesystem_async._results_queue is queue_before
    assert dict(_global_optimizer_post_hooks) == hooks_before and not fp8_weight_cache.optimizer_hook_installed()
    assert install_mod.runtime_changes() == [] and not ckpt_save._SERVERS
    assert server.process.returncode == 0  # undo() stopped the queue server (it ended on its closed stdin)
