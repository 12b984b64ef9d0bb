"""Start-up memory report: the planner's prediction per pipeline stage, then what each stage measured.

Prediction: ``agoq.plan.plan_stages`` (weights, gradients, optimizer states of Megatron's bf16 recipe;
activations from the policy and the schedule's in-flight counts). agoq's own optimizer and 8-bit
gradient buffers are not modelled by the planner yet, so with ``--agoq-optimizer`` / ``--agoq-grads``
the prediction is Megatron's parameter bytes and says so. Measured: ``torch.cuda.max_memory_allocated``
on the first tensor- and data-parallel rank of each stage (RSS on the CPU, not comparable).
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from agoq.megatron import runtime
from agoq.plan.memory import GIB, Layout, ModelShape, plan_stages


def predicted_report(args, shape, layout, policy) -> str:
    """One line per stage: predicted GiB by component (rank 0 prints it)."""
    if policy is None:
        from agoq.policy import load_policy

        policy = load_policy(_bf16_policy_path())
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    plan = plan_stages(
        ModelShape(shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.num_query_groups,
                   shape.ffn_hidden_size, shape.vocab_size),
        Layout(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, dp=dp, mbs=args.micro_batch_size,
               gbs=args.global_batch_size, seq=args.seq_length,
               distributed_optimizer=args.use_distributed_optimizer),
        policy,
    )
    lines = ["predicted memory per GPU (agoq.plan; excludes allocator fragmentation and workspaces):"]
    for s in plan:
        lines.append(
            f"  stage {s.pp_rank}: weights {s.weights / GIB:.2f} | grads {s.grads / GIB:.2f} | optimizer "
            f"{s.optimizer / GIB:.2f} | activations {s.activations / GIB:.2f} (in-flight {s.inflight}) | "
            f"total {s.total / GIB:.2f} GiB"
        )
    if args.agoq_optimizer != "torch" or args.agoq_grads:
        lines.append("  note: grads/optimizer above are Megatron's bytes; agoq's optimizer and 8-bit gradients "
                     "are not modelled by the planner yet (see the measured line)")
    return "\n".join(lines)


def _bf16_policy_path():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "configs" / "policy" / "bf16.yaml"


def measured_report(device, iteration: int) -> str | None:
    """Gather every stage's reading to global rank 0; the text there, None elsewhere."""
    first = (parallel_state.get_tensor_model_parallel_rank() == 0
             and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
    mine = (parallel_state.get_pipeline_model_parallel_rank(), runtime.memory_reading(device)) if first else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    parts = [f"stage {stage}: {runtime.format_memory(reading)}" for stage, reading in sorted(g for g in gathered if g)]
    return f"measured memory after iteration {iteration}: " + " || ".join(parts)
