"""Train the same model from the same weights in several parallel layouts (layout-equivalence tests' helper).

``run_layouts(rank, world_size, reference_state, cases, ...)`` builds, for each case, the model chunks the
way ``scripts/pretrain_llama.py`` does (its own ``model_provider``: agoq spec, DDP or agoq's gradient
wrappers, Megatron's optimizer and LR schedule), overwrites every parameter with ``reference_state`` (keyed
by *global* parameter name, so PP=1 and PP=2 x VPP=2 hold identical weights), and runs
``ITERATIONS`` real training steps (``agoq.train.training.StepRunner``: Megatron's schedules,
``finalize_model_grads``, optimizer step, LR schedule) on a fixed, learnable token stream.

Per case it returns the loss and grad norm of every iteration and the reduced iteration-1 gradient of
every parameter this rank owns (global names; the distributed optimizer keeps only a shard, so its
cases return losses only).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "model" / "tiny.yaml"
POLICIES = REPO / "configs" / "policy"
VOCAB, SEQ, MICRO_BATCH, GLOBAL_BATCH, ITERATIONS = 128, 32, 2, 16, 10


@dataclass(frozen=True)
class Case:
    name: str
    tp: int = 1
    pp: int = 1
    layers_per_virtual_stage: int | None = None
    policy: str | Path | None = None  # None: --agoq-disable (Megatron's modules); a Path: that YAML; else
    # configs/policy/<name>.yaml
    flags: tuple[str, ...] = field(default=())
    num_layers: int | None = None  # None: tiny.yaml's 4
    # True: the pre-norms and SwiGLU hand a recompute stash to Megatron's linear and the linears storing their own
    # input run Megatron's linear in a hook scope (agoq.ops.saved_act.SavePaths fuse_norm_linear=False,
    # fuse_swiglu_linear=False, quantized_linear_node=False, which the CLI does not expose) instead of agoq's one-node
    # linears
    two_node: bool = False

    def argv(self) -> list[str]:
        argv = ["--config", str(TINY), "--fp32", "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO_BATCH),
                "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERATIONS), "--lr", "1e-2",
                "--lr-warmup-iters", "2", "--tensor-model-parallel-size", str(self.tp),
                "--make-vocab-size-divisible-by", "64",  # 128 rows at TP=1 and TP=2 alike
                "--pipeline-model-parallel-size", str(self.pp), *self.flags]
        if self.num_layers:
            argv += ["--num-layers", str(self.num_layers)]
        if self.layers_per_virtual_stage:
            argv += ["--num-layers-per-virtual-pipeline-stage", str(self.layers_per_virtual_stage)]
        if self.policy is None:
            argv += ["--agoq-disable"]
        else:
            path = self.policy if isinstance(self.policy, Path) else POLICIES / f"{self.policy}.yaml"
            argv += ["--agoq-policy", str(path)]
        return argv


def token_stream(num_samples: int, seed: int = 11) -> torch.Tensor:
    """[num_samples, SEQ + 1] int64: each sequence follows a fixed random successor map from a random
    start token, so a model can learn it within a few steps (the losses must move for the test to bite)."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=g)
    tokens = torch.empty(num_samples, SEQ + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, VOCAB, (num_samples,), generator=g)
    for t in range(SEQ):
        tokens[:, t + 1] = successor[tokens[:, t]]
    return tokens


def micro_batches(dp_rank: int, dp_size: int) -> list[dict]:
    """This data-parallel rank's micro-batches for all iterations, in Megatron's sampler order
    (``agoq.data.sampler.PretrainingSampler``: step k holds samples k*mbs*dp .. ; rank r its r-th slice)."""
    tokens = token_stream(ITERATIONS * GLOBAL_BATCH)
    out = []
    for start in range(0, tokens.shape[0], MICRO_BATCH * dp_size):
        rows = tokens[start + dp_rank * MICRO_BATCH: start + (dp_rank + 1) * MICRO_BATCH]
        out.append({"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": torch.ones(MICRO_BATCH, SEQ),
                    "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, -1)})
    return out


def _script():
    spec = importlib.util.spec_from_file_location("agoq_pretrain_script", REPO / "scripts" / "pretrain_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def global_names(chunk) -> dict[str, torch.nn.Parameter]:
    """Parameters of one (unwrapped) GPTModel chunk by global name: decoder.layers.<global index>.…"""
    names = {}
    for name, param in chunk.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
        names[".".join(parts)] = param
    return names


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def tp_shard(full: torch.Tensor, name: str, partition_dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's piece of a full (TP=1) parameter or gradient, as Megatron's layers split it:
    along ``partition_dim``; the gated fc1 ([gate; up] stacked) splits gate and up separately."""
    if partition_dim is None or tp_size == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        return torch.cat([half.chunk(tp_size, dim=partition_dim)[tp_rank] for half in full.chunk(2, dim=0)])
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def _partition_dim(param) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


class _Vocab:
    vocab_size = VOCAB


def run_case(case: Case, reference_state: dict | None, device: torch.device, world_size: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from agoq.megatron import runtime
    from agoq.megatron.activations import storage_of
    from agoq.megatron.model import ParallelLayout
    from agoq.train import megatron_setup, pretrain
    from agoq.train.args import parse_args
    from agoq.train.training import StepRunner

    if case.two_node:
        from agoq.megatron.layers import _AgoqLinearMixin

        names = ("_takes_norm_feed", "_takes_swiglu_feed", "_quantized_input_node")
        saved = [getattr(_AgoqLinearMixin, name) for name in names]
        for name in names:
            setattr(_AgoqLinearMixin, name, lambda self: False)
        try:
            return run_case(dataclasses.replace(case, two_node=False), reference_state, device, world_size)
        finally:
            for name, method in zip(names, saved, strict=True):
                setattr(_AgoqLinearMixin, name, method)
    args = parse_args(case.argv())
    layout = ParallelLayout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, vpp=args.vpp)
    runtime.init_model_parallel(layout, seed=args.seed, device=device)
    try:
        info = runtime.RankInfo(rank=torch.distributed.get_rank(), world_size=world_size, local_rank=0, device=device)
        count = pretrain.num_microbatches(args, layout, world_size)
        model, _, spec = _script().model_provider(args, layout, _Vocab(), info, count)
        params = {n: p for chunk in model for n, p in global_names(_unwrap(chunk)).items()}
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        initial = {n: p.detach().cpu().clone() for n, p in params.items()}
        if reference_state is not None:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(tp_shard(reference_state[name], name, _partition_dim(param), tp_rank, layout.tp))
        optimizer = megatron_setup.build_optimizer(args, model, torch.float32)
        scheduler = megatron_setup.build_scheduler(args, optimizer, OptimizerParamScheduler)
        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        batches = micro_batches(dp_rank, dp_size)
        runner = StepRunner(model_chunks=model, optimizer=optimizer, scheduler=scheduler, device=device,
                            seq_length=SEQ, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                            num_microbatches=count, forward_backward_func=get_forward_backward_func())
        iterators = [iter([{k: v.to(device) for k, v in b.items()} for b in batches]) for _ in model]
        losses, norms, grads = [], [], {}
        for iteration in range(ITERATIONS):
            result = runner.run(iterators)
            losses.append(result.loss)
            norms.append(result.grad_norm)
            # the distributed optimizer keeps a shard of the reduced gradients; 8-bit stores (--agoq-grads)
            # keep main_grad without storage (read through the model's agoq_grad_of instead)
            if iteration == 0 and not args.use_distributed_optimizer and not args.agoq_grads:
                grads = {n: (p.main_grad.detach().float().cpu().clone(), _partition_dim(p), tp_rank)
                         for n, p in params.items()}
        # whether the pre-norms ran as one node with QKV / fc1 (agoq.ops.norm_linear) and SwiGLU with fc2
        # (agoq.ops.swiglu_linear) anywhere on this rank
        layers = [layer for chunk in model for layer in _unwrap(chunk).decoder.layers]
        norm_node = any(h.accepts_feed for layer in layers for h in getattr(layer, "agoq_handoffs", ()))
        swiglu_node = any(getattr(getattr(layer.mlp, "agoq_fc2_handoff", None), "accepts_feed", False)
                          for layer in layers)
        # the linears that run as agoq's quantized-input node (agoq.ops.quant_linear), by name
        quant_nodes = sorted({name.rsplit(".", 1)[-1] for layer in layers for name, mod in layer.named_modules()
                              if getattr(mod, "agoq_quantized_node", False)})
        # agoq's saved bytes over the whole run, per (layer, role), and what each layer stores (agoq.plan.storage)
        storage = storage_of(spec)
        saved = {} if storage is None else dict(storage.counter.packed)
        return {"losses": losses, "grad_norms": norms, "grads": grads, "initial": initial, "norm_node": norm_node,
                "swiglu_node": swiglu_node, "quant_nodes": quant_nodes, "saved_bytes": saved,
                "layer_storage": {} if storage is None else dict(storage.layers), "forwards": ITERATIONS * count}
    finally:
        parallel_state.destroy_model_parallel()


def run_layouts(rank: int, world_size: int, reference_state: dict | None, cases: list[Case],
                backend_device: str = "cpu") -> dict[str, dict]:
    """Entry point for ``agoq.testing.dist.spawn_ranks``: every case in turn on this rank."""
    from agoq.config import AgoqConfig
    from agoq.megatron.install import install

    device = torch.device("cuda", rank) if backend_device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    handle = install(AgoqConfig(device=backend_device))
    try:
        return {case.name: run_case(case, reference_state, device, world_size) for case in cases}
    finally:
        handle.uninstall()


def merge_ranks(name: str, per_rank: list[dict]) -> dict:
    """Losses from the rank that logs them (last stage), gradients from every rank."""
    losses = [r[name]["losses"] for r in per_rank if r[name]["losses"][0] is not None][0]
    grads = {}
    for r in per_rank:
        for key, grad in r[name]["grads"].items():
            grads.setdefault(key, []).append(grad)
    return {"losses": losses, "grads": grads, "norm_node": [r[name]["norm_node"] for r in per_rank],
            "swiglu_node": [r[name]["swiglu_node"] for r in per_rank],
            "quant_nodes": [r[name]["quant_nodes"] for r in per_rank],
            "saved_bytes": [r[name]["saved_bytes"] for r in per_rank],
            "layer_storage": [r[name]["layer_storage"] for r in per_rank],
            "forwards": [r[name]["forwards"] for r in per_rank]}


def assert_grads_close(grads: dict, reference: dict, tp_size: int, rel: float) -> None:
    """Every rank's iteration-1 gradient within ``rel`` of its parameter's largest reference entry."""
    assert grads, "no gradients returned"
    assert set(grads) == set(reference), set(grads) ^ set(reference)
    for name, shards in grads.items():
        ref, _, _ = reference[name][0]
        scale = ref.abs().max().item()
        assert scale > 0, name
        for grad, partition_dim, tp_rank in shards:
            err = (grad - tp_shard(ref, name, partition_dim, tp_rank, tp_size)).abs().max().item() / scale
            assert err <= rel, (name, err)
