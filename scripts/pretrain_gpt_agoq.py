"""Pretrain a LLaMA-architecture GPT with Megatron-LM's own trainer (``megatron.training.pretrain``) and agoq.

The shape of Megatron-LM's ``pretrain_gpt.py``: a model provider, a forward step and a train/valid/test
dataset provider around ``pretrain()``. Every Megatron-LM flag keeps its meaning (data with --data-path
and the tokenizer flags, --save/--load, logging, --use-distributed-optimizer, recompute); agoq adds
``--agoq-*`` (agoq.megatron.train.megatron_lm.add_agoq_args). GPU only (megatron.training asserts CUDA).
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
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import core_transformer_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

from agoq.megatron.megatron_lm import build_gpt_model, describe, install_for_megatron_training
from agoq.megatron.train.megatron_lm import add_agoq_args, agoq_config_from_megatron_args, gpt_model_options

AGOQ = None  # the run's AgoqConfig, built once in main()
MODEL_OPTIONS = None  # its GPTModelOptions (vocabulary, attention, RoPE) from Megatron's args
LOSS_LOG = {"pending": [], "iteration": 0}  # --agoq-log-json: micro-batch losses of the running iteration


def extra_args_provider(parser):
    add_agoq_args(parser)
    parser.add_argument("--agoq-log-json", default=None,
                        help="append one JSON line per training iteration: exact lm loss and CUDA peak bytes")
    return parser


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """One GPTModel chunk over agoq's layer spec (Megatron's model when --agoq-disable)."""
    args = get_args()
    transformer_config = config if config is not None else core_transformer_config_from_args(args)
    return build_gpt_model(AGOQ, MODEL_OPTIONS, transformer_config, pre_process=pre_process,
                           post_process=post_process, vp_stage=vp_stage, num_microbatches=get_num_microbatches())


def loss_func(loss_mask, training, output_tensor):
    """Mean next-token loss of the micro-batch over its unmasked tokens (Megatron's 2-tuple contract: the
    schedule averages over micro-batches), reported averaged over the data-parallel group."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    reported = loss.detach().clone()  # the schedule divides the returned loss in place
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(reported, group=group)
    reported /= torch.distributed.get_world_size(group=group)
    if training:
        _log_loss(reported)
    return loss, {"lm loss": reported}


def _log_loss(reported) -> None:
    args = get_args()
    if not args.agoq_log_json:
        return
    LOSS_LOG["pending"].append(reported)
    if len(LOSS_LOG["pending"]) < get_num_microbatches():
        return
    loss = float(torch.stack(LOSS_LOG["pending"]).mean().item())  # as the train step's reduction
    LOSS_LOG["pending"].clear()
    LOSS_LOG["iteration"] += 1
    _append_json(args.agoq_log_json, {"iteration": args.iteration + LOSS_LOG["iteration"], "lm_loss": loss,
                                      "peak_bytes_so_far": torch.cuda.max_memory_allocated()})


def _append_json(path: str, record: dict) -> None:
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and \
            parallel_state.get_tensor_model_parallel_rank() == 0 and \
            parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def forward_step(data_iterator, model):
    """(output, loss function) of one micro-batch; every rank reads its own batch (the dataset provider is
    ``is_distributed``), so tensor-parallel ranks need no broadcast."""
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].cuda(non_blocking=True), batch["labels"].cuda(non_blocking=True)
    loss_mask = batch["loss_mask"].cuda(non_blocking=True)
    position_ids = batch["position_ids"].cuda(non_blocking=True)
    output_tensor = model(tokens, position_ids, None, labels=labels)
    return output_tensor, partial(loss_func, loss_mask, model.training)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Megatron's GPTDataset blend from --data-path (or --mock-data) and Megatron's tokenizer; None for a split
    that is asked for no samples."""
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
    # a split asked for no samples (--eval-iters 0) gets no loader: Megatron would assert on an empty split
    return [None if wanted == 0 else ds for ds, wanted in zip(datasets, train_val_test_num_samples, strict=True)]


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its loaders (no TP broadcast)


def main() -> None:
    global AGOQ, MODEL_OPTIONS
    args = parse_and_validate_args(extra_args_provider=extra_args_provider)
    AGOQ = agoq_config_from_megatron_args(args)  # raises naming the flag for combinations agoq cannot run
    MODEL_OPTIONS = gpt_model_options(args)
    handle = install_for_megatron_training(AGOQ)
    print_rank_0(describe(AGOQ))
    try:
        pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
        if args.agoq_log_json:
            _append_json(args.agoq_log_json, {"final": True, "peak_bytes": torch.cuda.max_memory_allocated()})
    finally:
        handle.undo()


if __name__ == "__main__":
    main()
