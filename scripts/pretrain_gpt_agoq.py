"""Pretrain a LLaMA-architecture GPT with Megatron-LM's own trainer (``megatron.training.pretrain``) and agoq.

The shape of Megatron-LM's ``pretrain_gpt.py``: a model provider, a forward step and a train/valid/test
dataset provider around ``pretrain()``. Every Megatron-LM flag keeps its meaning (data with --data-path
and the tokenizer flags, --save/--load, logging, --use-distributed-optimizer, recompute); agoq adds
``--agoq-*`` (agoq.train.megatron_lm.add_agoq_args). GPU only (megatron.training asserts CUDA).
Commands and the flag set that reproduces scripts/pretrain_llama.py: docs/megatron_lm.md. One GPU:

    torchrun --nproc-per-node 1 scripts/pretrain_gpt_agoq.py \
        --transformer-impl local --normalization RMSNorm --swiglu --disable-bias-linear \
        --position-embedding-type rope --untie-embeddings-and-output-weights --hidden-dropout 0 \
        --attention-dropout 0 --no-bias-swiglu-fusion --no-rope-fusion --no-bias-dropout-fusion \
        --no-gradient-accumulation-fusion --no-persist-layer-norm --bf16 \
        --num-layers 8 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 4 \
        --ffn-hidden-size 1408 --seq-length 512 --max-position-embeddings 512 \
        --micro-batch-size 4 --global-batch-size 16 --train-iters 100 --lr 3e-4 --min-lr 3e-5 \
        --lr-warmup-iters 10 --weight-decay 0.1 --adam-beta2 0.95 --eval-interval 1000 --eval-iters 0 \
        --data-path DATA/text_document --split 969,30,1 --tokenizer-type GPTSentencePieceTokenizer \
        --tokenizer-model DATA/tokenizer.model --agoq-optimizer adamw --agoq-grads int8_b256

The Megatron baseline: the same command with ``--agoq-disable``. ``--agoq-log-json FILE`` appends each
iteration's exact loss (``repr`` of the float) and the CUDA peak, for comparisons with pretrain_llama.py.

A thin user of agoq's zero-edit door (agoq/train/megatron_lm_door.py, ``python -m agoq.megatron_lm`` for any
``pretrain_gpt.py``): run directly, it enters the same door around :func:`main` (flags, refusals in one line, agoq's
seams, the built check, ``--agoq-log-json``). What it adds: its model provider builds agoq's model from the run's
config, so ``--agoq-attention`` applies to the ``--agoq-disable`` baseline too (SDPA by default, as
``pretrain_llama.py --agoq-disable``).
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.training import arguments, get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import core_transformer_config_from_args, pretrain_cfg_container_from_args
from megatron.training.utils import get_blend_and_blend_per_split

from agoq.megatron.megatron_lm import build_gpt_model
from agoq.train import megatron_lm_door
from agoq.train.megatron_lm import RefusedFlags


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One GPTModel chunk over agoq's layer spec (Megatron's local spec with --agoq-attention's core attention when
    --agoq-disable)."""
    run = megatron_lm_door.current_run()
    transformer_config = config if config is not None else core_transformer_config_from_args(get_args())
    return build_gpt_model(run.config, run.options, transformer_config, pre_process=pre_process,
                           post_process=post_process, vp_stage=vp_stage, num_microbatches=get_num_microbatches())


def loss_func(loss_mask, output_tensor):
    """Mean next-token loss of the micro-batch over its unmasked tokens (Megatron's 2-tuple contract: the
    schedule averages over micro-batches), reported averaged over the data-parallel group."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    reported = loss.detach().clone()  # the schedule divides the returned loss in place
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(reported, group=group)
    reported /= torch.distributed.get_world_size(group=group)
    return loss, {"lm loss": reported}


def forward_step(data_iterator, model):
    """(output, loss function) of one micro-batch; every rank reads its own batch (the dataset provider is
    ``is_distributed``), so tensor-parallel ranks need no broadcast."""
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].cuda(non_blocking=True), batch["labels"].cuda(non_blocking=True)
    loss_mask = batch["loss_mask"].cuda(non_blocking=True)
    position_ids = batch["position_ids"].cuda(non_blocking=True)
    mask = batch.get("attention_mask")  # --create-attention-mask-in-dataloader (Megatron-LM's default): causal
    output_tensor = model(tokens, position_ids, None if mask is None else mask.cuda(non_blocking=True), labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Megatron's GPTDataset blend from --data-path (or --mock-data) and Megatron's tokenizer; every split Megatron asks
    for (the door returns none for a split asked for no sample, --eval-iters 0)."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT (agoq) ...")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its loaders (no TP broadcast)


def precheck(args) -> None:
    """What this script's model provider cannot build (the door's own checks refuse the rest)."""
    if args.transformer_impl != "local":
        raise RefusedFlags(f"--transformer-impl {args.transformer_impl}: scripts/pretrain_gpt_agoq.py builds "
                           "Megatron's local spec; add --transformer-impl local, or run Megatron-LM's own "
                           "pretrain_gpt.py through the door (python -m agoq.megatron_lm path/to/pretrain_gpt.py ...), "
                           "which takes Transformer Engine with agoq on or --agoq-disable")
    if args.agoq_disable and args.agoq_attention == "sdpa" and args.attention_dropout:
        raise RefusedFlags(f"--agoq-attention sdpa (this script's default, --agoq-disable too) runs without "
                           f"attention dropout, got --attention-dropout {args.attention_dropout} (Megatron's default "
                           "is 0.1); add --attention-dropout 0, or --agoq-attention megatron")


def main() -> None:
    args = arguments.parse_and_validate_args()  # the door's (megatron_lm_door.install_door)
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)


if __name__ == "__main__":
    megatron_lm_door.run(main, precheck=precheck)
