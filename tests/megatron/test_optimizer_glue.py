"""build_agoq_optimizer inside megatron-core on CPU (one gloo rank, own process): Megatron's DDP,
FP32Optimizer wrapper on bf16 params, global-norm clipping and LR schedule drive agoq's AdamW."""

import subprocess
import sys
import textwrap

import pytest

from agoq.testing.procs import REPO_ROOT, child_env

pytestmark = [pytest.mark.megatron]

SCRIPT = textwrap.dedent(
    """
    import argparse, os, torch, torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
    from agoq.megatron import cpu_mode
    cpu_mode.enter_cpu_mode()
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from agoq.cli.agoq_flags import add_agoq_flags
    from agoq.config import AgoqConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from agoq.train.megatron_setup import build_optimizer, build_scheduler
    p = argparse.ArgumentParser(); add_agoq_flags(p)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # fused step under Triton's interpreter
    args = p.parse_args(["--agoq-optimizer", "adamw"] + ([] if interpret else ["--agoq-unfused"]))
    for k, v in dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                     clip_grad=1.0, use_distributed_optimizer=False, lr_warmup_iters=1, global_batch_size=2,
                     lr_decay_iters=10, lr_decay_style="cosine", train_iters=10,
                     pipeline_model_parallel_size=1).items():
        setattr(args, k, v)
    class M(torch.nn.Module):
        def __init__(s):
            super().__init__(); s.l = torch.nn.Linear(128, 64, bias=False); s.n = torch.nn.Parameter(torch.ones(64))
        def forward(s, x):
            return s.l(x) * s.n
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16)
    m = M().to(torch.bfloat16)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)
    args.agoq_config = AgoqConfig.from_flags(vars(args), triton_interpret=interpret)
    opt = build_optimizer(args, [ddp], torch.bfloat16)
    sch = build_scheduler(args, opt, OptimizerParamScheduler)
    w0 = m.l.weight.detach().clone()
    for i in range(3):
        ddp.zero_grad_buffer(); opt.zero_grad()
        ddp(torch.randn(4, 128).to(torch.bfloat16)).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step(); sch.step(2)
        assert ok and grad_norm > 0
    st = opt.optimizer.state
    assert st[m.l.weight]["formats"] == "exp_avg=cint8_b32;exp_avg_sq=cuint8_b32;master=split24"
    assert st[m.n]["formats"] == "exp_avg=fp32;exp_avg_sq=fp32;master=split32"  # small-tensor rule
    assert [g["wd_mult"] for g in opt.param_groups] == [1.0, 0.0]
    assert opt.param_groups[0]["lr"] < 1e-3  # the cosine schedule wrote the lr
    assert not torch.equal(w0, m.l.weight)
    assert opt.optimizer.param_groups[0]["fused"] == (os.environ.get("TRITON_INTERPRET") == "1")
    import hashlib
    digest = hashlib.sha256()
    for q in (m.l.weight, m.n):
        digest.update(q.detach().view(torch.uint8).numpy().tobytes() if q.dtype != torch.bfloat16
                      else q.detach().view(torch.int16).numpy().tobytes())
        for k, v in sorted(st[q].items()):
            if isinstance(v, torch.Tensor) and v.ndim:
                digest.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    print("AGOQ_DIGEST", digest.hexdigest())
    print("AGOQ_OK")
    """
)


def _run(tmp_path, **env) -> str:
    script = tmp_path / "glue.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, env=child_env(**env), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert "AGOQ_OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    return next(line for line in out.stdout.splitlines() if line.startswith("AGOQ_DIGEST"))


def test_build_agoq_optimizer_steps_with_megatron_ddp_clip_and_schedule(tmp_path):
    _run(tmp_path, TRITON_INTERPRET="0")


@pytest.mark.kernels
def test_fused_multi_tensor_step_under_megatron_equals_reference(tmp_path):
    """The fused step (multi-tensor launches, Triton interpreter on CPU) under Megatron's DDP (grads as
    views of its fp32 main_grad buffer) and FP32Optimizer: params and states bit-identical to the
    reference step's."""
    assert _run(tmp_path, TRITON_INTERPRET="1") == _run(tmp_path, TRITON_INTERPRET="0")
