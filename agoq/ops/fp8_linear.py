"""FP8 linear without Transformer Engine: ``torch._scaled_mm`` on Hopper, E4M3 forward / E5M2 backward.

``fp8_linear(x, weight, scaling_state, recipe, bias=None)`` computes ``x @ weight.T (+ bias)`` with
x [..., K] (bf16), weight [N, K]; the spec and the simulated twin are :mod:`agoq.ref.fp8`
(``ref_fp8_linear``), which takes the same scales and differs only in the GEMM (fp32 on dequantized
values instead of FP8 tensor cores).

GEMMs (``torch._scaled_mm(a, b, scale_a, scale_b, ...)`` wants a row-major, b column-major, both dims
of b and a's inner dim multiples of 16, fp32 inverse scales; on the CUTLASS row-wise path b must be
E4M3, so the E5M2 gradient is always operand a; cuBLAS forbids E5M2 x E5M2):

  forward  y  [M,N] = x_e4m3 [M,K]      @ w_e4m3.T  [K,N]     (w row-major = w.T column-major)
  dgrad    dx [M,K] = g_e5m2 [M,N]      @ w_e4m3    [N,K]     (needs w transposed: w_t [K,N])
  wgrad    dw [N,K] = g_e5m2.T [N,M]    @ x_e4m3    [M,K]     (needs g_t [N,M] and x_t [K,M])

Casts (:mod:`agoq.kernels.fp8` / :mod:`agoq.kernels.fp8_fused` on CUDA, the :mod:`agoq.ref.fp8`
twins elsewhere): every operand is read once per cast and written in the layouts its GEMMs need (x:
row-major + transposed; g: both; w: row-major in forward, transposed in backward). Per-tensor delayed
scaling is one launch per cast (cast with the history's scale, push the amax, compute the next
scale: no separate amax or history kernels, no host sync); current scaling is two (amax, then a cast
that derives the scale itself); row-wise reads the per-row and per-column amaxes together.

Weight: with ``weight_cache`` (agoq.ops.fp8_weight_cache; agoq's Megatron layers pass one per
linear) the weight is cast once per weight version into both layouts and reused by every
micro-batch's forward and backward until the optimizer step. Without it the forward casts the
row-major copy and the backward re-casts the transposed copy with the forward's scales (the same
codes), which keeps no weight-sized FP8 copy alive between the passes.

Saved for backward (no high-precision copy of the input): ``x_t`` in FP8 (1 byte/element, already in
wgrad's layout) and fp32 scales; the weight by reference (a parameter). With ``x_saver`` (agoq's
activation storage: a quantized copy or a recompute handle) nothing of x is kept by this op;
backward rebuilds x from the handle and casts it with the forward's scales.

Savings: the saved input of every FP8 linear is 1 byte/element instead of 2 (bf16). Caveats: tokens
(M = prod of x's leading dims), K and N must be multiples of 16; ``w_col_scale`` (per-channel
Smooth-SwiGLU on fc2) materialises W * s in forward and backward (a weight-sized temporary, not kept).
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

from agoq.ops.fp8_scaling import SLOT_VARIANTS, FP8Recipe, FP8ScalingState
from agoq.ops.fp8_weight_cache import FP8WeightCache

__all__ = ["fp8_linear", "FP8LinearFunction", "MIN_FP8_CAPABILITY", "GEMM_DIM_MULTIPLE", "fp8_cast_ops",
           "phase_range"]

MIN_FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90); torch._scaled_mm's check
GEMM_DIM_MULTIPLE = 16  # torch._scaled_mm: a.size(1), b.size(0), b.size(1) multiples of 16 (cuBLASLt FP8)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DEFAULT_RECIPE = FP8Recipe()  # per-tensor current scaling (frozen: one shared instance)
_NO_RANGE = contextlib.nullcontext()


def phase_range(name: str):
    """The context every phase of the FP8 linear runs in (``agoq.fp8.cast_x``, ``cast_w``, ``gemm_fwd``, ``cast_g``,
    ``recast_w``, ``recast_x``, ``gemm_dgrad``, ``gemm_wgrad``): a no-op. A profiling benchmark
    (benchmarks/bench_fp8_profile.py) replaces this module attribute for its run with a
    ``torch.profiler.record_function`` range, so a profile attributes kernels and host time to phases."""
    del name
    return _NO_RANGE


def fp8_cast_ops(device: torch.device) -> SimpleNamespace:
    """(amax_2d, scales, cast_2d, cast_delayed, cast_current) for tensors on ``device``: Triton on CUDA
    (agoq.kernels.fp8, agoq.kernels.fp8_fused), the reference elsewhere (identical results;
    tests/kernels). ``cast_delayed(x, variant, meta, workspace, margin, pow2, rowmajor, transposed,
    t_colmajor=False, new_meta=None)`` and ``cast_current(x, variant, margin, pow2, rowmajor, transposed,
    t_colmajor=False)`` take x [..., C] contiguous (read as 2-D) and no argument checks (the FP8
    linear's hot path; the public checked casts are agoq.kernels.fp8_fused's).
    A CUDA tensor without Triton raises the ImportError."""
    return _cast_ops_for(torch.device(device).type)


def _colmajor(out_t: torch.Tensor | None, t_colmajor: bool) -> torch.Tensor | None:
    return out_t.t() if t_colmajor and out_t is not None else out_t


def _ref_cast_delayed(x, variant, meta, workspace, margin, pow2, rowmajor, transposed, t_colmajor=False,
                      new_meta=None, mul=None):
    from agoq.ref.fp8 import ref_fp8_cast_delayed_2d

    out, out_t, new = ref_fp8_cast_delayed_2d(x.reshape(-1, x.shape[-1]), variant, meta, workspace, margin, pow2,
                                              rowmajor=rowmajor, transposed=transposed, mul=mul)
    return out, _colmajor(out_t, t_colmajor), (new if new_meta is None else new_meta.copy_(new))


def _ref_cast_current(x, variant, margin, pow2, rowmajor, transposed, t_colmajor=False):
    from agoq.ref.fp8 import ref_fp8_cast_current_2d

    out, out_t, meta = ref_fp8_cast_current_2d(x.reshape(-1, x.shape[-1]), variant, margin, pow2,
                                               rowmajor=rowmajor, transposed=transposed)
    return out, _colmajor(out_t, t_colmajor), meta


@functools.lru_cache(maxsize=8)  # called for every cast: resolve the implementation once per device type
def _cast_ops_for(kind: str) -> SimpleNamespace:
    if kind == "cuda":
        from agoq.kernels import fp8 as impl  # lazily: needs Triton
        from agoq.kernels import fp8_fused as fused

        return SimpleNamespace(amax_2d=impl.fp8_amax_2d, scales=impl.fp8_scales, cast_2d=impl.fp8_cast_2d,
                               cast_delayed=fused.cast_delayed_unchecked, cast_current=fused.cast_current_unchecked)
    from agoq.ref import fp8 as ref

    return SimpleNamespace(amax_2d=ref.ref_fp8_amax_2d, scales=ref.ref_fp8_scales, cast_2d=ref.ref_fp8_cast_2d,
                           cast_delayed=_ref_cast_delayed, cast_current=_ref_cast_current)


class _Cast:
    """One operand in FP8: ``data`` [R, C] row-major and/or ``data_t`` (the transposed copy: [C, R]
    row-major, or the same memory as an [R, C] column-major tensor when cast with ``t_colmajor``);
    ``scale_inv`` / ``scale_t_inv``: what torch._scaled_mm takes for each (0-dim, or [R, 1] / [1, C]);
    ``scale_src``: where the multiplicative scale of the transposed copy comes from, for a re-cast in
    backward (per-tensor: the meta vector, scale = meta[1], made only when needed; row: the [1, C] scale)."""

    __slots__ = ("data", "data_t", "scale_inv", "scale_t_inv", "scale_src")

    def __init__(self, data, data_t, scale_inv, scale_t_inv, scale_src):
        self.data, self.data_t, self.scale_inv, self.scale_t_inv, self.scale_src = (data, data_t, scale_inv,
                                                                                    scale_t_inv, scale_src)


class _WeightFP8:
    """The weight as the GEMMs take it: forward ``b`` (w8.t(), [K, N] column-major) and its inverse
    scale, dgrad ``b`` ([N, K] column-major; None: re-cast in backward) and its inverse scale, and the
    scale source of a re-cast. Made once per weight version with the cache (no per-call views)."""

    __slots__ = ("fwd_b", "fwd_scale_inv", "dgrad_b", "dgrad_scale_inv", "scale_src")

    def __init__(self, fwd_b, fwd_scale_inv, dgrad_b, dgrad_scale_inv, scale_src):
        self.fwd_b, self.fwd_scale_inv, self.dgrad_b = fwd_b, fwd_scale_inv, dgrad_b
        self.dgrad_scale_inv, self.scale_src = dgrad_scale_inv, scale_src


def _recast_t(t2d: torch.Tensor, slot: str, recipe: FP8Recipe, ops, scale_src: torch.Tensor) -> torch.Tensor:
    """The transposed FP8 copy [C, R] of ``t2d`` with a scale kept from forward (module docstring)."""
    variant = SLOT_VARIANTS[slot]
    if recipe.granularity == "row":
        return ops.cast_2d(t2d, variant, scale_src.new_ones(()), scale_src, rowmajor=False, transposed=True)[1]
    return ops.cast_2d(t2d, variant, scale_src[1], rowmajor=False, transposed=True)[1]


def _cast(x: torch.Tensor, slot: str, recipe: FP8Recipe, state: FP8ScalingState | None, ops, rowmajor: bool,
          transposed: bool, t_colmajor: bool = False) -> _Cast:
    """Cast x (contiguous [..., C], read as [R, C]) for ``slot`` (x, w: E4M3; g: E5M2) with the recipe's
    scales. Per-tensor: delayed scaling is one fused launch (FP8ScalingState.cast_meta), current
    scaling two (amax, then the cast, which computes the scale itself). Delayed scaling makes no
    per-call view or allocation for the scales (FP8ScalingState's meta pool); current scaling takes
    meta[0], the GEMM's inverse scale. Row granularity computes both the per-row and the per-column
    scales (one amax read), whatever layouts are written."""
    if recipe.granularity == "row":
        x2, variant, margin, pow2 = x.reshape(-1, x.shape[-1]), SLOT_VARIANTS[slot], recipe.margin, recipe.pow2_scales
        rows, cols = ops.amax_2d(x2, rowcol=True)
        scale, scale_inv = ops.scales(rows[:, None], variant, margin, pow2)
        scale_t, scale_t_inv = ops.scales(cols[None, :], variant, margin, pow2)
        out, out_t, _ = ops.cast_2d(x2, variant, scale, scale_t, rowmajor=rowmajor, transposed=transposed)
        return _Cast(out, _colmajor(out_t, t_colmajor), scale_inv, scale_t_inv, scale_t)
    if recipe.scaling == "delayed":
        out, out_t, meta, inv = state.cast_meta(slot, x, ops, rowmajor, transposed, t_colmajor)
    else:
        out, out_t, meta = ops.cast_current(x, SLOT_VARIANTS[slot], recipe.margin, recipe.pow2_scales, rowmajor,
                                            transposed, t_colmajor)
        inv = meta[0]
    return _Cast(out, out_t, inv, inv, meta)


def _weight_fp8(w: torch.Tensor, recipe: FP8Recipe, state, ops, both_layouts: bool) -> _WeightFP8:
    """Cast the weight (both layouts for the cache; row-major only otherwise: dgrad re-casts)."""
    c = _cast(w if w.is_contiguous() else w.contiguous(), "w", recipe, state, ops, True, both_layouts, True)
    fwd_scale_inv = c.scale_inv.reshape(1, -1) if recipe.granularity == "row" else c.scale_inv
    return _WeightFP8(c.data.t(), fwd_scale_inv, c.data_t, c.scale_t_inv, c.scale_src)


def _effective_weight(weight: torch.Tensor, w_col_scale: torch.Tensor | None) -> torch.Tensor:
    """The weight the GEMM uses: W, or W * s over its input columns (per-channel Smooth-SwiGLU on fc2)."""
    if w_col_scale is None:
        return weight.detach().contiguous()
    return (weight.detach().to(torch.float32) * w_col_scale).to(weight.dtype)


class FP8LinearFunction(torch.autograd.Function):
    """Device-agnostic core of :func:`fp8_linear` (x [..., K]; no bias).

    ``apply(x, weight, state, recipe, w_col_scale=None, x_saver=None, grad_enabled=True,
    weight_cache=None)``: ``w_col_scale`` [K] fp32 makes the GEMM use W * s (s gets no gradient);
    ``x_saver(x2d)`` returns a handle whose ``materialize()`` gives x back in backward (then no FP8 copy
    of x is kept); ``weight_cache`` (an :class:`FP8WeightCache`) reuses the weight's FP8 copies (both
    layouts) until the weight changes, so neither the forward nor the backward casts the weight.

    Host path (docs/benchmarks/log.md, "Host cost"): x and grad_y are read in place whatever their leading dims
    (no reshape, so no view nodes in the graph), the output is written into its final shape
    (``_scaled_mm(out=...)``), and the GEMM operands come out of the casts in the layouts
    torch._scaled_mm takes (no per-call transposes). Operand layouts are by construction (row-major
    ``a``, column-major ``b``, E4M3 ``b``), not re-checked per call.
    """

    @staticmethod
    def forward(ctx, x, weight, state, recipe, w_col_scale=None, x_saver=None, grad_enabled=True,
                weight_cache=None):
        if not x.is_contiguous():
            x = x.contiguous()
        if recipe.scaling == "delayed":
            state.check_device(x)
        ops = _cast_ops_for(x.device.type)
        row = recipe.granularity == "row"
        needs_wgrad = grad_enabled and ctx.needs_input_grad[1]
        keep_x_fp8 = needs_wgrad and x_saver is None
        with phase_range("cast_x"):
            xc = _cast(x, "x", recipe, state, ops, True, keep_x_fp8, True)
        with phase_range("cast_w"):
            if weight_cache is not None and w_col_scale is None:
                wc = weight_cache.get(weight, recipe, lambda w: _weight_fp8(w, recipe, state, ops, True))
            else:
                wc = _weight_fp8(_effective_weight(weight, w_col_scale), recipe, state, ops, False)
        x_shape, out_dtype = x.shape, (torch.bfloat16 if row else x.dtype)
        with phase_range("gemm_fwd"):
            y = _gemm(xc.data, wc.fwd_b, xc.scale_inv, wc.fwd_scale_inv, out_dtype, recipe.fast_accum_forward,
                      (*x_shape[:-1], wc.fwd_b.shape[1]))
        ctx.x_handle = x_saver(x.reshape(-1, x_shape[-1])) if needs_wgrad and x_saver is not None else None
        ctx.recipe, ctx.state, ctx.ops, ctx.x_dtype, ctx.x_shape = recipe, state, ops, x.dtype, x_shape
        # dgrad's weight operand (the cached transposed copy, or None: re-cast in backward) and scales;
        # x's transposed FP8 copy is saved through save_for_backward (saved-tensor hooks see it)
        ctx.w_dgrad = (wc.dgrad_b, wc.dgrad_scale_inv, wc.scale_src) if grad_enabled else None
        ctx.x_scales = (xc.scale_t_inv, xc.scale_src)
        ctx.save_for_backward(weight, w_col_scale, xc.data_t if keep_x_fp8 else None)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        weight, w_col_scale, x_cm = ctx.saved_tensors
        recipe, state, ops = ctx.recipe, ctx.state, ctx.ops
        row = recipe.granularity == "row"
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = grad_y if grad_y.is_contiguous() else grad_y.contiguous()
        with phase_range("cast_g"):
            gc = _cast(g, "g", recipe, state, ops, need_dx, need_dw, False)
        dx = dw = None
        if need_dx:
            w_b, sw_inv, w_src = ctx.w_dgrad
            if w_b is None:  # no weight cache: re-cast with the forward's scales (the forward's codes)
                with phase_range("recast_w"):
                    w_b = _recast_t(_effective_weight(weight, w_col_scale), "w", recipe, ops, w_src).t()
            with phase_range("gemm_dgrad"):
                dx = _gemm(gc.data, w_b, gc.scale_inv, sw_inv, torch.bfloat16 if row else g.dtype, False, None)
            if dx.dtype != ctx.x_dtype:
                dx = dx.to(ctx.x_dtype)
            if dx.dim() != len(ctx.x_shape):
                dx = dx.view(ctx.x_shape)
        ctx.w_dgrad = None
        if need_dw:
            sx_inv, x_src = ctx.x_scales
            if x_cm is None:  # activation storage kept x (quantized or as a recompute handle)
                with phase_range("recast_x"):
                    x_hat = ctx.x_handle.materialize().reshape(-1, ctx.x_shape[-1]).to(ctx.x_dtype).contiguous()
                    ctx.x_handle = None
                    x_cm = _recast_t(x_hat, "x", recipe, ops, x_src).t()
            out_dtype = torch.bfloat16 if row else _wgrad_dtype(weight)
            with phase_range("gemm_wgrad"):
                dw = _gemm(gc.data_t, x_cm, gc.scale_t_inv.reshape(-1, 1) if row else gc.scale_t_inv, sx_inv,
                           out_dtype, False, None)
            if w_col_scale is not None:  # d(W * s)/dW = s per input column
                dw = dw.to(torch.float32) * w_col_scale
            if dw.dtype != weight.dtype:
                dw = dw.to(weight.dtype)
        return dx, dw, None, None, None, None, None, None


def _bind_apply():
    """FP8LinearFunction.apply without the Python wrapper older torch versions put around the C++
    ``_FunctionBase.apply`` (default-argument binding, functorch checks: a Python frame and a pass over
    the arguments per call). Same call when no functorch transform is active (checked per call; with
    one, the public apply runs). Where torch's ``Function.apply`` already is the C++ one (torch 2.14),
    it is used as is."""
    c_apply = torch._C._FunctionBase.__dict__.get("apply")
    public = FP8LinearFunction.apply
    if c_apply is None or torch.autograd.Function.__dict__.get("apply") is c_apply:
        return public
    raw = c_apply.__get__(None, FP8LinearFunction)
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        return public(*args) if transforms_active() else raw(*args)
    return apply


_apply_fp8_linear = _bind_apply()


def _gemm(a_fp8, b_fp8, scale_a_inv, scale_b_inv, out_dtype, fast_accum, out_shape):
    """a [M,K] row-major @ b [K,N] column-major (E4M3) with fp32 inverse scales (0-dim, or [M,1] and
    [1,N]); with ``out_shape`` (leading dims of x, N) the result is written into a tensor of that
    shape (not a view: autograd forbids in-place ops on views made inside a custom Function)."""
    if out_shape is None or len(out_shape) == 2:
        return torch._scaled_mm(a_fp8, b_fp8, scale_a=scale_a_inv, scale_b=scale_b_inv, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    y = torch.empty(out_shape, dtype=out_dtype, device=a_fp8.device)
    torch._scaled_mm(a_fp8, b_fp8, scale_a=scale_a_inv, scale_b=scale_b_inv, out_dtype=out_dtype,
                     use_fast_accum=fast_accum, out=y.view(a_fp8.shape[0], b_fp8.shape[1]))
    return y


def _wgrad_dtype(weight: torch.Tensor) -> torch.dtype:
    return weight.dtype if weight.dtype in _OUT_DTYPES else torch.float32


def check_fp8_linear_args(x: torch.Tensor, weight: torch.Tensor, scaling_state: FP8ScalingState | None,
                          recipe: FP8Recipe) -> None:
    """Shape, dtype and recipe checks shared by fp8_linear and its tests (no device check)."""
    if not isinstance(recipe, FP8Recipe):
        raise ValueError(f"recipe must be an agoq.ops.fp8_scaling.FP8Recipe, got {type(recipe).__name__}")
    if recipe.scaling == "delayed" and not isinstance(scaling_state, FP8ScalingState):
        raise ValueError("delayed scaling needs scaling_state=FP8ScalingState(recipe) (one per linear, kept "
                         "across steps)")
    if x.dtype not in _OUT_DTYPES or weight.dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_linear takes bf16/fp16/fp32 x and weight, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(weight is [out_features, in_features])")
    num_tokens = x.numel() // max(x.shape[-1], 1)
    if num_tokens % GEMM_DIM_MULTIPLE or weight.shape[1] % GEMM_DIM_MULTIPLE or weight.shape[0] % GEMM_DIM_MULTIPLE:
        dims = {"tokens (prod of x's leading dims)": num_tokens, "in_features": weight.shape[1],
                "out_features": weight.shape[0]}
        bad = {k: v for k, v in dims.items() if v % GEMM_DIM_MULTIPLE}
        raise ValueError(f"fp8_linear needs multiples of {GEMM_DIM_MULTIPLE} (torch._scaled_mm) but got {bad}; pad "
                         "the batch/sequence or keep this layer in bf16 via the policy")


@functools.lru_cache(maxsize=64)  # one device query per GPU, not one per call
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_FP8_DEVICES: set = set()  # devices that passed check_fp8_device (checked once each)


def check_fp8_device(device: torch.device, what: str = "fp8_linear") -> None:
    """Raise NotImplementedError unless ``device`` is a CUDA GPU with FP8 tensor cores (sm_89+)."""
    if device in _FP8_DEVICES:
        return
    device = torch.device(device)
    if device.type != "cuda":
        raise NotImplementedError(
            f"{what} runs torch._scaled_mm on a CUDA GPU with FP8 tensor cores (sm_89+); got a {device.type} "
            "tensor. On CPU use agoq.ref.fp8.ref_fp8_linear (simulated FP8) or keep the layer in bf16 (policy)")
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability < MIN_FP8_CAPABILITY:
        raise NotImplementedError(f"{what} needs compute capability >= {MIN_FP8_CAPABILITY} (Ada/Hopper), "
                                  f"this GPU has {capability}; keep the layer in bf16 (policy)")
    if device.index is not None:
        _FP8_DEVICES.add(device)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scaling_state: FP8ScalingState | None = None,
               recipe: FP8Recipe | None = None, bias: torch.Tensor | None = None, *,
               w_col_scale: torch.Tensor | None = None, x_saver=None,
               weight_cache: FP8WeightCache | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias) with FP8 GEMMs in forward and backward (see the module docstring).

    scaling_state: required for ``recipe.scaling == "delayed"`` (one per linear), else None.
    recipe: defaults to ``FP8Recipe()`` (per-tensor, current scaling).
    w_col_scale: fp32 [in_features]: use W * s (per-channel Smooth-SwiGLU folded into fc2).
    x_saver: ``x_saver(x2d) -> handle`` with ``handle.materialize()`` (activation storage), or None
    to keep x's FP8 transposed copy for the weight gradient.
    weight_cache: an :class:`agoq.ops.fp8_weight_cache.FP8WeightCache` (one per linear) to cast the
    weight once per weight version (both layouts) instead of in every forward and backward; not used
    with ``w_col_scale`` (W * s changes with every micro-batch).
    """
    recipe = _DEFAULT_RECIPE if recipe is None else recipe  # one object: the weight cache keys on its identity
    check_fp8_linear_args(x, weight, scaling_state, recipe)
    check_fp8_device(x.device)
    if w_col_scale is not None and (w_col_scale.shape != (weight.shape[1],) or w_col_scale.dtype != torch.float32):
        raise ValueError(f"w_col_scale must be fp32 [{weight.shape[1]}] (one per input column of the weight), got "
                         f"{w_col_scale.dtype} {tuple(w_col_scale.shape)}")
    grad_enabled = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    y = _apply_fp8_linear(x, weight, scaling_state, recipe, w_col_scale, x_saver, grad_enabled, weight_cache)
    return y if bias is None else y + bias
