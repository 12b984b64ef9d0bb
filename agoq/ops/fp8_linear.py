"""FP8 linear without Transformer Engine: ``torch._scaled_mm`` on Hopper, E4M3 forward / E5M2 backward.

``fp8_linear(x, weight, scaling_state, recipe, bias=None)`` computes ``x @ weight.T (+ bias)`` with
x [..., K] (bf16), weight [N, K]; the spec and the simulated twin are :mod:`agoq.ref.fp8`
(``ref_fp8_linear``), which takes the same scales and differs only in the GEMM (fp32 on dequantized
values instead of FP8 tensor cores).

GEMMs (``torch._scaled_mm(a, b, scale_a, scale_b, ...)`` wants a row-major, b column-major, both dims
of b and a's inner dim multiples of 16, fp32 inverse scales; on the CUTLASS row-wise path b must be
E4M3, so the E5M2 gradient is always operand a; cuBLAS forbids E5M2 x E5M2):

  forward  y  [M,N] = x_e4m3 [M,K]      @ w_e4m3.T  [K,N]
  dgrad    dx [M,K] = g_e5m2 [M,N]      @ w_e4m3    [N,K]
  wgrad    dw [N,K] = g_e5m2.T [N,M]    @ x_e4m3    [M,K]

Saved for backward (no high-precision copy of the input): tensor granularity saves ``x_e4m3``
(1 byte/element) and its scale, and re-casts the weight (a parameter, already stored) with the
forward's scale, which reproduces the forward's codes bit for bit. Row granularity saves x cast with
per-column scales (the wgrad contraction runs over tokens), in the transposed layout wgrad consumes,
so again 1 byte/element; the forward's per-token cast is freed after the forward GEMM.

Savings: the saved input of every FP8 linear is 1 byte/element instead of 2 (bf16). Caveats: tokens
(M = prod of x's leading dims), K and N must be multiples of 16; per-tensor casts are plain PyTorch
ops (an fp32 temporary of the tensor; no fused amax+cast kernel yet).
"""

from __future__ import annotations

import torch

from agoq.ops.fp8_scaling import FP8Recipe, FP8ScalingState, current_scale
from agoq.ref.fp8 import BACKWARD_VARIANT, FORWARD_VARIANT, ref_fp8_cast

__all__ = ["fp8_linear", "FP8LinearFunction", "MIN_FP8_CAPABILITY", "GEMM_DIM_MULTIPLE"]

MIN_FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90); torch._scaled_mm's check
GEMM_DIM_MULTIPLE = 16  # torch._scaled_mm: a.size(1), b.size(0), b.size(1) multiples of 16 (cuBLASLt FP8)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _scaled_gemm(a_fp8: torch.Tensor, b_fp8: torch.Tensor, scale_a_inv: torch.Tensor, scale_b_inv: torch.Tensor,
                 out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a [M,K] row-major @ b [K,N] column-major with fp32 inverse scales (0-dim, or [M,1] and [1,N])."""
    assert a_fp8.is_contiguous() and b_fp8.t().is_contiguous(), "internal: operand layouts"
    assert b_fp8.dtype == torch.float8_e4m3fn, "internal: operand b must be E4M3 (CUTLASS row-wise path)"
    return torch._scaled_mm(a_fp8, b_fp8, scale_a=scale_a_inv, scale_b=scale_b_inv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _colmajor(t_fp8: torch.Tensor) -> torch.Tensor:
    """The same [R, C] matrix stored column-major (a transposed contiguous copy, viewed back)."""
    return t_fp8.t().contiguous().t()


def _scale(state: FP8ScalingState | None, recipe: FP8Recipe, slot: str, tensor: torch.Tensor) -> torch.Tensor:
    if recipe.scaling == "delayed":
        return state.scale_and_record(slot, tensor)
    return current_scale(tensor, slot, recipe)


class FP8LinearFunction(torch.autograd.Function):
    """Device-agnostic core of :func:`fp8_linear` (x 2-D [M, K]; no bias)."""

    @staticmethod
    def forward(ctx, x2, weight, state, recipe):
        ctx.recipe, ctx.state, ctx.x_dtype = recipe, state, x2.dtype
        x2, weight_c = x2.contiguous(), weight.contiguous()  # no-ops for the usual contiguous tensors
        if recipe.granularity == "tensor":
            y, saved = _forward_tensor(x2, weight_c, state, recipe)
        else:
            y, saved = _forward_row(x2, weight_c, recipe)
        ctx.save_for_backward(weight, *saved)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        weight, *saved = ctx.saved_tensors
        g2, w_c = grad_y.contiguous(), weight.contiguous()
        if ctx.recipe.granularity == "tensor":
            dx, dw = _backward_tensor(g2, w_c, saved, ctx.state, ctx.recipe)
        else:
            dx, dw = _backward_row(g2, w_c, saved, ctx.recipe)
        return dx.to(ctx.x_dtype), dw.to(weight.dtype), None, None


def _forward_tensor(x2, weight, state, recipe):
    sx = _scale(state, recipe, "x", x2)
    sw = _scale(state, recipe, "w", weight)
    x_fp8 = ref_fp8_cast(x2, sx, FORWARD_VARIANT)
    w_fp8 = ref_fp8_cast(weight, sw, FORWARD_VARIANT)
    y = _scaled_gemm(x_fp8, w_fp8.t(), sx.reciprocal(), sw.reciprocal(), x2.dtype, recipe.fast_accum_forward)
    return y, (x_fp8, sx, sw)


def _backward_tensor(g2, weight, saved, state, recipe):
    x_fp8, sx, sw = saved
    sg = _scale(state, recipe, "g", g2)
    g_fp8 = ref_fp8_cast(g2, sg, BACKWARD_VARIANT)
    w_fp8 = ref_fp8_cast(weight, sw, FORWARD_VARIANT)  # the forward's scale: the forward's codes
    dx = _scaled_gemm(g_fp8, _colmajor(w_fp8), sg.reciprocal(), sw.reciprocal(), g2.dtype, False)
    dw = _scaled_gemm(g_fp8.t().contiguous(), _colmajor(x_fp8), sg.reciprocal(), sx.reciprocal(),
                      _wgrad_dtype(weight), False)
    return dx, dw


def _forward_row(x2, weight, recipe):
    sx_row = current_scale(x2, "x", recipe, dim=1)  # [M, 1]
    sw_row = current_scale(weight, "w", recipe, dim=1)  # [N, 1]
    x_fp8 = ref_fp8_cast(x2, sx_row, FORWARD_VARIANT)
    w_fp8 = ref_fp8_cast(weight, sw_row, FORWARD_VARIANT)
    y = _scaled_gemm(x_fp8, w_fp8.t(), sx_row.reciprocal(), sw_row.reciprocal().reshape(1, -1), torch.bfloat16,
                     recipe.fast_accum_forward)
    sx_col = current_scale(x2, "x", recipe, dim=0)  # [1, K]: wgrad contracts over tokens
    xt_fp8 = ref_fp8_cast(x2, sx_col, FORWARD_VARIANT).t().contiguous()  # [K, M], wgrad's layout
    return y, (xt_fp8, sx_col)


def _backward_row(g2, weight, saved, recipe):
    xt_fp8, sx_col = saved
    sg_row = current_scale(g2, "g", recipe, dim=1)  # [M, 1]
    sw_col = current_scale(weight, "w", recipe, dim=0)  # [1, K]: dgrad contracts over out_features
    g_fp8 = ref_fp8_cast(g2, sg_row, BACKWARD_VARIANT)
    w_fp8 = _colmajor(ref_fp8_cast(weight, sw_col, FORWARD_VARIANT))
    dx = _scaled_gemm(g_fp8, w_fp8, sg_row.reciprocal(), sw_col.reciprocal(), torch.bfloat16, False)
    sg_col = current_scale(g2, "g", recipe, dim=0)  # [1, N]
    gt_fp8 = ref_fp8_cast(g2, sg_col, BACKWARD_VARIANT).t().contiguous()  # [N, M]
    dw = _scaled_gemm(gt_fp8, xt_fp8.t(), sg_col.reciprocal().reshape(-1, 1), sx_col.reciprocal(), torch.bfloat16,
                      False)
    return dx, dw


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
    dims = {"tokens (prod of x's leading dims)": num_tokens, "in_features": weight.shape[1],
            "out_features": weight.shape[0]}
    bad = {k: v for k, v in dims.items() if v % GEMM_DIM_MULTIPLE}
    if bad:
        raise ValueError(f"fp8_linear needs multiples of {GEMM_DIM_MULTIPLE} (torch._scaled_mm) but got {bad}; pad "
                         "the batch/sequence or keep this layer in bf16 via the policy")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scaling_state: FP8ScalingState | None = None,
               recipe: FP8Recipe | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias) with FP8 GEMMs in forward and backward (see the module docstring).

    scaling_state: required for ``recipe.scaling == "delayed"`` (one per linear), else None.
    recipe: defaults to ``FP8Recipe()`` (per-tensor, current scaling).
    """
    recipe = FP8Recipe() if recipe is None else recipe
    check_fp8_linear_args(x, weight, scaling_state, recipe)
    if x.device.type != "cuda":
        raise NotImplementedError(
            f"fp8_linear runs torch._scaled_mm on a CUDA GPU with FP8 tensor cores (sm_89+); got a {x.device.type} "
            "tensor. On CPU use agoq.ref.fp8.ref_fp8_linear (simulated FP8) or keep the layer in bf16 (policy)")
    capability = torch.cuda.get_device_capability(x.device)
    if capability < MIN_FP8_CAPABILITY:
        raise NotImplementedError(f"fp8_linear needs compute capability >= {MIN_FP8_CAPABILITY} (Ada/Hopper), "
                                  f"this GPU has {capability}; keep the layer in bf16 (policy)")
    y = FP8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, scaling_state, recipe)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
