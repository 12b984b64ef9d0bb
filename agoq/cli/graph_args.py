"""Megatron-LM's CUDA-graph flags in ``scripts/pretrain_llama.py``: ``--cuda-graph-impl``,
``--enable-cuda-graph``, ``--cuda-graph-modules`` (hidden ``--cuda-graph-scope``), ``--cuda-graph-warmup-steps`` and
``--te-rng-tracker``, with Megatron-LM's names, choices and deprecations (megatron/training/arguments.py, 0.19.2).

Without Transformer Engine megatron-core graphs layers with its own ``local`` implementation only; the trainer
passes ``cuda_graph_impl`` / ``cuda_graph_modules`` / ``cuda_graph_warmup_steps`` to ``TransformerConfig``
(agoq.megatron.model.llama_transformer_config) and seeds the graph-safe RNG tracker
(agoq.megatron.runtime.init_model_parallel). What the trainer cannot run with graphs is refused here, before torch
loads; what agoq's own features cannot run with them is refused at model build (agoq.megatron.graphs).
Light imports only (argparse): the trainer checks its command line before torch and megatron load.
"""

from __future__ import annotations

import argparse

__all__ = ["CUDA_GRAPH_IMPLS", "add_graph_flags", "check_graph_flags"]

# TransformerConfig.cuda_graph_impl's values (megatron-core 0.19.2; a light copy of agoq.megatron.graphs.IMPLS, checked
# equal by tests/unit/test_cuda_graph_args.py), and the one agoq's trainer runs: Megatron's per-layer graphs
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
CUDA_GRAPH_WHOLE_LAYER = ("full",)  # Megatron-LM's deprecated spelling of an empty --cuda-graph-modules


def add_graph_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CUDA graphs (Megatron-LM's flags; agoq's features under graphs: docs/numerics.md, "
                             "'CUDA graphs')")
    g.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default="none",
                   help="none: eager; local: megatron-core's per-layer CUDA graphs (the first iteration records, then "
                        "each layer's forward and backward are captured and replayed; needs a GPU; seeds Megatron's "
                        "graph-safe RNG tracker). transformer_engine and full_iteration are refused: the first needs "
                        "Transformer Engine, the second megatron.training's loop")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="Megatron-LM's deprecated spelling of --cuda-graph-impl local")
    g.add_argument("--cuda-graph-modules", nargs="*", default=[], metavar="MODULE",
                   help="what each per-layer graph covers: nothing given (or Megatron-LM's deprecated 'full') = the "
                        "whole layer, the only coverage agoq's trainer runs (default: the whole layer)")
    g.add_argument("--cuda-graph-scope", nargs="+", default=None, dest="cuda_graph_scope_deprecated",
                   help=argparse.SUPPRESS)  # Megatron-LM's hidden, deprecated name of --cuda-graph-modules
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="eager warm-up passes of each layer just before its capture (Megatron's "
                        "cuda_graph_warmup_steps; at least 1: agoq's FP8 weight cache prepares its graph state there)")
    g.add_argument("--te-rng-tracker", action="store_true",
                   help="Megatron-LM: Transformer Engine's RNG tracker; refused (no Transformer Engine): with "
                        "--cuda-graph-impl local the trainer seeds megatron-core's graph-safe CudaRNGStatesTracker "
                        "(use_cudagraphable_rng), as Megatron-LM does without TE")


def check_graph_flags(args: argparse.Namespace) -> None:
    """Megatron-LM's CUDA-graph flags as agoq's trainer runs them (normalises ``args.cuda_graph_impl`` and
    ``args.cuda_graph_modules``); what cannot run here is refused with the reason and the fix."""
    if args.enable_cuda_graph:
        if args.cuda_graph_impl != "none":
            raise ValueError("Do not use --enable-cuda-graph with --cuda-graph-impl (Megatron-LM's rule: the first is "
                             "the deprecated spelling of --cuda-graph-impl local); keep one")
        args.cuda_graph_impl = "local"
    if args.cuda_graph_scope_deprecated is not None:
        if args.cuda_graph_modules:
            raise ValueError("--cuda-graph-scope and --cuda-graph-modules cannot be used together (the first is the "
                             "deprecated name of the second); keep --cuda-graph-modules")
        args.cuda_graph_modules = args.cuda_graph_scope_deprecated
    del args.cuda_graph_scope_deprecated
    modules = [m for m in args.cuda_graph_modules if m not in CUDA_GRAPH_WHOLE_LAYER]
    if args.te_rng_tracker:
        raise ValueError("--te-rng-tracker selects Transformer Engine's RNG tracker, which is not installed here; drop "
                         "it: with --cuda-graph-impl local the trainer seeds megatron-core's graph-safe RNG tracker")
    impl = args.cuda_graph_impl
    if impl == "none":
        if modules or args.cuda_graph_modules:
            raise ValueError("--cuda-graph-modules has no effect without CUDA graphs; add --cuda-graph-impl local or "
                             "drop it")
        args.cuda_graph_modules = []
        return
    if impl == "transformer_engine":
        raise ValueError("--cuda-graph-impl transformer_engine captures through Transformer Engine's "
                         "make_graphed_callables and TE layers; agoq's trainer builds megatron-core's local spec "
                         "without TE. Use --cuda-graph-impl local (megatron-core's own per-layer graphs)")
    if impl == "full_iteration":
        raise ValueError("--cuda-graph-impl full_iteration captures the whole forward-backward through "
                         "megatron.training's FullCudaGraphWrapper, which agoq's training loop does not use; use "
                         "--cuda-graph-impl local (per-layer graphs)")
    if modules:
        raise ValueError(f"--cuda-graph-modules {' '.join(modules)}: agoq's trainer captures whole layers (give no "
                         "module): megatron-core's local graphs of a dense layer capture it whole whatever the scope, "
                         "and only that coverage is tested")
    args.cuda_graph_modules = []
    if args.cuda_graph_warmup_steps < 1:
        raise ValueError(f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps}: use at least 1 (agoq's FP8 "
                         "weight cache prepares its graph state in the warm-up pass before each capture)")
    if args.recompute_granularity == "full":
        raise ValueError("--recompute-granularity full with --cuda-graph-impl local: megatron-core allows full "
                         "recompute only with full_iteration graphs (TransformerConfig's rule); use selective "
                         "recompute or drop one of them")
    for flag in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} with --cuda-graph-impl local: a replayed layer hands "
                             "autograd no parameter gradient (megatron-core adds it to main_grad inside the graph), so "
                             "DDP's per-parameter hooks that start the overlapped reduction never run; not validated "
                             "in agoq's trainer. Drop one of them")
