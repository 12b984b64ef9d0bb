"""Megatron-LM's ``--sequence-parallel`` in ``scripts/pretrain_llama.py`` and ``python -m agoq.plan``: the flag and what
it needs, refused by name with the fix before torch loads (the trainer: agoq.train.checks; the planner:
agoq.plan.__main__). What the layers do under it: agoq.megatron.seqpar, docs/numerics.md "Sequence parallelism".
Light imports only (argparse).
"""

from __future__ import annotations

import argparse

from agoq.config import flag_for

__all__ = ["add_sequence_parallel_flag", "check_sequence_parallel_args", "sequence_parallel_problem"]


def add_sequence_parallel_flag(g) -> None:
    """The flag, in the parser's parallelism group ``g``."""
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (needs --tensor-model-parallel-size > 1 and a --seq-length "
                        "divisible by it): the residual stream, the norms and the activations they save are split "
                        "along the sequence over the TP ranks (column-parallel linears all-gather their input, "
                        "row-parallel ones reduce-scatter their output), so agoq's saved norm inputs take 1/TP per "
                        f"rank; agoq's layers only (not with {flag_for('enabled')}, whose torch norms Megatron refuses "
                        "under it) and not with FP8 linears (docs/numerics.md, 'Sequence parallelism')")


def sequence_parallel_problem(*, tp: int, seq_length: int, agoq_disable: bool = False, fp8=None) -> str | None:
    """Why a run with --sequence-parallel cannot start (None: it can): TP > 1, the sequence divisible by TP, agoq's
    layers, no FP8 linears (``fp8``: the run's ``agoq.policy.FP8Spec``, flags over the policy's fp8 section)."""
    if tp < 2:  # Megatron-LM turns it off with a warning at TP=1; here nothing is silent
        return ("--sequence-parallel splits the sequence over the tensor-parallel ranks and needs "
                f"--tensor-model-parallel-size > 1 (got {tp}); drop --sequence-parallel or raise TP")
    if seq_length % tp:
        return (f"--sequence-parallel needs --seq-length {seq_length} divisible by --tensor-model-parallel-size {tp}; "
                f"pick a sequence length that is a multiple of {tp}")
    if agoq_disable:
        return (f"--sequence-parallel with {flag_for('enabled')}: Megatron's local spec builds torch norms "
                "(WrappedTorchNorm), which megatron-core 0.19.2 refuses under sequence parallelism; drop "
                f"{flag_for('enabled')} (agoq's layers with {flag_for('policy.path')} configs/policy/bf16.yaml train "
                "as Megatron's do) or drop --sequence-parallel")
    if fp8 is not None and fp8.fp8_enabled:
        return (f"--sequence-parallel with FP8 linears (recipe {fp8.recipe!r}, from {flag_for('fp8.recipe')} or the "
                "policy's fp8 section): agoq's FP8 linears do not all-gather a sequence-sharded input yet; pass "
                f"{flag_for('fp8.recipe')} off or drop --sequence-parallel")
    return None


def check_sequence_parallel_args(args: argparse.Namespace, fp8=None) -> None:
    """:func:`sequence_parallel_problem` on the trainer's parsed flags, as a ValueError."""
    if not getattr(args, "sequence_parallel", False):
        return
    problem = sequence_parallel_problem(tp=args.tensor_model_parallel_size, seq_length=args.seq_length,
                                        agoq_disable=args.agoq_disable, fp8=fp8)
    if problem:
        raise ValueError(problem)
