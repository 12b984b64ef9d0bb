"""A ``pretrain_gpt.py`` of the shapes megatron.training 0.19.x drives (written for agoq's tests; no Megatron-LM
code copied), for the zero-edit door (``python -m agoq.megatron_lm``). ``AGOQ_TEST_SHAPE`` picks how the model is
built; nothing here imports agoq except the ``hooks`` shape:

* ``builder`` (Megatron-LM's core_r0.19.0 pretrain_gpt.py): ``pretrain(pretrain_cfg_container_from_args(args,
  gpt_config_from_args(args)), ...)`` without a model provider; megatron.training builds the model with
  ``GPTModelBuilder`` and wraps it with ``megatron.training.models.dist_utils``' DDP.
* ``provider``: ``pretrain(pretrain_cfg_container_from_args(args), ..., model_provider=...)`` with a provider in the
  manner of Megatron-LM's ``gpt_builder`` (the layer spec from ``--spec`` when given, else Megatron's local spec);
  ``get_model`` wraps with ``megatron.training.training.DDP``.
* ``hooks``: the ``builder`` shape plus the hooks agoq's earlier docs asked for (agoq's flags, config and
  ``install_for_megatron_training``), run without the door: agoq's DDP and optimizer come in, its layers do not, and
  the built check must stop the run before the first step.

Like Megatron-LM's script, the data loader makes its attention mask (``--create-attention-mask-in-dataloader``, on
by default), which goes to the model; the dataset provider returns every split Megatron asks for, also with
``--eval-iters 0``. The loss function is Megatron's 2-tuple contract (mean over a micro-batch's unmasked tokens,
averaged over micro-batches by the schedule), which agoq's own trainer uses too.
"""

from __future__ import annotations

import os
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import import_module
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

SHAPE = os.environ.get("AGOQ_TEST_SHAPE", "builder")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    spec = import_module(args.spec) if args.spec is not None else get_gpt_layer_local_spec(
        normalization=args.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                    parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage,
                    pg_collection=pg_collection)


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach().clone()}  # clone: the schedule divides the returned loss in place


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].cuda(non_blocking=True), batch["labels"].cuda(non_blocking=True)
    loss_mask, position_ids = batch["loss_mask"].cuda(non_blocking=True), batch["position_ids"].cuda()
    mask = batch.get("attention_mask")
    output = model(tokens, position_ids, None if mask is None else mask.cuda(), labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples,
                                         lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()


datasets_provider.is_distributed = True


def main() -> None:
    if SHAPE == "hooks":
        from agoq.megatron.megatron_lm import install_for_megatron_training
        from agoq.train.megatron_lm import add_agoq_args, agoq_config_from_megatron_args

        args = parse_and_validate_args(extra_args_provider=add_agoq_args)
        install_for_megatron_training(agoq_config_from_megatron_args(args))
    else:
        args = parse_and_validate_args()
    if SHAPE == "provider":
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
                 forward_step, model_provider=model_provider)
    else:
        pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), datasets_provider,
                 ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
