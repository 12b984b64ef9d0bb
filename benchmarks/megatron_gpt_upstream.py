"""Megatron-LM's GPT pretraining as Megatron-LM 0.19 runs it, with nothing of agoq in it: the baseline driver.

The shape of Megatron-LM's own ``pretrain_gpt.py`` at ``core_r0.19.x`` (written here, not copied): Megatron builds
the model itself from a model config (``pretrain_cfg_container_from_args(args, gpt_config_from_args(args))``, no
model provider), so ``--transformer-impl transformer_engine`` gives Megatron's Transformer Engine spec, its FP8
recipes (``--fp8-format`` / ``--fp8-recipe``), fused attention and the precision-aware optimizer exactly as a
Megatron-LM user gets them. A forward step and a GPT dataset provider (``--data-path`` or ``--mock-data``) are all
a script adds. ``--bench-json FILE`` (this driver's only flag) writes each training iteration's loss and, at the
end, the CUDA allocator's peaks; iteration times come from Megatron's own log (``--log-interval 1``). Every rank
also writes ``FILE.rank<R>``: its rank, pipeline stage, tensor / data / context-parallel ranks and its own CUDA peaks
(a pipeline's stages differ; benchmarks/bench_te.py reports each).

Context parallelism (``--context-parallel-size``) as Megatron-LM's ``pretrain_gpt.py`` runs it: each CP rank takes
its zigzag share of the sequence (``megatron.core.utils.get_batch_on_this_cp_rank``), and the loss follows
Megatron's two-value convention under CP (the schedule multiplies it by the CP size, the gradient reduction divides
by DP x CP): the rank's masked loss sum over the whole sequence's token count (the count summed over the CP group).
The reported loss is the sequence's mean, averaged over data-parallel replicas. At CP = 1 both are as before.

    torchrun --nproc-per-node 1 benchmarks/megatron_gpt_upstream.py --transformer-impl transformer_engine \
        --fp8-format hybrid --fp8-recipe delayed <model, data and schedule flags> --bench-json te_fp8.json

``benchmarks/bench_te.py`` drives it for the Transformer Engine baseline rows.
"""

from __future__ import annotations

import json
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

RECORD = {"iterations": []}  # --bench-json: one training loss per iteration (micro-batch mean, DP-averaged)
_PENDING: list[torch.Tensor] = []


def _extra_args(parser):
    parser.add_argument("--bench-json", default=None, help="write per-iteration losses and CUDA peaks here")
    return parser


def _loss_func(loss_mask: torch.Tensor, training: bool, output_tensor: torch.Tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    count = mask.sum()
    if parallel_state.get_context_parallel_world_size() > 1:  # the whole sequence's tokens, over the CP ranks
        count = count.detach().clone()
        torch.distributed.all_reduce(count, group=parallel_state.get_context_parallel_group())
    loss = torch.sum(losses * mask) / count.clamp(min=1.0)
    reported = loss.detach().clone()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(reported, group=group)  # the CP ranks' parts add up to the sequence's mean
    reported /= parallel_state.get_data_parallel_world_size()
    if training:
        _PENDING.append(reported)
    return loss, {"lm loss": reported}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
    tokens, labels = batch["tokens"].cuda(non_blocking=True), batch["labels"].cuda(non_blocking=True)
    loss_mask = batch["loss_mask"].cuda(non_blocking=True)
    position_ids = batch["position_ids"].cuda(non_blocking=True)
    mask = batch.get("attention_mask")
    mask = None if mask is None else mask.cuda(non_blocking=True)
    _close_iteration_if_complete()
    return model(tokens, position_ids, mask, labels=labels), partial(_loss_func, loss_mask, model.training)


def _close_iteration_if_complete() -> None:
    """At the first micro-batch of an iteration, the previous iteration's losses are all in: record their mean."""
    if len(_PENDING) >= get_num_microbatches():
        RECORD["iterations"].append(float(torch.stack(_PENDING).mean().item()))
        _PENDING.clear()


def _datasets(train_val_test_num_samples):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    kind = MockGPTDataset if args.mock_data else GPTDataset
    built = BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples, lambda: True, config).build()
    return [None if wanted == 0 else ds for ds, wanted in zip(built, train_val_test_num_samples, strict=True)]


_datasets.is_distributed = True


def _use_wheel_helpers() -> None:
    """The megatron-core wheel ships the dataset index helpers compiled (``helpers_cpp``) but not the Makefile that
    ``initialize_megatron`` runs on rank 0; a Megatron-LM checkout has both. Skip the build when the module imports."""
    import megatron.core.datasets.utils as dataset_utils

    original = dataset_utils.compile_helpers

    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    dataset_utils.compile_helpers = compile_helpers


def main() -> None:
    _use_wheel_helpers()
    args = parse_and_validate_args(extra_args_provider=_extra_args)
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), _datasets,
             ModelType.encoder_or_decoder, _forward_step)
    if _PENDING:
        RECORD["iterations"].append(float(torch.stack(_PENDING).mean().item()))
    if args.bench_json:
        _write_records(args.bench_json)


def _write_records(path: str) -> None:
    """Every rank: ``path.rank<R>`` (its layout coordinates and CUDA peaks); the last rank (the last pipeline stage,
    where the losses are) also ``path`` (losses and its peaks)."""
    rank, peaks = torch.distributed.get_rank(), {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                                                 "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    mine = {"rank": rank, "pp_stage": parallel_state.get_pipeline_model_parallel_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "cp_rank": parallel_state.get_context_parallel_rank(), **peaks}
    with open(f"{path}.rank{rank}", "w") as out:
        json.dump(mine, out)
    if rank == torch.distributed.get_world_size() - 1:
        RECORD.update(peaks)
        with open(path, "w") as out:
            json.dump(RECORD, out)


if __name__ == "__main__":
    main()
