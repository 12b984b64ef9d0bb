"""Low-bit storage of activations saved for backward: quantize on save, dequantize on use.

The forward pass is never changed: every op computes with the full-precision tensor; only the copy
kept for backward is quantized (agoq formats, :mod:`agoq.formats`). Three pieces:

- :func:`quantized_saves` (a ``saved_tensors_hooks`` scope around *one* autograd op, Megatron's linear, matching
  its input by identity): the input is stored as a quantized copy or a recompute handle; every other saved tensor
  (the weight) is left alone.
- :class:`RecomputeStash`, for the ops that store only their *input*, quantized, and recompute in backward
  (AGoQ, arXiv 2605.00539): ``rmsnorm_saving_input`` (:mod:`agoq.ops.saved_norm`) and
  ``swiglu_saving_input`` / ``smooth_swiglu_saving_input`` (:mod:`agoq.ops.saved_swiglu`). Their output can be
  handed to the next linear as a stash, so that linear stores nothing: its input is rebuilt from the same
  quantized tensor (norm -> QKV / fc1, SwiGLU -> fc2).
- :class:`SavedBytesCounter`: exact bytes packed, per (layer, role), plus live and peak bytes.

Device dispatch (:func:`agoq.ops.dispatch.quant_ops`, re-exported here): CUDA tensors use the Triton kernels
of :mod:`agoq.kernels.quant`, every other device the reference :mod:`agoq.ref.quant`; they produce
identical codes (tests/kernels). The choice follows the tensor's device, is logged once per path,
and never falls back silently (a CUDA tensor without Triton raises the ImportError).

Shape legend: T = tokens (any leading dims), H = hidden.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agoq.formats import QuantFormat
from agoq.ops import custom_ops  # noqa: F401 (registers torch.ops.agoq.*: agoq.ops.custom_ops)
from agoq.ops.dispatch import quant_ops
from agoq.ref.quant import QuantizedTensor

__all__ = [
    "SavedBytesCounter",
    "SavePaths",
    "RecomputeStash",
    "quant_ops",
    "quantize_saved",
    "quantized_saves",
    "default_saved_hooks_active",
    "saved_input_handle",
    "eager_under_compile",
]

Key = tuple[int | None, str]  # (global 0-based layer index or None, role)


@dataclass(frozen=True, kw_only=True)
class SavePaths:
    """How agoq's layers run the saved-activation code on the host: which fused / one-node paths they take where they
    apply. Every choice stores the same bytes and gives the same gradients (tests/gpu/test_saved_act_gpu.py,
    tests/megatron/test_activations.py); the defaults are the fast paths. The non-defaults are the paths the layers
    take anyway where a fused path does not apply (FP8, another active saved-tensor hook scope, ...), forced for
    tests' and benchmarks' A/B (benchmarks/bench_memory.py variants, benchmarks/bench_launch.py's legacy paths);
    ``fuse_swiglu_fp8`` is ``AgoqConfig.kernels.fuse_swiglu_fp8`` in the trainer. Passed to
    ``agoq.megatron.model.agoq_layer_spec(..., save_paths=...)``. (Two variants that reached torch's private
    ``_raw_saved_*`` attributes of autograd nodes, for the norm and the linears, measured within noise of these paths
    in whole steps, docs/benchmarks/activations.md, and were deleted.)"""

    fuse_swiglu: bool = True
    """CUDA SwiGLU: one fused quantize kernel (False: quantize + ATen SwiGLU, unfused)."""
    fuse_swiglu_fp8: bool = True
    """Plain SwiGLU feeding a plain FP8 fc2 under per-tensor delayed scaling: one op (agoq.ops.smooth_swiglu_fp8.
    swiglu_fp8_fc2); False: Megatron's SwiGLU then the FP8 linear (same values; ``AgoqConfig.kernels.fuse_swiglu_fp8``,
    the trainer's AGOQ_FP8_SWIGLU_FUSION=0: benchmarks/pretrain_suites.py's A/B)."""
    fuse_smooth_fp8: bool = True
    """Smooth-SwiGLU feeding an FP8 fc2 under per-tensor delayed scaling: one op (agoq.ops.smooth_swiglu_fp8:
    fused smoothing + FP8 cast, un-smoothing in fc2's GEMM); False: the unfused SwiGLU, scale and FP8 linear
    (same math; benchmarks' A/B)."""
    fuse_norm_linear: bool = True
    """A norm whose output is recomputed for the column-parallel linear it feeds (QKV, fc1; bf16 GEMMs, no
    gradient-accumulation fusion or wgrad deferral; sequence parallelism inside the node): True (default): one
    autograd node for norm and linear (agoq.ops.norm_linear: no norm function, hook scope or stash per pair); False:
    the norm's autograd function hands a recompute stash to Megatron's linear (same bytes and gradients)."""
    fuse_swiglu_linear: bool = True
    """SwiGLU whose output is recomputed for fc2 (plain SwiGLU; bf16 fc2 GEMMs, no gradient-accumulation fusion;
    sequence parallelism reduce-scatters fc2's output after the node, in Megatron's forward): True (default): one
    autograd node for SwiGLU and fc2 (agoq.ops.swiglu_linear: no SwiGLU function, hook scope or stash per MLP); False:
    SwiGLU's autograd function hands a recompute stash to Megatron's linear (same bytes and gradients)."""
    quantized_linear_node: bool = True
    """A linear storing its own input quantized (the out-projection under the default policy; bf16 GEMMs, no
    gradient-accumulation fusion or wgrad deferral; sequence parallelism inside the node): True (default): one
    autograd node (agoq.ops.quant_linear: no hook scope, pack or unpack calls); False: Megatron's linear inside a
    ``saved_tensors_hooks`` scope (same bytes and gradients). All three one-node linears run only outside other
    saved-tensor hook scopes (:func:`default_saved_hooks_active`) and support one backward per graph (no
    ``retain_graph``)."""


# ------------------------------------------------------------------------ torch.compile ----
class eager_under_compile:  # noqa: N801 - used like the function it wraps
    """``fn`` as torch.compile must run it: eagerly, between graphs (``torch.compiler.disable``), because it
    keeps Python state across autograd nodes that a graph cannot carry (``reason``: the byte counter's weak
    references, the recompute stash handed from one node's forward to another's backward, hooks on an
    autograd node's saved tensor); docs/numerics.md, "Custom ops and torch.compile". Callers test
    ``torch.compiler.is_compiling()`` first, so eager calls pay nothing for this.

    The disabled wrapper is built by :meth:`prepare` (it imports ``torch._dynamo``, ~1.5 s, which agoq.ops
    does not pay at import); ``agoq.megatron.layers`` prepares every boundary made so far at import
    (:meth:`prepare_all`; Megatron imports dynamo anyway). One that was not prepared is built on its first
    call inside a compiled region, which costs that first compilation one more graph break
    ("torch.compiler.disable() called inside a compiled region"), never a wrong result."""

    __slots__ = ("fn", "reason", "_disabled")
    made: list[eager_under_compile] = []  # every boundary, in the order the modules made them

    def __init__(self, fn: Callable, reason: str):
        self.fn, self.reason, self._disabled = fn, reason, None
        eager_under_compile.made.append(self)

    @classmethod
    def prepare_all(cls) -> None:
        """:meth:`prepare` every boundary made so far (those of the modules imported before the call)."""
        for boundary in cls.made:
            boundary.prepare()

    def prepare(self) -> Callable:
        if self._disabled is None:
            self._disabled = torch.compiler.disable(self.fn, reason=f"agoq: {self.reason}")
        return self._disabled

    def __call__(self, *args, **kwargs):
        return self.prepare()(*args, **kwargs)


# ----------------------------------------------------------------------------- accounting ----
@dataclass
class SavedBytesCounter:
    """Bytes agoq stores for backward. ``packed`` / ``tensors`` are cumulative per (layer, role);
    ``live`` are bytes currently held (released when the quantized copy is freed), ``peak`` their max."""

    packed: dict[Key, int] = field(default_factory=dict)
    tensors: dict[Key, int] = field(default_factory=dict)
    live: int = 0
    peak: int = 0
    # weak references to the codes still held, each with a callback that releases its bytes (a plain
    # weakref: weakref.finalize costs several times more host time, and this runs per saved tensor)
    _held: set = field(default_factory=set, repr=False, compare=False)

    def add(self, key: Key, q: QuantizedTensor) -> None:
        nbytes = q.nbytes
        self.packed[key] = self.packed.get(key, 0) + nbytes
        self.tensors[key] = self.tensors.get(key, 0) + 1
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        held = self._held

        def release(ref, nbytes=nbytes):
            held.discard(ref)
            self.live -= nbytes

        held.add(weakref.ref(q.codes, release))

    def reset(self) -> None:
        """Forget cumulative counts and the peak (live bytes stay: they are still held)."""
        self.packed.clear()
        self.tensors.clear()
        self.peak = self.live

    def total(self) -> int:
        return sum(self.packed.values())

    def by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, role), nbytes in self.packed.items():
            out[role] = out.get(role, 0) + nbytes
        return out

    def __deepcopy__(self, memo):
        # The one runtime object a layer spec holds on purpose: the model's byte accumulator, referenced by every
        # layer's resolved row (agoq.megatron.layer_plan). A copy of a spec (Megatron-LM may deep-copy the model
        # config that carries it) must keep counting into the model's counter, not a private one.
        return self


def quantize_saved(
    x: torch.Tensor, fmt: QuantFormat, key: Key, counter: SavedBytesCounter | None
) -> QuantizedTensor:
    """Quantize the saved copy of ``x`` (detached) and count its exact bytes."""
    if not fmt.quantized:
        raise ValueError(
            f"quantize_saved needs a quantized format, got {fmt.name!r}; bf16 roles save the tensor as is"
        )
    quantize, _ = quant_ops(x.device)
    q = quantize(x, fmt)  # both implementations quantize a detached view
    if counter is not None:
        counter.add(key, q)
    return q


def _dequantize(q: QuantizedTensor) -> torch.Tensor:
    _, dequantize = quant_ops(q.codes.device)
    return dequantize(q)


# ------------------------------------------------------------------------- recompute stash ----
class RecomputeStash:
    """The quantized input of a recomputable op (RMSNorm or SwiGLU) and how to redo its forward.

    The op's own backward and the next linear's backward both read the input; it is dequantized once
    (on first use) and dropped when the op's backward has consumed it. ``from_codes=True`` (the fused
    SwiGLU kernels): ``forward_fn`` takes the QuantizedTensor itself and nothing is dequantized into a
    separate tensor. ``output_ptr`` is the data pointer of the op's forward output, so the next linear
    can check that its input really is that output before it stores a handle instead of the tensor.
    """

    __slots__ = ("q", "forward_fn", "output_ptr", "_x_hat", "aux", "from_codes")

    def __init__(self, q: QuantizedTensor, forward_fn: Callable, from_codes: bool = False):
        self.q = q
        self.forward_fn = forward_fn
        self.from_codes = from_codes
        self.output_ptr: int | None = None
        self._x_hat: torch.Tensor | None = None
        self.aux: dict = {}  # what a recompute leaves for the op's own backward (RMSNorm: rstd)

    def dequantized(self) -> torch.Tensor:
        if self._x_hat is None:
            self._x_hat = _dequantize(self.q)
        return self._x_hat

    def recomputed_output(self) -> torch.Tensor:
        """The op's forward output rebuilt from the stored input (no autograd graph)."""
        if torch.is_grad_enabled():  # backward runs with grad off (no create_graph): no context to enter
            with torch.no_grad():
                return self._recompute()
        return self._recompute()

    def _recompute(self) -> torch.Tensor:
        if self.from_codes:
            return self.forward_fn(self.q)
        if getattr(self.forward_fn, "takes_aux", False):
            return self.forward_fn(self.dequantized(), self.aux)
        return self.forward_fn(self.dequantized())

    def consume(self) -> torch.Tensor:
        """The dequantized input for the op's own backward; the stash then lets go of everything."""
        x_hat = self.dequantized()
        self._x_hat, self.q = None, None
        return x_hat

    def consume_codes(self) -> QuantizedTensor:
        """The quantized input for a backward that reads the codes itself; the stash lets go of it."""
        q = self.q
        self._x_hat, self.q = None, None
        return q


class _Saved:
    """What a pack hook stores instead of a tensor; ``materialize()`` gives the tensor back."""

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError


class QuantizedSave(_Saved):
    def __init__(self, q: QuantizedTensor):
        self.q = q

    def materialize(self) -> torch.Tensor:
        return _dequantize(self.q)


class _RecomputeSave(_Saved):
    def __init__(self, stash: RecomputeStash):
        self.stash = stash

    def materialize(self) -> torch.Tensor:
        return self.stash.recomputed_output()


def _check_stash_feeds(stash: RecomputeStash, target: torch.Tensor) -> None:
    if stash.output_ptr != target.data_ptr():
        raise RuntimeError(
            "agoq: this linear's input is not the output of the recomputable op before it (norm or "
            "SwiGLU); the layer's forward order changed. Use a bf16 policy for this role or report it."
        )


def saved_input_handle(target: torch.Tensor, *, fmt: QuantFormat | None = None, stash: RecomputeStash | None = None,
                       key: Key = (None, ""), counter: SavedBytesCounter | None = None) -> _Saved:
    """What an op that saves ``target`` itself (agoq's FP8 linear) keeps instead: a quantized copy
    (``fmt``) or a recompute handle (``stash``); ``.materialize()`` gives the tensor back in backward."""
    if (fmt is None) == (stash is None):
        raise ValueError("saved_input_handle needs exactly one of fmt= or stash=")
    if stash is not None:
        _check_stash_feeds(stash, target)
        return _RecomputeSave(stash)
    return QuantizedSave(quantize_saved(target, fmt, key, counter))


class quantized_saves:  # noqa: N801 - used as a function-style context manager: `with quantized_saves(...)`
    """Inside this scope, the autograd op that saves ``target`` stores it low-bit instead.

    Exactly one of ``fmt`` (quantize the saved copy) or ``stash`` (store nothing; rebuild the
    tensor from the stash in backward) is given. Other saved tensors pass through unchanged.
    Raises RuntimeError after the scope if ``target`` was saved zero or several times while grad
    was enabled (the wrapped op no longer saves what agoq expects: a Megatron change).
    A class rather than a generator context manager: it runs around every linear of every layer, and
    the generator machinery is host time (docs/numerics.md, "Host cost").
    """

    __slots__ = ("target", "fmt", "stash", "key", "counter", "hits", "_hooks")

    def __init__(self, target: torch.Tensor, *, fmt: QuantFormat | None = None, stash: RecomputeStash | None = None,
                 key: Key = (None, ""), counter: SavedBytesCounter | None = None):
        if (fmt is None) == (stash is None):
            raise ValueError("quantized_saves needs exactly one of fmt= or stash=")
        if stash is not None:
            _check_stash_feeds(stash, target)
        self.target, self.fmt, self.stash, self.key, self.counter = target, fmt, stash, key, counter
        self.hits = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        target = self.target
        if t is target or (t.data_ptr() == target.data_ptr() and t.shape == target.shape and t.dtype == target.dtype):
            self.hits += 1
            if self.stash is not None:
                return _RecomputeSave(self.stash)
            return QuantizedSave(quantize_saved(t, self.fmt, self.key, self.counter))
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_saved)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        target = self.target
        # Torch keeps the pack hook (this bound method, hence self) alive with every SavedVariable it
        # packed, until that node's backward. Holding `target` here kept the very tensor agoq replaced
        # (a norm or SwiGLU output: 2-8 bf16 x hidden per token and layer) alive for the whole forward:
        # ~3 GiB at the 1B H100 peak (benchmarks/mem_trace.py, docs/benchmarks/planner.md).
        self.target = self.stash = self.fmt = self.counter = None
        if exc_type is None and torch.is_grad_enabled() and target.requires_grad and self.hits != 1:
            raise RuntimeError(
                f"agoq: expected the wrapped op to save its input once, it saved it {self.hits} times "
                f"(layer/role {self.key}); megatron-core changed LinearWithGradAccumulationAndAsyncCommunication"
            )
        return False


def unpack_saved(obj):
    return obj.materialize() if isinstance(obj, _Saved) else obj


def default_saved_hooks_active() -> bool:
    """Whether a ``saved_tensors_hooks`` scope (activation offloading, torch.utils.checkpoint, ...) is active:
    agoq's one-node linears (agoq.ops.norm_linear, swiglu_linear, quant_linear), which keep their codes on the autograd
    context, would bypass it: the layers take the hook / stash paths there instead, whose scope is innermost. torch
    has no public query of the active default hooks, hence the private ``_top_saved_tensors_default_hooks`` (one C
    call per norm, MLP and quantized linear)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
