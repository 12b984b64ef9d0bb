"""Pretrain a LLaMA-architecture model on megatron-core with agoq (the shape of Megatron's pretrain_gpt.py).

Tiny model, 2 processes, pipeline-parallel 2, on the CPU when there is no GPU (built-in corpus):

    torchrun --nproc-per-node 2 scripts/pretrain_llama.py --config configs/model/tiny.yaml \
        --pipeline-model-parallel-size 2 --train-iters 30

One GPU, a ~350M model, your data, checkpoints every 500 iterations:

    torchrun --nproc-per-node 1 scripts/pretrain_llama.py --config configs/model/llama-350m.yaml \
        --data-path data/mydata --tokenizer-model data/tokenizer.model --save ckpt --save-interval 500

Resume: the same command with ``--load ckpt``. Baseline without agoq: ``--agoq-disable``.
All flags: ``python scripts/pretrain_llama.py --help``. Environment: ``AGOQ_CACHE`` (default data cache,
default ~/.cache/agoq), and torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from agoq.train.args import data_blend, parse_and_check, policy_path  # no torch, no megatron
from agoq.train.known_warnings import filter_known_warnings  # no torch, no megatron

if __name__ in ("__main__", "__mp_main__") and os.environ.get("AGOQ_SHOW_KNOWN_WARNINGS") != "1":
    # megatron-core / torch warnings known to be harmless here, ignored before torch loads: in this process
    # and in the checkpoint writer dist_checkpointing spawns (it re-imports this file as __mp_main__)
    filter_known_warnings()

if __name__ == "__main__":
    # Flags, config file, policy, layout and --data-path files are checked before torch and megatron load
    # (~5 s): a mistake stops in about a second, in one line (agoq.train.args.parse_and_check).
    ARGS = parse_and_check(sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print("pretrain_llama.py: arguments checked; loading torch and megatron-core ...", flush=True)

import torch  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from agoq.cli.optim_args import check_release_flags  # noqa: E402
from agoq.data.tokenizer import Tokenizer, model_vocab_size, padded_vocab_size  # noqa: E402
from agoq.megatron import model as mmodel  # noqa: E402
from agoq.megatron.activations import storage_of, storage_table  # noqa: E402
from agoq.megatron.ckpt.save import CheckpointSaveError  # noqa: E402
from agoq.megatron.compute import check_compute, compute_report  # noqa: E402
from agoq.megatron.grads.ddp import wrap_ddp_agoq  # noqa: E402
from agoq.megatron.layer_plan import plan_of  # noqa: E402
from agoq.megatron.optim.optimizer import shard_alignment_for  # noqa: E402
from agoq.megatron.optim.release import TrainingStopped, wrap_release  # noqa: E402
from agoq.ops.saved_act import SavePaths  # noqa: E402
from agoq.policy import ScheduleInfo  # noqa: E402
from agoq.train import data as mdata  # noqa: E402
from agoq.train.megatron_setup import MegatronLoop, ddp_config  # noqa: E402
from agoq.train.pretrain import pretrain, print_rank0  # noqa: E402
from agoq.train.training import configure_grad_hooks  # noqa: E402


def model_provider(args, layout, tokenizer, info, num_microbatches):
    """Model chunks of this pipeline rank (DDP-wrapped), their LlamaShape and the layer spec used.
    Megatron's flags from ``args``; agoq's settings from ``args.agoq_config`` (built once by parse_args)."""
    agoq = args.agoq_config
    shape = mmodel.LlamaShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length, rotary_base=args.rotary_base, norm_epsilon=args.norm_epsilon,
        init_method_std=args.init_method_std,
        vocab_size=padded_vocab_size(model_vocab_size(tokenizer.vocab_size, args.vocab_size), layout.tp,
                                     args.make_vocab_size_divisible_by),
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        unpadded_vocab_size=model_vocab_size(tokenizer.vocab_size, args.vocab_size),
    )
    if args.vocab_size and args.vocab_size != tokenizer.vocab_size:
        print_rank0(f"vocabulary: {args.vocab_size} rows from --vocab-size (the tokenizer has {tokenizer.vocab_size}; "
                    f"the data's ids stay below it), padded to {shape.vocab_size}")
    print_rank0(f"model: {shape.num_parameters() / 1e6:.2f}M parameters, embeddings "
                + ("tied (--tie-embeddings-and-output-weights)" if shape.share_embeddings_and_output_weights else
                   "untied (--untie-embeddings-and-output-weights, the default)")
                + (f", RoPE base {shape.rotary_base} scaled by {shape.rope_scaling_factor:g} (--use-rope-scaling)"
                   if shape.rope_scaling else f", RoPE base {shape.rotary_base}"))
    layout.check(shape, info.world_size)
    params_dtype = torch.float32 if args.fp32 else torch.bfloat16
    config = mmodel.llama_transformer_config(
        shape, layout, params_dtype=params_dtype, use_cpu_initialization=info.is_cpu,
        recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
        selective_recompute=args.recompute_granularity == "selective",
        cuda_graph_impl=args.cuda_graph_impl, cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        rope_fusion=agoq.rope_fused(on_cuda=not info.is_cpu), sequence_parallel=args.sequence_parallel,
    )
    if config.apply_rope_fusion:
        from agoq.megatron.rope import qkv_rope_fusion_provider, rope_fusion_provider

        qkv = (f", with the QKV split by {qkv_rope_fusion_provider()}" if config.fused_single_qkv_rope
               else " (Megatron's QKV split: a tensor-parallel rank holds part of a query group)")
        print_rank0(f"RoPE: fused, by {rope_fusion_provider()}{qkv} (--rope-fusion {agoq.rope_fusion}; off: "
                    "Megatron's split and unfused RoPE)")
    else:
        print_rank0(f"RoPE: Megatron's unfused RoPE (--rope-fusion {agoq.rope_fusion}; agoq's fused kernel: "
                    "--rope-fusion agoq, the default with agoq on a GPU)")
    schedule = ScheduleInfo(pp_size=layout.pp, vp_size=layout.vpp, num_microbatches=num_microbatches)
    compute = agoq.fp8 if agoq.enabled else None
    if compute is not None:
        check_compute(compute, info.device, num_layers=shape.num_layers, hidden=shape.hidden_size,
                      ffn=shape.ffn_hidden_size, heads=shape.num_attention_heads, groups=shape.num_query_groups,
                      tp=layout.tp, tokens_per_microbatch=args.seq_length * args.micro_batch_size)
    spec = mmodel.agoq_layer_spec(args.attention_backend, policy=agoq.policy.spec, schedule=schedule,
                                  compute=compute, save_paths=SavePaths(fuse_swiglu_fp8=agoq.kernels.fuse_swiglu_fp8))
    chunks = mmodel.build_model_chunks(shape, config, spec, layout.vpp)
    if agoq.optimizer.gradient_release:
        check_release_flags(args, data_parallel=info.world_size // (layout.tp * layout.pp))
        model = wrap_release(chunks, config, info.device)
    elif not agoq.grads.quantized:  # --agoq-grads, else the policy's default: {grads: ...} (agoq.config)
        model = mmodel.wrap_ddp(chunks, config, ddp_config(args, params_dtype), info.device,
                                param_alignment=shard_alignment_for(agoq.optimizer, args.use_distributed_optimizer))
    else:
        model = wrap_ddp_agoq(chunks, config, ddp_config(args, params_dtype), info.device, agoq.grads)
        for transport, why in dict.fromkeys(model[0].agoq_transport.values()):
            print_rank0(f"agoq grads: {agoq.grads.format} reduced over the {transport} transport ({why})")
    configure_grad_hooks(model, config)
    return model, shape, spec


def train_valid_test_datasets_provider(args):
    """(tokenizer, factory(consumed_samples, consumed_valid_samples) -> (train, valid, test) micro-batch iterators).

    Rank 0 builds caches first; ``valid`` and ``test`` are None without --eval-interval (or with --eval-iters 0)."""
    cache_dir = Path(args.data_cache_dir or os.environ.get("AGOQ_CACHE") or mdata.default_cache_dir())
    if args.data_path:  # checked with the tokenizer before torch loaded (agoq.train.preflight)
        blend, tokenizer_path = data_blend(args.data_path), Path(args.tokenizer_model)
        tokenizer = Tokenizer.load(tokenizer_path)
    else:
        paths = mdata.ensure_default_dataset_distributed(cache_dir, progress=print_rank0)  # rank 0 builds first
        blend, tokenizer_path = [str(paths.prefix)], paths.tokenizer_model
        tokenizer = Tokenizer.load(tokenizer_path)
        mdata.check_dataset_files(blend, split=args.split, tokenizer=tokenizer)
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)

    eval_iters = args.eval_iters if args.eval_interval else 0

    def factory(consumed_samples: int, consumed_valid_samples: int):
        train_iter, valid_iter, test_iter = mdata.build_data_iterators(
            blend, tokenizer,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, dp_rank=dp_rank, dp_size=dp_size,
            train_iters=args.train_iters, seed=args.seed, split=args.split,
            consumed_samples=consumed_samples, cache_dir=cache_dir / "indices",
            eval_iters=eval_iters, eval_interval=args.eval_interval, consumed_valid_samples=consumed_valid_samples,
            is_built_on_rank=lambda: True,
        )
        return train_iter, valid_iter, test_iter

    return tokenizer, factory


def policy_report(args, shape, layout, spec) -> str:
    """The policy file's resolved per-layer, per-role table for every stage (rank 0 prints; the file's own
    text and comments are in the file), from the model's plan the layer spec carries (agoq.megatron.layer_plan: the
    object whose rows the layers were built with)."""
    agoq = args.agoq_config
    if not agoq.enabled:
        return "agoq: disabled (--agoq-disable): plain Megatron baseline"
    path, table = policy_path(args), plan_of(spec).table(shape.num_layers)
    return (
        f"agoq policy {path}, resolved per layer and role (all stages):\n{table}\n"
        f"gradients: {_gradients_line(agoq)}"
        + (f" ({agoq.grads.mode} mode)" if agoq.grads.format else "")
        + f"\n{compute_report(agoq.fp8, shape.num_layers, plain_swiglu_fusion=agoq.kernels.fuse_swiglu_fp8)}"
    )


def _gradients_line(agoq) -> str:
    if agoq.optimizer.gradient_release:
        return "no buffer (--agoq-gradient-release: each parameter is stepped and its gradient freed in backward)"
    return agoq.grads.format_name or "Megatron float main_grad"


def storage_report(spec) -> str | None:
    """What this rank's layers really store for backward (printed once per pipeline stage)."""
    storage = storage_of(spec)
    return None if storage is None else f"activations stored for backward on this stage:\n{storage_table(storage)}"


def main(argv=None, args=None) -> int:
    args = args if args is not None else parse_and_check(argv)
    try:
        pretrain(args, model_provider, train_valid_test_datasets_provider, policy_report, storage_report,
                 MegatronLoop(schedule=get_forward_backward_func, lr_schedule=OptimizerParamScheduler))
    except (ValueError, FileNotFoundError, NotImplementedError) as exc:  # bad input: one line, no traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_llama.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except TrainingStopped as exc:  # a documented stop (gradient release met a non-finite gradient)
        print(f"pretrain_llama.py: stopped: {exc}", file=sys.stderr, flush=True)
        return 1
    except CheckpointSaveError as exc:  # every rank raises it, with every rank's reason: rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_llama.py: stopped: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":  # dist_checkpointing's writer re-imports __main__ in a spawned process
    from agoq.train.leave import leave

    leave(main(args=ARGS))  # atexit handlers and flushed streams, without the interpreter's teardown (agoq.train.leave)
