"""agoq's optimizers under Megatron's distributed optimizer (``--use-distributed-optimizer``).

Seam card
---------
Touches: ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer`` (subclassed:
  ``AgoqDistributedOptimizer``; overrides ``sharded_state_dict`` / ``load_state_dict``, and with 8-bit
  gradients (``--agoq-grads`` store mode) ``_copy_model_grads_to_main_grads`` / ``clip_grad_norm``: the
  shards are read from the 8-bit store one parameter at a time, agoq/megatron/grads/grad_reader.py), its
  precision-aware mode (``OptimizerConfig.use_precision_aware_optimizer`` and
  ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` set after the config is built, measured on
  megatron-core 0.19.2), ``ProcessGroupCollection.setup_process_groups_for_optimizer``, and
  the optimizer-driven buffer layout (``DistributedDataParallel(full_param_layout=...)``,
  ``param_layout.FullParamLayout`` / ``PerBufferParamLayout``, ``group_params_for_buffers``).
Why: Megatron already reduce-scatters gradients into per-rank shards of its flat buffers and
  all-gathers the updated bf16 params after the step. In precision-aware mode it hands the optimizer
  the rank's **bf16 param shards** (views into the DDP param buffer) with gradients in
  ``.decoupled_grad`` and keeps no fp32 main copy, so agoq's states (split-master remainder,
  companded moments) exist for this rank's shard only and nothing else is duplicated:
  per rank, 2 (bf16 params) + grads + (1 + 1.0625 + 1.0625) / d bytes per parameter for FlashAdamW.
  Megatron's own checkpoint formats require every state to have the shard's numel, which codes + scales
  do not; so the two checkpoint methods are replaced (below).
Shard alignment (quantization groups never straddle a shard boundary): :func:`aligned_full_param_layout`
  pads each param's start to ``align`` elements and each bucket's end to a multiple of
  ``dp * align``, so every rank's shard of every param starts at a multiple of ``align`` inside the
  param; ``align`` = lcm(64, block sizes of the state formats). ``model.wrap_ddp(param_alignment=)``
  passes it to DDP. The optimizer checks the property for every shard at construction and raises
  (naming the param and the fix) when a DDP was built without it and it does not hold by chance.
Checkpoint layout (DP-independent): per parameter and state piece (``<name>.master``,
  ``<name>.exp_avg.codes``, ``<name>.exp_avg.scales`` ...) one 1-D ShardedTensor of the *whole*
  parameter's flat state (TP ranks concatenated, as the non-distributed glue saves it) of which this
  rank writes its slice at its global offset (an irregular grid, allowed by megatron-core 0.19.2;
  torch DCP reads any other slicing back). Group-aligned shards make the slice of codes / scales
  exactly the bytes / scales of the rank's groups. Formats are saved for every parameter (one
  ShardedObject each) and checked on load.
Verified on: megatron-core 0.19.2, CPU gloo (tests/megatron/test_dist_optimizer.py: DP=2 train,
  save -> load -> bit-identical next steps, DP 2 -> 1 load).
Limits (raise): one distributed-optimizer instance, no expert-parallel buffers, no Megatron-FSDP.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.param_layout import (
    FullParamLayout,
    PerBufferParamLayout,
    bucket_end_divisor,
    pad_to_divisor,
)
from megatron.core.process_groups_config import ProcessGroupCollection

from agoq.config import flag_for
from agoq.formats import parse_format
from agoq.megatron.grads import grad_reader
from agoq.megatron.optim.megatron_optimizer import STATE_PREFIX, init_all_states
from agoq.optim.base import LOGICAL_SHAPE_ATTR, parse_formats

MEGATRON_PARAM_ALIGN = 64  # megatron.core.optimizer.param_layout.pad_param_start (elements)


def shard_alignment(format_names) -> int:
    """Elements every shard boundary must be a multiple of: lcm(64, block of each quantized format)."""
    blocks = [parse_format(f).block for f in format_names if parse_format(f).quantized]
    return math.lcm(MEGATRON_PARAM_ALIGN, *blocks)


def ddp_bucket_size(ddp_config, dp_size: int, *, disable_bucketing: bool, pp_rank: int) -> int | None:
    """The bucket size DistributedDataParallel.__init__ would use (megatron-core 0.19.2)."""
    if not ddp_config.overlap_grad_reduce or disable_bucketing or pp_rank > 0:
        return None
    return ddp_config.bucket_size or max(40_000_000, 1_000_000 * dp_size)


def _aligned_buffer_layout(params, bucket_size, dp_size, ddp_config, param_indices, align) -> PerBufferParamLayout:
    """Megatron's per-buffer layout (reverse order, buckets, shared-embedding split) with param starts
    padded to ``align`` and bucket ends to lcm(Megatron's divisor, dp * align)."""
    divisor = math.lcm(bucket_end_divisor(dp_size, ddp_config.pad_buckets_for_high_nccl_busbw), dp_size * align)
    index_map, buckets, unpadded = {}, [], []
    start = bucket_start = bucket_id = in_bucket = 0
    end = 0

    def close(last: int) -> int:
        unpadded.append(last - bucket_start)
        padded = pad_to_divisor(last, divisor)
        buckets.append((bucket_start, padded))
        return padded

    for param in params[::-1]:
        start = pad_to_divisor(start, align)
        shared = getattr(param, "shared_embedding", False)
        if shared and in_bucket:
            bucket_start, bucket_id, in_bucket = close(start), bucket_id + 1, 0
            start = bucket_start
        end = start + param.data.nelement()
        index_map[param] = (start, end, bucket_id)
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            bucket_start, bucket_id, in_bucket = close(end), bucket_id + 1, 0
            start = bucket_start
        else:
            start = end
    if in_bucket:
        close(end)
    return PerBufferParamLayout(param_index_map=index_map, bucket_indices=buckets, per_bucket_numel_unpadded=unpadded,
                                param_indices=param_indices, num_optimizer_shards=dp_size)  # fmt: skip


def aligned_full_param_layout(params, bucket_size, dp_size: int, ddp_config, align: int) -> FullParamLayout:
    """A FullParamLayout for DistributedDataParallel(full_param_layout=...) whose DP shards start at
    multiples of ``align`` inside every parameter (see the seam card)."""
    if align % MEGATRON_PARAM_ALIGN:
        raise ValueError(f"align={align} must be a multiple of Megatron's {MEGATRON_PARAM_ALIGN}")
    layouts = {}
    for key, (group, indices) in group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32).items():
        if key.is_expert_parallel:
            raise NotImplementedError("agoq's aligned layout does not handle expert-parallel buffers (MoE)")
        layouts[key] = _aligned_buffer_layout(group, bucket_size, dp_size, ddp_config, indices, align)
    return FullParamLayout(layouts=layouts)


class AgoqDistributedOptimizer(grad_reader.ReadsShardGrads, DistributedOptimizer):
    """Megatron's DistributedOptimizer (precision-aware mode) over an agoq.optim optimizer."""

    grad_reader = None  # agoq.megatron.grads.grad_reader.attach: 8-bit reduced shards, read one param at a time

    def _copy_model_grads_to_main_grads(self):
        if self.grad_reader is None:
            return super()._copy_model_grads_to_main_grads()
        grad_reader.prepare_grads(self)  # nothing assigned: each shard is read in the step

    def clip_grad_norm(self, clip_grad: float) -> float:
        if self.grad_reader is None:
            return super().clip_grad_norm(clip_grad)
        return grad_reader.clip_grad_norm(self, clip_grad)

    def __init__(self, inner, config, model_chunks: list, param_names: dict[int, str]):
        ddp_config = model_chunks[0].ddp_config
        if ddp_config.num_distributed_optimizer_instances != 1 or ddp_config.use_megatron_fsdp:
            raise NotImplementedError(
                f"{flag_for('optimizer.kind')} with the distributed optimizer supports one optimizer instance and no "
                "Megatron-FSDP; drop --num-distributed-optimizer-instances"
            )
        # precision-aware mode: shards of the bf16 params, gradients in .decoupled_grad, no fp32 main copy
        config.use_precision_aware_optimizer = True
        config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
        groups = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model_chunks, False)
        super().__init__(
            inner, config, None, init_all_states, model_chunks=model_chunks,
            per_model_buffers={i: chunk.buffers for i, chunk in enumerate(model_chunks)},
            data_parallel_group=groups["intra_dp_cp_group"], data_parallel_group_gloo=None,
            data_parallel_group_idx=parallel_state.get_model_parallel_group().rank(),
            distributed_optimizer_instance_id=0,
        )  # fmt: skip
        self.grad_stats_parallel_group = groups["intra_dist_opt_group"]
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.param_names = param_names
        inner.grad_attr = "decoupled_grad"
        self.shard_info: dict[int, tuple[torch.nn.Parameter, int, int]] = {}  # id(shard) -> (model param, start, end)
        for model_groups, shard_groups in ((self.model_float16_groups, self.shard_float16_groups),
                                           (self.model_fp32_groups, self.shard_fp32_groups)):  # fmt: skip
            for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
                for model_param, shard in zip(model_group, shard_group, strict=True):
                    rng = self._get_model_param_range_map(model_param)["param"]
                    setattr(shard, LOGICAL_SHAPE_ATTR, model_param.shape)
                    self.shard_info[id(shard)] = (model_param, rng.start, rng.end)
        self._check_alignment()

    # ------------------------------------------------------------------ layout checks and accounting
    def _check_alignment(self) -> None:
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                model_param, start, end = self.shard_info[id(shard)]
                for name, fmt in self.optimizer.formats_for(shard, group).items():
                    b = fmt.block
                    if fmt.quantized and (start % b or (end % b and end != model_param.numel())):
                        raise ValueError(
                            f"distributed optimizer shard [{start}, {end}) of {self.param_names[id(model_param)]} "
                            f"({model_param.numel()} elements) splits a {b}-element quantization group of "
                            f"{name} ({fmt.name}): build DDP with agoq.megatron.model.wrap_ddp(param_alignment="
                            f"{math.lcm(MEGATRON_PARAM_ALIGN, b)}) (scripts/pretrain_llama.py does), or choose "
                            "state formats with blocks of 32/64 elements"
                        )

    def model_formats(self) -> dict[str, str]:
        """Every model parameter's state formats (identical on all ranks; saved and checked on load)."""
        defaults = self.optimizer.defaults
        out = {}
        for chunk in self.model_chunks:
            for param in chunk.parameters():
                if param.requires_grad:
                    fmts = self.optimizer.formats_for(param, defaults)
                    master = self.optimizer.master_for(param, defaults)
                    out[self.param_names[id(param)]] = ";".join(
                        [f"{n}={f.name}" for n, f in fmts.items()] + [f"master={master}"]
                    )
        return out

    # ------------------------------------------------------------------ checkpoints
    def _pieces(self):
        """(key, flat state tensor, global offset, global length, model param) for every state tensor."""
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                state = self.optimizer.state[shard]
                model_param, start, _ = self.shard_info[id(shard)]
                name = self.param_names[id(model_param)]
                fmts = dict(parse_formats(state["formats"]))
                total = model_param.numel()
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor) or key == "step" or value.numel() == 0:
                        continue
                    if key == "master":
                        lo, size = start, total
                    else:
                        state_name, part = key.rsplit(".", 1)
                        fmt = fmts[state_name]
                        count = fmt.code_bytes if part == "codes" else fmt.num_blocks
                        lo, size = count(start), count(total)
                    yield f"{name}.{key}", value.reshape(-1), lo, size, model_param

    @staticmethod
    def _sharded(key: str, flat: torch.Tensor, lo: int, size: int, model_param) -> ShardedTensor:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if getattr(model_param, "tensor_model_parallel", False):
            offset, global_size, replica = tp_rank * size + lo, tp_size * size, (0, 0, 0)
        else:
            offset, global_size, replica = lo, size, (0, tp_rank, 0)
        return ShardedTensor(f"{STATE_PREFIX}.{key}", flat, flat.dtype, (flat.numel(),), (global_size,), (offset,),
                             axis_fragmentations=None, replica_id=replica)  # fmt: skip

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        init_all_states(self.optimizer)  # states exist (zeros) even before the first step
        steps = {float(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError(f"agoq optimizer states disagree on the step count: {sorted(steps)}")
        pieces = {key: self._sharded(key, flat, lo, size, mp) for key, flat, lo, size, mp in self._pieces()}
        # one object per parameter (the common state is rank 0's alone, which lacks other stages' params)
        replica = (0, parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_data_parallel_rank(with_context_parallel=True))  # fmt: skip
        formats = {name: ShardedObject(f"{STATE_PREFIX}.{name}.formats", text, (1,), (0,), replica_id=replica)
                   for name, text in self.model_formats().items()}  # fmt: skip
        return {"agoq_pieces": pieces, "agoq_formats": formats,
                "state": {"common_step": steps.pop() if steps else 0.0}, "param_groups": []}  # fmt: skip

    def load_state_dict(self, state_dict):
        saved = state_dict.get("agoq_formats")
        if saved is not None:
            saved = {n: (v.data if isinstance(v, ShardedObject) else v) for n, v in saved.items()}
            bad = {n: (saved.get(n), f) for n, f in self.model_formats().items() if saved.get(n) != f}
            if bad:
                name, (old, new) = next(iter(bad.items()))
                raise ValueError(f"checkpoint optimizer states were saved as {old!r} for {name} (and "
                                 f"{len(bad) - 1} more), this run uses {new!r}: load with the same "
                                 f"{flag_for('optimizer.kind')}/{flag_for('optimizer.moments')}/"
                                 f"{flag_for('optimizer.master')}/{flag_for('optimizer.small_numel')}")  # fmt: skip
        if "agoq_pieces" not in state_dict:
            raise ValueError("this checkpoint's agoq optimizer states were saved without --use-distributed-optimizer; "
                             "resume with the same setting (the two state layouts differ)")  # fmt: skip
        loaded = state_dict["agoq_pieces"]
        step = torch.tensor(float(state_dict["state"]["common_step"]), dtype=torch.float32)
        held = {key: flat for key, flat, *_ in self._pieces()}
        missing = sorted(set(held) - set(loaded))
        if missing:
            raise KeyError(f"checkpoint lacks agoq optimizer states {missing[:3]} ({len(missing)} in all)")
        for key, flat in held.items():
            value = loaded[key]
            flat.copy_(value.data.reshape(-1) if isinstance(value, ShardedTensor) else value.reshape(-1))
        for state in self.optimizer.state.values():
            state["step"] = step.clone()
