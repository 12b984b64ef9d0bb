"""The first pipeline stage of a layout, alone on one rank: the Megatron side of benchmarks/stage_proxy.py.

A PP=P run's stage 0 holds the embedding, layers 1..L/P (global numbers), no final norm / output layer / loss, the
gradient buffer and optimizer of those parameters, and the activations of the micro-batches 1F1B keeps in flight on
it (min(P, micro-batches)). To measure that stage's memory on one GPU before P GPUs are lent, this module builds and
runs exactly that stage in a world of one rank, with two stand-ins and nothing else changed:

- :class:`StagePipelineGroup`: the pipeline group the stage's model sees (``pg_collection.pp``): rank 0 of P. Megatron's
  process groups stay those of the one-rank world (``parallel_state`` at TP = PP = DP = 1, so DDP, the optimizer and
  the data-parallel reductions are the real ones of a DP = 1 run); only the model chunk is told it is stage 0 of P.
  Megatron then builds L/P layers numbered 1..L/P (``get_num_layers_to_build`` / ``get_transformer_layer_offset``
  from ``TransformerConfig.pipeline_model_parallel_size`` = P and this group's rank), and agoq's plan
  (agoq.megatron.layer_plan) resolves each layer's policy row at pipeline rank 0 of P, as on stage 0 of the real run.
- :class:`FirstStageNeighbours`: the ``p2p_communicator`` Megatron's own 1F1B schedule
  (``forward_backward_pipelining_without_interleaving``) talks to. Stage 0 receives nothing forward; what it sends is
  dropped (a send holds no memory of the sender's once it completed); each backward receives a synthetic output
  gradient of the stage's output shape and dtype ([s, b, h], ``config.pipeline_dtype``), allocated as Megatron's
  receive allocates it. The schedule itself, its warm-up count (P - 1), the retained graphs, ``no_sync``, the
  gradient finalisation and the backward calls are Megatron's.

What it cannot represent is refused (:func:`check_proxy_layout`): TP > 1 (the stage's tensor-parallel peers would
have to exist), VPP (the interleaved schedule's chunk order on stage 0 is not the 1F1B order this runs), DP > 1 (the
distributed optimizer's shards and the reductions' peers would be emulated, not built), sequence parallelism
(TP > 1 only), and a stage other than 0.

Seam card
---------
Touches: ``ProcessGroupCollection.use_mpu_process_groups`` (the one-rank world's groups; ``pp`` replaced),
  ``GPTModel(pg_collection=...)`` (agoq.megatron.model.gpt_chunk), ``forward_backward_pipelining_without_interleaving``
  (its ``p2p_communicator`` / ``pg_collection`` arguments), the ``P2PCommunicator`` methods 1F1B calls.
Why: Megatron's ``parallel_state`` cannot hold PP = P on one rank; the model chunk and the schedule take their
  pipeline group and neighbours as arguments, the narrowest place to say "stage 0 of P".
Verified on: megatron-core 0.19.2.
Guarded by: ``tests/megatron/test_stage_proxy.py`` (stage 0's parameters and policy rows equal a real PP=2 run's
  rank 0; PP micro-batches' saved bytes in flight), ``tests/megatron/test_contract.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
from megatron.core.process_groups_config import ProcessGroupCollection

from agoq.megatron.model import LlamaShape, ParallelLayout, check_rope_scaling_bands, gpt_chunk

__all__ = ["FirstStageNeighbours", "StagePipelineGroup", "build_first_stage", "check_proxy_layout",
           "run_first_stage_schedule", "stage_process_groups"]


class StagePipelineGroup:
    """The pipeline group of the proxied stage as the model chunk sees it: rank ``rank`` of ``size`` (only ``rank()``
    and ``size()`` are asked of it: layer offsets, first / last stage, the policy's pipeline position). No collective
    runs on it: stage 0 of a DP = 1 layout with untied embeddings has no pipeline collective outside the p2p
    exchanges, which :class:`FirstStageNeighbours` answers."""

    def __init__(self, size: int, rank: int = 0):
        if size < 2 or rank != 0:
            raise ValueError(f"the stage proxy runs stage 0 of PP >= 2 (got rank {rank} of {size})")
        self._size, self._rank = size, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"StagePipelineGroup(stage {self._rank} of {self._size}, one-rank stand-in)"


def check_proxy_layout(layout: ParallelLayout, *, data_parallel: int, sequence_parallel: bool = False,
                       tied_embeddings: bool = False) -> None:
    """Raise ValueError naming the flag for a layout whose stage 0 the proxy cannot build on one rank."""
    problems = []
    if layout.pp < 2:
        problems.append(f"--pipeline-model-parallel-size {layout.pp}: a PP=1 layout is the whole model; run it "
                        "(scripts/pretrain_llama.py on one GPU) instead of a stage proxy")
    if layout.tp != 1:
        problems.append(f"--tensor-model-parallel-size {layout.tp}: the stage's {layout.tp} tensor-parallel ranks "
                        "would each hold 1/TP of every layer and all-reduce activations; one rank cannot stand in "
                        "for them "
                        "(pick the closest TP=1 layout)")
    if layout.vpp:
        problems.append(f"--num-layers-per-virtual-pipeline-stage (VPP={layout.vpp}): stage 0 then holds chunks 0, P, "
                        "2P, ... under the interleaved schedule; the proxy runs the 1F1B schedule of one chunk")
    if data_parallel != 1:
        problems.append(f"DP={data_parallel}: the distributed optimizer's 1/DP shards and the gradient reduction's "
                        "peers would be emulated, not built; proxy the DP=1 layout with the same TP x PP (its "
                        "optimizer is unsharded: an upper bound on the DP>1 stage's model state)")
    if sequence_parallel:
        problems.append("--sequence-parallel needs TP > 1")
    if tied_embeddings:
        problems.append("tied embeddings: stage 0's embedding gradient is all-reduced with the last stage's copy, "
                        "a peer the proxy does not have (--untie-embeddings-and-output-weights)")
    if problems:
        raise ValueError("stage proxy: " + "; ".join(problems))


def stage_process_groups(pp_size: int) -> ProcessGroupCollection:
    """The one-rank world's process groups with the pipeline group replaced by stage 0 of ``pp_size``."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 0
    if world != 1 or parallel_state.get_pipeline_model_parallel_world_size() != 1 \
            or parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise ValueError(f"the stage proxy runs in a world of one rank with TP = PP = 1 process groups (world size "
                         f"{world}); start it without torchrun, as benchmarks/stage_proxy.py does")
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.pp = StagePipelineGroup(pp_size)
    return groups


def build_first_stage(shape: LlamaShape, config, layer_spec, groups: ProcessGroupCollection) -> list:
    """Stage 0's model chunk (unwrapped GPTModel, in a list as build_model_chunks returns it): the embedding and
    layers 1..L/P, no final norm or output layer (``post_process=False``), on ``groups`` (stage_process_groups)."""
    if config.pipeline_model_parallel_size != groups.pp.size():
        raise ValueError(f"TransformerConfig.pipeline_model_parallel_size {config.pipeline_model_parallel_size} and "
                         f"the stage group's {groups.pp.size()} differ: build both from the same layout")
    if shape.rope_scaling:
        check_rope_scaling_bands()
    return [gpt_chunk(shape, config, layer_spec, None, pre_process=True, post_process=False, pg_collection=groups)]


class FirstStageNeighbours:
    """Stage 0's pipeline neighbours for Megatron's 1F1B schedule (the ``p2p_communicator`` it takes): nothing
    arrives forward, sends are dropped, and every backward receives ``grad_fill`` (a synthetic output gradient,
    normal with this standard deviation) of the receive's shape and ``config.pipeline_dtype``; ``on_recv_backward``
    (optional) is called before each receive (the benchmark's phase meter)."""

    def __init__(self, config, groups: ProcessGroupCollection, device: torch.device, grad_std: float = 1e-4,
                 on_recv_backward: Callable[[], None] | None = None):
        self.config, self.pp_group, self.device = config, groups.pp, device
        self.grad_std, self.on_recv_backward = grad_std, on_recv_backward
        self.received = 0  # output gradients handed to the schedule

    is_pp_first_stage = True
    is_pp_last_stage = False

    @property
    def total_stages(self) -> int:
        return self.pp_group.size()

    @property
    def current_stage(self) -> int:
        return self.pp_group.rank()

    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        return None if not isinstance(tensor_shapes, list) or len(tensor_shapes) == 1 else [None] * len(tensor_shapes)

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        if self.on_recv_backward is not None:
            self.on_recv_backward()
        shapes = tensor_shapes if isinstance(tensor_shapes, list) else [tensor_shapes]
        grads = []
        for shape in shapes:
            grad = torch.empty(shape, dtype=self.config.pipeline_dtype, device=self.device, requires_grad=True)
            with torch.no_grad():
                grad.normal_(0.0, self.grad_std)
            grads.append(grad)
            self.received += 1
        return grads[0] if len(grads) == 1 else grads

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        return None

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        return None

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        return self.recv_backward(tensor_shapes, is_last_stage)

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        return self.recv_forward(tensor_shapes, is_first_stage)


def run_first_stage_schedule(model: list, forward_step: Callable, data: Iterator, neighbours: FirstStageNeighbours,
                             groups: ProcessGroupCollection, *, num_microbatches: int, seq_length: int,
                             micro_batch_size: int) -> list:
    """Megatron's 1F1B schedule for stage 0 of ``groups.pp`` (warm-up P - 1 forwards, then one forward and one
    backward per micro-batch, then the cool-down backwards, then ``config.finalize_model_grads_func``)."""
    return forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=False,
        p2p_communicator=neighbours, pg_collection=groups)
