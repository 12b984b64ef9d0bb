"""``--deterministic-mode`` (Megatron-LM's flag): bit-reproducible runs of ``scripts/pretrain_llama.py`` on a GPU.

Two parts, at the two moments they must happen:

* :func:`apply_environment`, before torch loads (agoq.train.args.parse_and_check): the variables the libraries read
  once, when their first communicator / handle / attention is made -- ``NCCL_ALGO`` (``Ring``: its reduction order
  is fixed), ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``, one of the two settings cuBLAS's reproducibility notes name)
  and ``NVTE_ALLOW_NONDETERMINISTIC_ALGO`` (``0``; Transformer Engine's switch, for the door's TE runs). A value the
  launcher already set is kept when it is one of the deterministic ones (:data:`ALLOWED`: the same sets Megatron-LM
  0.19's ``megatron/training/determinism.py`` accepts), and stops the run naming the variable, its value and the
  allowed ones otherwise.
* :func:`enable_torch`, in the trainer: ``torch.use_deterministic_algorithms(True)`` without ``warn_only`` (under
  ``warn_only`` PyTorch's flash-attention backward keeps its atomic dQ accumulation and only warns); an op with no
  deterministic kernel then stops with PyTorch's own error. Its line says what is in force, read back from torch
  and the environment.

agoq's own kernels need nothing: none accumulates with float atomics (the FP8 amax kernels take ``atomic_max`` on
the bits, which is order-independent: agoq.kernels.fp8), and the 8-bit reduction sums each block in a fixed rank
order (agoq.comm.reduce).
"""

from __future__ import annotations

from collections.abc import MutableMapping

DEFAULTS = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
# the values each variable may already hold (NCCL_ALGO: a comma-separated list of these tokens)
ALLOWED = {"NCCL_ALGO": ("Ring", "CollnetDirect", "CollnetChain", "^NVLS"),
           "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"), "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",)}


def _allowed(name: str, value: str) -> bool:
    if name == "NCCL_ALGO":
        tokens = [t.strip() for t in value.split(",") if t.strip()]
        return bool(tokens) and all(t in ALLOWED[name] for t in tokens)
    return value in ALLOWED[name]


def apply_environment(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Check the deterministic variables already set, fill the unset ones with :data:`DEFAULTS`; the values in
    force. Raises ValueError naming the first variable set to a value that is not deterministic."""
    for name in DEFAULTS:
        value = environ.get(name)
        if value is not None and not _allowed(name, value):
            lists = "; a comma-separated list of them" if name == "NCCL_ALGO" else ""
            raise ValueError(f"--deterministic-mode: {name}={value!r} is not a deterministic setting (allowed: "
                             f"{', '.join(ALLOWED[name])}{lists}); unset it or set one of those")
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in DEFAULTS}


def enable_torch(environ: MutableMapping[str, str]) -> str:
    """Deterministic algorithms on in this process (not warn-only); the start-up line, read back from torch and
    ``environ``."""
    import torch

    torch.use_deterministic_algorithms(True)
    on = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    settings = ", ".join(f"{name}={environ.get(name, '(unset)')}" for name in DEFAULTS)
    return (f"deterministic mode (--deterministic-mode): torch deterministic algorithms "
            f"{'on' if on else 'NOT on'}; {settings}")
