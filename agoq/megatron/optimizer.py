"""Megatron glue for agoq.optim: build_agoq_optimizer(config, megatron_config, model_chunks) -> optimizer,
the agoq counterpart of Megatron's get_megatron_optimizer (agoq.megatron.train.pretrain.build_optimizer). ``config``
is the run's AgoqConfig (its ``optimizer`` section: kind, state formats, master; ``grads.reduce_in_bf16``);
``megatron_config`` is Megatron's OptimizerConfig (lr, weight decay, Adam betas / eps, clipping, dtype,
distributed optimizer) that the trainer builds; the trainer builds the LR schedule too.

Path (../shared/spec/megatron.md §1.4): without --use-distributed-optimizer, agoq's optimizer runs directly on the
bf16 model params inside Megatron's FP32Optimizer wrapper (which copies param.main_grad to .grad,
clips by the global norm and steps), so no fp32 main-param copy exists: the split master replaces it.
Megatron's LR schedule writes group["lr"] / group["weight_decay"] (wd_mult 0 for biases and 1-D
params, Megatron's default rule). Checkpoints: AgoqMegatronOptimizer.sharded_state_dict saves the
quantized codes, scales and remainders as they are (flat ShardedTensors keyed by the model param's
key, replicated over DP, so any DP size loads them), and no torch param groups: those differ between
pipeline stages, and a load keeps the live ones (hyperparameters are this run's flags; lr and weight
decay follow the LR schedule).
With --use-distributed-optimizer: agoq.megatron.dist_optimizer.AgoqDistributedOptimizer (Megatron's
DistributedOptimizer in precision-aware mode; agoq states for this rank's shard only; DP-independent
compressed checkpoints), with DP shards aligned to the quantization groups (shard_alignment_for).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import FP32Optimizer

from agoq.config import AgoqConfig, parse_moments
from agoq.megatron import grad_reader
from agoq.optim import SGD, AdamW, Lion
from agoq.optim.release import check_release_compatible

STATE_PREFIX = "optimizer.agoq_state"


def param_groups(model_chunks: list) -> list[dict]:
    """Megatron's default grouping: no weight decay for biases and 1-D params (norm gains)."""
    decay, no_decay = [], []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    groups = [dict(params=decay, wd_mult=1.0), dict(params=no_decay, wd_mult=0.0)]
    return [dict(g, default_config=True) for g in groups if g["params"]]


def make_agoq_optimizer(config: AgoqConfig, megatron_config: OptimizerConfig, groups: list[dict]):
    opt, mc = config.optimizer, megatron_config
    states = opt.states  # parsed once by the config; the param groups carry the names (saved in checkpoints)
    m_fmt = states.m.name
    # The fused Triton step needs a GPU (or Triton's CPU interpreter, TRITON_INTERPRET=1, as the kernel
    # tests use: config.triton_interpret); otherwise (CI, CPU mode) the plain-PyTorch reference step runs,
    # which computes the same values (tests/kernels/test_optim_kernels.py). The choice is printed at start.
    fused = not opt.unfused and (torch.cuda.is_available() or config.triton_interpret)
    common = dict(master=opt.master, fused=fused, small_numel=opt.small_numel)
    if opt.kind == "adamw":
        return AdamW(groups, lr=mc.lr, betas=(mc.adam_beta1, mc.adam_beta2), eps=mc.adam_eps,
                     weight_decay=mc.weight_decay, state_formats={"exp_avg": m_fmt, "exp_avg_sq": states.v.name},
                     **common)  # fmt: skip
    if opt.kind == "lion":
        return Lion(groups, lr=mc.lr, betas=(opt.lion_beta1, opt.lion_beta2),
                    weight_decay=mc.weight_decay, state_formats={"exp_avg": m_fmt}, **common)  # fmt: skip
    return SGD(groups, lr=mc.lr, momentum=opt.sgd_momentum, nesterov=opt.sgd_nesterov,
               weight_decay=mc.weight_decay, state_formats={"momentum_buffer": m_fmt}, **common)  # fmt: skip


def _init_all_states(optimizer, _config=None) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.init_state(p, group)


def _layer_global_names(model_chunks: list) -> dict[int, str]:
    names = {}
    for chunk in model_chunks:
        for layer_name, layer in chunk.named_modules():
            if not hasattr(layer, "layer_number") or not layer_name.split(".")[-1].isdigit():
                continue
            prefix = layer_name[: layer_name.rfind(".") + 1] + str(layer.layer_number - 1)
            for param_name, param in layer.named_parameters():
                names[id(param)] = f"{prefix}.{param_name}"
    for chunk in model_chunks:
        for param_name, param in chunk.named_parameters():
            names.setdefault(id(param), param_name)
    return {k: v.removeprefix("module.").removeprefix("module.") for k, v in names.items()}


def _tp_fragment(param) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """(rank offsets, replica id) of a parameter's flat state under tensor parallelism."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if getattr(param, "tensor_model_parallel", False):
        return (0, tp_rank, tp_size), (0, 0, dp_rank)
    return (0, 0, 1), (0, tp_rank, dp_rank)


class AgoqMegatronOptimizer(FP32Optimizer):
    """FP32Optimizer over agoq.optim (works on bf16 params: agoq keeps the master), with compressed
    sharded checkpoints."""

    grad_reader = None  # set by agoq.megatron.grad_reader.attach: 8-bit gradients read one param at a time

    def clip_grad_norm(self, clip_grad: float) -> float:
        if self.grad_reader is not None:
            return grad_reader.clip_grad_norm(self, clip_grad)
        return super().clip_grad_norm(clip_grad)

    def step_with_ready_grads(self) -> bool:
        if self.grad_reader is not None:
            return grad_reader.step_with_ready_grads(self)
        return super().step_with_ready_grads()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        if self.grad_reader is not None:
            return grad_reader.prepare_grads(self)
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            # bf16 main_grad (--grad-reduce-in-bf16): Megatron's clip path asserts an fp32 .grad, its
            # decoupled path (as in the distributed optimizer's precision-aware mode) reads .decoupled_grad
            # of either dtype; agoq's step reads it too (grad_attr, set in build_agoq_optimizer).
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    if hasattr(param, "main_grad"):
                        param.decoupled_grad = param.main_grad
            return False
        # FP32Optimizer assigns param.main_grad (fp32 with grad_reduce_in_fp32) to the bf16 param's
        # .grad; torch >= 2.10 refuses a dtype mismatch unless grad_dtype is None. agoq reads any dtype.
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad") and param.main_grad.dtype != param.dtype:
                    param.grad_dtype = None
        return super().prepare_grads()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        """{"state": {param name: {state key: ShardedTensor}, "common_step": step}}.

        Keyed by the model param's name, not torch's per-rank param index, and without torch's
        param_groups: under pipeline parallelism every stage holds other params, and the common
        (non-tensor) part of a checkpoint is rank 0's alone. Non-tensor and empty states (the formats
        string, an absent master remainder) are not saved: load keeps the live ones, which follow from
        the run's settings (the resume record makes sure they are the checkpoint's)."""
        if is_loading:
            _init_all_states(self.optimizer)
        states, steps = {}, set()
        for param in self.get_parameters():
            live = self.optimizer.state.get(param)
            if not live:
                continue
            name = self.param_names[id(param)]
            offsets, replica_id = _tp_fragment(param)
            if "step" in live:
                steps.add(float(live["step"]))
            states[name] = {
                key: ShardedTensor.from_rank_offsets(f"{STATE_PREFIX}.{name}.{key}", value.reshape(-1), offsets,
                                                     replica_id=replica_id)
                for key, value in _saved_tensors(live)
            }  # fmt: skip
        if len(steps) > 1:
            raise RuntimeError(f"agoq optimizer states disagree on the step count: {sorted(steps)}")
        states["common_step"] = steps.pop() if steps else 0.0
        return {"state": states}

    def load_state_dict(self, state_dict):
        """Copy the loaded tensors into the live states (which _init_all_states created), param by param."""
        if "agoq_pieces" in state_dict:
            raise ValueError("this checkpoint's agoq optimizer states were saved with --use-distributed-optimizer; "
                             "resume with the same setting (the two state layouts differ)")  # fmt: skip
        saved = state_dict["state"]
        _init_all_states(self.optimizer)
        step = saved.get("common_step")
        for param in self.get_parameters():
            name = self.param_names[id(param)]
            live = self.optimizer.state[param]
            for key, value in _saved_tensors(live):
                loaded = saved.get(name, {}).get(key)
                if not isinstance(loaded, torch.Tensor) or loaded.numel() != value.numel():
                    raise KeyError(f"checkpoint lacks agoq optimizer state {name}.{key} of {value.numel()} "
                                   f"elements (found {type(loaded).__name__})")  # fmt: skip
                value.copy_(loaded.reshape(value.shape))
            if step is not None:
                live["step"] = torch.tensor(float(step), dtype=torch.float32)
        self.optimizer.drop_plans()


def _saved_tensors(state: dict):
    """The (key, tensor) pairs of one param's state that a checkpoint holds."""
    for key, value in state.items():
        if key != "step" and isinstance(value, torch.Tensor) and value.numel() > 0:
            yield key, value


def keep_autograd_grad_dtype(params) -> None:
    """``grad_dtype = None``: autograd keeps each gradient in the dtype its backward produced instead of
    casting it to the param's dtype (torch >= 2.10). Measured on torch 2.14 CPU: torch's RMSNorm gives a
    bf16 gain an fp32 weight gradient, so the norm gains' gradients keep fp32 precision (the matmul
    weights' stay bf16). Megatron's fp32 main_grad receives them; gradient release steps with them."""
    for p in params:
        p.grad_dtype = None


def build_agoq_optimizer(agoq_config: AgoqConfig, config: OptimizerConfig, model_chunks: list):
    """agoq's optimizer (``agoq_config.optimizer.kind`` adamw|lion|sgd) over ``model_chunks`` in Megatron's
    optimizer interface; ``config``: Megatron's OptimizerConfig of the run (a copy is kept and adjusted). The
    caller keeps Megatron's own optimizer for kind torch and builds the LR schedule."""
    import copy

    if not agoq_config.optimizer.agoq:
        raise ValueError(
            "build_agoq_optimizer needs --agoq-optimizer adamw|lion|sgd (torch = pretrain.build_optimizer)"
        )
    if agoq_config.optimizer.gradient_release:  # the trainer checked its flags; what the process groups say
        check_release_compatible(pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size(),
                                 data_parallel=parallel_state.get_data_parallel_world_size(),
                                 clip_grad=config.clip_grad)  # fmt: skip
    config = copy.copy(config)
    inner = make_agoq_optimizer(agoq_config, config, param_groups(model_chunks))
    names = _layer_global_names(model_chunks)
    if config.use_distributed_optimizer:
        from agoq.megatron.dist_optimizer import AgoqDistributedOptimizer

        optimizer = AgoqDistributedOptimizer(inner, config, model_chunks, names)
        grad_reader.attach(optimizer, model_chunks)  # 8-bit gradient store: shards read one param at a time
    elif agoq_config.optimizer.gradient_release:
        from agoq.megatron.graphs import check_cuda_graphs
        from agoq.megatron.release import AgoqReleaseOptimizer

        # it steps each parameter in a backward hook, which a graphed backward never calls
        check_cuda_graphs(model_chunks[0].config, ["gradient_release"])

        optimizer = AgoqReleaseOptimizer(inner, config, _init_all_states, model_chunks)  # steps in backward hooks
        optimizer.param_names = names
        return optimizer
    else:
        optimizer = AgoqMegatronOptimizer(inner, config, _init_all_states)
        optimizer.param_names = names
        grad_reader.attach(optimizer, model_chunks)  # 8-bit gradient store: per-parameter reads, no float buffer
        if agoq_config.grads.reduce_in_bf16:
            config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True  # see prepare_grads
            inner.grad_attr = "decoupled_grad"
        elif optimizer.grad_reader is None:
            # prepare_grads sets grad_dtype = None from the first step on; doing it now makes the first
            # backward like every later one (see keep_autograd_grad_dtype)
            keep_autograd_grad_dtype([p for g in inner.param_groups for p in g["params"]
                                      if getattr(p, "main_grad", None) is not None and p.main_grad.dtype != p.dtype])
    return optimizer


def shard_alignment_for(options, distributed_optimizer: bool) -> int | None:
    """Elements the DDP buffer layout must align DP shards to for agoq's optimizer (``options``: an
    ``AgoqConfig.optimizer``) with --use-distributed-optimizer (None otherwise): see agoq.megatron.dist_optimizer."""
    if not options.agoq or not distributed_optimizer:
        return None
    from agoq.megatron.dist_optimizer import shard_alignment

    return shard_alignment(parse_moments(options.moments))
