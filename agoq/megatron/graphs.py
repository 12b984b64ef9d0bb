"""agoq under Megatron's CUDA graphs (issue 24 item 1): refused by name until it is supported.

Megatron captures a layer's forward and backward (``TransformerConfig.cuda_graph_impl`` ``local`` /
``transformer_engine``, or the whole forward-backward with ``full_iteration``; the deprecated
``enable_cuda_graph`` / ``external_cuda_graph`` map onto it in ``__post_init__``) and afterwards replays
only the recorded kernels. agoq's layers keep Python state between autograd nodes that a replay would not
re-run: the saved-bytes counter, the recompute hand-off from a norm's forward to its consumer's backward,
FP8 delayed scaling's amax history. agoq's 8-bit gradients and gradient release act in backward hooks,
inside a captured region. None of this has run under a graph on a GPU yet, so each is refused here rather
than left to replay stale state. agoq's optimizer step (outside every captured region) is not affected.
"""

from __future__ import annotations

NO_GRAPHS = "none"  # TransformerConfig.cuda_graph_impl when CUDA graphs are off (megatron-core 0.19.2)


def refuse_cuda_graphs(config, feature: str, off: str) -> None:
    """Raise if ``config`` (a TransformerConfig) turns Megatron's CUDA graphs on while ``feature`` is in use;
    ``off`` names the agoq flag that turns the feature off."""
    impl = getattr(config, "cuda_graph_impl", NO_GRAPHS)
    if impl != NO_GRAPHS:
        raise NotImplementedError(
            f"{feature} does not run under Megatron's CUDA graphs yet (TransformerConfig.cuda_graph_impl="
            f"{impl!r}, set by --cuda-graph-impl or --enable-cuda-graph): a graph replay would skip agoq's "
            f"host-side state (agoq/megatron/graphs.py). Drop --cuda-graph-impl / --enable-cuda-graph, or {off}"
        )
