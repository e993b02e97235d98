"""The single-row GEMM with the norm before it as its prologue: one launch for norm + linear.

`skinny_linear_normed(norm, weight, bias)` computes F.linear(x, weight, bias) for x the output
row of a norm not yet applied (engine/kernels/pending_norm.py), by skinny_gemm.py's
_row_kernel with PROLOGUE ADD_RMS_NORM or GATED_NORM:
- PendingRmsNorm: x = rms_norm(hidden + delta * multiplier) * norm weight, with
  fused_norm.add_rms_norm's roundings (delta * multiplier, the sum, and the normalised row each
  rounded to hidden's dtype; x rounded to it); program 0 also writes hidden + delta *
  multiplier to residual_out, which must not overlap hidden or delta;
- PendingGatedNorm: x = Mamba2's gated group RMSNorm of y + D[h] * skip_x with gate, in fp32
  as fused_norm.gated_rms_norm computes it, rounded to weight's dtype (the dtype the unfused
  path materialises it in). Whole groups only.
Every program first reads the whole row (K <= MAX_NORM_WIDTH; 3 rows for the gated norm) for
the mean square, or one per group, then recomputes x slice by slice in its K loop from the
same inputs with the same operations. Where the result can differ from the unfused pair (the
norm kernel, then skinny_linear under the same config): the mean square is summed in another
order (a (BLOCK_ROW,) or (BLOCK_G, BLOCK_GS) register reduction under this launch's num_warps,
against the norm kernel's own layout), so rstd may differ in its last fp32 bit and an element
of x by one ulp of the dtype where that flips a rounding; on the GPU the compiler may also
contract y + D * skip_x into an FMA in one kernel and not the other. Under Triton's
interpreter (numpy reductions over rows of the same power-of-two width) the two agree bit for
bit in fp32 and fp16, which tests/gpu/test_norm_gemv.py checks; on a GPU it bounds the gap. Each
program reads the norm's input rows twice (2 rows for the residual norm, 3 for the gated one,
from L2 after the first programs) and the norm weight once, next to its BLOCK_N * K weight
elements. Not yet timed on a GPU.

Used by engine/layers/parallel_linear.py (forward_normed) at one row on CUDA; the reference is
the unfused pair, fused_norm's kernel then skinny_linear, and norm_reference behind it.
Shapes: K input features (the norm's width), N output features.
"""

from __future__ import annotations

import torch
import triton

from engine.kernels.gpu.skinny_gemm import (
    ADD_RMS_NORM, GATED_NORM, SUPPORTED_DTYPES, SkinnyConfig, launch_row_kernel,
)
from engine.kernels.pending_norm import PendingGatedNorm, PendingRmsNorm


# The norm prologues hold the whole row in registers for its statistics.
MAX_NORM_WIDTH = 8192


def _spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors (first to last element) intersect."""
    def span(t):
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _row_problem(name: str, t: torch.Tensor, width: int, dtype: torch.dtype | None, device) -> str | None:
    if t.shape != (1, width) or t.stride(1) != 1:
        return f"{name} must be (1, {width}) with unit column stride, got {tuple(t.shape)}"
    if dtype is not None and t.dtype != dtype:
        return f"{name} must be {dtype}, got {t.dtype}"
    if t.device != device:
        return f"{name} is on {t.device}, not {device}"
    return None


def normed_layout_problem(
    norm: PendingRmsNorm | PendingGatedNorm, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> str | None:
    """Why skinny_linear_normed(norm, weight, bias) cannot take these operands (device aside),
    or None when it can: one row of K <= MAX_NORM_WIDTH channels, the norm's tensors in the
    layouts PendingRmsNorm / PendingGatedNorm state, weight's dtype for the GEMM's x (hidden,
    or PendingGatedNorm.out_dtype), bias as for layout_problem; PendingRmsNorm.residual_out
    contiguous and not overlapping hidden or delta (other programs still read them while
    program 0 writes it)."""
    if weight.dim() != 2 or not weight.is_contiguous() or weight.dtype not in SUPPORTED_DTYPES:
        return f"weight must be 2-D, contiguous and one of {SUPPORTED_DTYPES}"
    depth, dtype, device = weight.shape[1], weight.dtype, weight.device
    if depth > MAX_NORM_WIDTH or weight.shape[0] == 0:
        return f"the norm prologues take 1 <= K <= {MAX_NORM_WIDTH} and N > 0, got {tuple(weight.shape)}"
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != dtype
                             or bias.device != device or not bias.is_contiguous()):
        return f"bias must be ({weight.shape[0]},) contiguous {dtype} on weight's device"
    if norm.weight.shape != (depth,) or not norm.weight.is_contiguous() or norm.weight.device != device:
        return f"the norm's weight must be ({depth},) contiguous on weight's device"
    if isinstance(norm, PendingRmsNorm):
        problem = _row_problem("hidden", norm.hidden, depth, dtype, device)
        if problem is None and norm.weight.dtype != dtype:
            problem = f"the norm's weight must be {dtype}"
        if problem is None and norm.delta is not None:
            problem = _row_problem("delta", norm.delta, depth, dtype, device) or _row_problem(
                "residual_out", norm.residual_out, depth, dtype, device)
            if problem is None and any(_spans_overlap(norm.residual_out, t) for t in (norm.hidden, norm.delta)):
                problem = "residual_out overlaps hidden or delta"
        return problem
    if norm.out_dtype != dtype:
        return f"out_dtype {norm.out_dtype} is not weight's dtype {dtype}"
    problem = (_row_problem("y", norm.y, depth, torch.float32, device)
               or _row_problem("gate", norm.gate, depth, None, device)
               or _row_problem("skip_x", norm.skip_x, depth, None, device))
    if problem is not None:
        return problem
    heads = norm.D.shape[0] if norm.D.dim() == 1 else 0
    if norm.D.dtype != torch.float32 or not norm.D.is_contiguous() or heads == 0 or depth % heads:
        return f"D must be (H,) contiguous fp32 with H dividing {depth}"
    if norm.group_size <= 0 or depth % norm.group_size:
        return f"group_size {norm.group_size} must divide {depth} (whole groups only)"
    return None


def skinny_linear_normed(
    norm: PendingRmsNorm | PendingGatedNorm,
    weight: torch.Tensor,  # (N, K) contiguous
    bias: torch.Tensor | None = None,  # (N,) contiguous, weight's dtype
    *,
    out: torch.Tensor | None = None,  # (1, N) contiguous, weight's dtype; allocated when None
    config: SkinnyConfig | None = None,  # None: autotuned
) -> torch.Tensor:
    """F.linear(x, weight, bias) into `out` (returned) for x the norm's output row, computed
    inside the same one launch (see the module docstring); a PendingRmsNorm's residual row is
    written to its residual_out. Checks the operands (AssertionError naming the problem), then
    runs skinny_linear_normed_unchecked."""
    problem = normed_layout_problem(norm, weight, bias)
    assert problem is None, problem
    if out is not None:
        assert out.shape == (1, weight.shape[0]) and out.is_contiguous() and out.dtype == weight.dtype, \
            f"out must be (1, {weight.shape[0]}) contiguous {weight.dtype}"
    return skinny_linear_normed_unchecked(norm, weight, bias, out=out, config=config)


def skinny_linear_normed_unchecked(
    norm: PendingRmsNorm | PendingGatedNorm,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """skinny_linear_normed without its checks, for callers that have established
    normed_layout_problem(norm, weight, bias) is None (engine/layers/parallel_linear.py)."""
    features, depth = weight.shape
    if out is None:
        out = torch.empty(1, features, dtype=weight.dtype, device=weight.device)
    if isinstance(norm, PendingRmsNorm):
        x = norm.hidden
        has_delta = norm.delta is not None
        delta, residual = (norm.delta, norm.residual_out) if has_delta else (x, x)
        pointers = (delta, residual, x, x, x, norm.weight)
        scalars = (norm.multiplier, norm.eps, 1)
        constants = dict(PROLOGUE=ADD_RMS_NORM.value, HAS_DELTA=has_delta, HEAD_DIM=1,
                         BLOCK_ROW=triton.next_power_of_2(depth), BLOCK_G=1, BLOCK_GS=1)
    else:
        x = norm.y
        pointers = (x, x, norm.gate, norm.skip_x, norm.D, norm.weight)
        scalars = (1.0, norm.eps, norm.group_size)
        constants = dict(PROLOGUE=GATED_NORM.value, HAS_DELTA=False,
                         HEAD_DIM=depth // norm.D.shape[0], BLOCK_ROW=1,
                         BLOCK_G=triton.next_power_of_2(depth // norm.group_size),
                         BLOCK_GS=triton.next_power_of_2(norm.group_size))
    launch_row_kernel(x, weight, bias, out, pointers, scalars, constants, config)
    return out
