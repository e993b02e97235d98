"""Fused RMS norms on the GPU: one launch where the PyTorch path runs six to ten elementwise and
reduction kernels.

GPU counterparts of engine/kernels/norm_reference.py:
- `add_rms_norm`: the residual update and the next RMSNorm in one pass over the row; the
  roundings of the reference (delta * r and the sum rounded to the model dtype, the normalised
  row rounded before the weight multiplies) are kept, so bf16 results match it to the last bit
  or one ulp (reduction order); zero_centered: Qwen3-Next's norm, (1 + w) * x / rms(x) all in
  fp32 and rounded once (norm_reference.rms_norm_zero_centered);
- `gated_rms_norm`: Mamba2's norm_g(y * silu(gate)) * weight, one program per (row, group),
  optionally with Mamba2's D skip (y + D * x per head) added as it reads y;
- `rms_norm_then_gate`: the gated delta-net's weight * norm(y) * silu(gate) per head of P
  channels (normalised first, then gated), one program per (row, head), with the reference's
  roundings.

Shapes: T tokens, D hidden, I channels, G groups, H heads, P channels per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, stride_x,  # (T, D), unit D stride
    delta_ptr, stride_delta,  # (T, D)
    w_ptr,  # (D,)
    residual_ptr, stride_r,  # (T, D) out: x + delta * r
    out_ptr, stride_o,  # (T, D) out: rms_norm(residual) * w (ZERO_CENTERED: * (1 + w))
    multiplier, eps, D,
    HAS_DELTA: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_for_previous(USE_PDL)
    t = tl.program_id(0)
    x = tl.load(x_ptr + t * stride_x + d, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + t * stride_delta + d, mask=mask, other=0.0).to(tl.float32)
        scaled = (delta * multiplier).to(dtype).to(tl.float32)
        x = (x + scaled).to(dtype).to(tl.float32)
        tl.store(residual_ptr + t * stride_r + d, x.to(dtype), mask=mask)
    mean_square = tl.sum(x * x, axis=0) / D
    normed = x * tl.rsqrt(mean_square + eps)
    if ZERO_CENTERED:  # the scale 1 + w, the product in fp32, rounded once
        scaled_norm = normed * (1.0 + w)
    else:  # the normalised row rounded to the model dtype before the weight
        scaled_norm = normed.to(dtype).to(tl.float32) * w
    tl.store(out_ptr + t * stride_o + d, scaled_norm.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    hidden: torch.Tensor,  # (T, D)
    delta: torch.Tensor | None,  # (T, D), hidden's dtype; None: no residual update
    residual_multiplier: float,
    weight: torch.Tensor,  # (D,), hidden's dtype
    eps: float,
    residual_out: torch.Tensor | None = None,  # (T, D); allocated when None
    out: torch.Tensor | None = None,  # (T, D); allocated when None
    zero_centered: bool = False,  # weight centred on zero: the scale is 1 + weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (new_hidden, normed) as norm_reference.add_rms_norm(..., zero_centered); with
    delta None new_hidden is `hidden` itself. Reads hidden and delta once, writes each output
    once."""
    num_tokens, dim = hidden.shape
    assert hidden.stride(1) == 1 and weight.is_contiguous() and weight.dtype == hidden.dtype
    if out is None:
        out = torch.empty(num_tokens, dim, dtype=hidden.dtype, device=hidden.device)
    if delta is None:
        residual_out = hidden
    else:
        assert delta.stride(1) == 1 and delta.dtype == hidden.dtype
        if residual_out is None:
            residual_out = torch.empty_like(out)
    if num_tokens == 0:
        return residual_out, out
    block_d = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(num_tokens,)](
        hidden, hidden.stride(0),
        delta if delta is not None else hidden, delta.stride(0) if delta is not None else 0,
        weight,
        residual_out, residual_out.stride(0),
        out, out.stride(0),
        float(residual_multiplier), float(eps), dim,
        HAS_DELTA=delta is not None, ZERO_CENTERED=zero_centered, BLOCK_D=block_d,
        num_warps=min(16, max(4, block_d // 512)),
        **launch_options(),
    )
    return residual_out, out


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr, stride_y,  # (T, I), unit I stride
    z_ptr, stride_z,  # (T, I) gate
    x_ptr, stride_x,  # (T, I) the skip's input, unit I stride (HAS_SKIP)
    d_ptr,  # (H,) fp32: the skip's weight per head of HEAD_DIM channels (HAS_SKIP)
    w_ptr,  # (I,)
    out_ptr, stride_o,  # (T, I)
    group_size, eps,
    HAS_SKIP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    t, g = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < group_size
    c = g * group_size + i
    # the weights, before the wait
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_SKIP:
        skip_weight = tl.load(d_ptr + c // HEAD_DIM, mask=mask, other=0.0)
    wait_for_previous(USE_PDL)
    y = tl.load(y_ptr + t * stride_y + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_SKIP:  # Mamba2's D skip: y + D[h] * x, head h = c // HEAD_DIM
        x = tl.load(x_ptr + t * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        y += skip_weight * x
    z = tl.load(z_ptr + t * stride_z + c, mask=mask, other=0.0).to(tl.float32)
    gated = y * (z * tl.sigmoid(z))
    mean_square = tl.sum(gated * gated, axis=0) / group_size
    out = w * (gated * tl.rsqrt(mean_square + eps))
    tl.store(out_ptr + t * stride_o + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
    out_dtype: torch.dtype,  # as norm_reference.gated_rms_norm's
    out: torch.Tensor | None = None,  # (T, I) out_dtype; allocated when None
    skip: tuple[torch.Tensor, torch.Tensor] | None = None,  # (x (T, I), D (H,) fp32)
) -> torch.Tensor:
    """norm_reference.gated_rms_norm in one launch of T x (I / group_size) programs.

    With skip = (x, D), Mamba2's D skip goes in first: the norm of y + D[c // (I / H)] * x per
    channel c, computed in fp32 (x any float dtype, unit channel stride, any row stride), so
    the scan's y need not be rewritten with it."""
    num_tokens, channels = y.shape
    assert y.stride(1) == 1 and gate.stride(1) == 1 and weight.is_contiguous()
    assert channels % group_size == 0
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=out_dtype, device=y.device)
    if num_tokens == 0:
        return out
    if skip is None:
        x, D, head_dim = y, weight, 1  # placeholders: the kernel reads neither without HAS_SKIP
    else:
        x, D = skip
        assert x.shape == y.shape and x.stride(1) == 1
        assert D.dtype == torch.float32 and D.is_contiguous() and channels % D.shape[0] == 0
        head_dim = channels // D.shape[0]
    block = triton.next_power_of_2(group_size)
    _gated_rms_norm_kernel[(num_tokens, channels // group_size)](
        y, y.stride(0), gate, gate.stride(0), x, x.stride(0), D, weight, out, out.stride(0),
        group_size, float(eps),
        HAS_SKIP=skip is not None, HEAD_DIM=head_dim,
        BLOCK=block, num_warps=min(16, max(4, block // 512)), **launch_options(),
    )
    return out


@triton.jit
def _rms_norm_then_gate_kernel(
    y_ptr, stride_yt, stride_yh,  # (T, H, P), unit P stride
    z_ptr, stride_zt, stride_zh,  # (T, H, P) gate, unit P stride
    w_ptr,  # (P,), y's dtype
    out_ptr,  # (T, H, P) contiguous
    P, eps,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    t, h = tl.program_id(0), tl.program_id(1)
    H = tl.num_programs(1)
    p = tl.arange(0, BLOCK)
    mask = p < P
    wait_for_previous(USE_PDL)  # every load after it, the weight's too: a small one
    w = tl.load(w_ptr + p, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * stride_yt + h * stride_yh + p, mask=mask, other=0.0)
    dtype = y.dtype
    y = y.to(tl.float32)
    mean_square = tl.sum(y * y, axis=0) / P
    # the reference's roundings: the normalised head, then its product with the weight, each
    # rounded to y's dtype; the gate in fp32
    normed = (y * tl.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
    scaled = (w * normed).to(dtype).to(tl.float32)
    z = tl.load(z_ptr + t * stride_zt + h * stride_zh + p, mask=mask, other=0.0).to(tl.float32)
    out = scaled * (z * tl.sigmoid(z))
    tl.store(out_ptr + (t * H + h) * P + p, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_then_gate(
    y: torch.Tensor,  # (T, H, P), unit P stride
    gate: torch.Tensor,  # (T, H, P), unit P stride
    weight: torch.Tensor,  # (P,), y's dtype
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """norm_reference.rms_norm_then_gate over each of the H heads of every row, in one launch
    of T x H programs: returns a new contiguous (T, H, P) tensor in out_dtype. y and gate may
    have any row and head strides (a gate split from a projection's output)."""
    num_tokens, heads, head_dim = y.shape
    assert gate.shape == y.shape and y.stride(2) == 1 and gate.stride(2) == 1
    assert weight.shape == (head_dim,) and weight.is_contiguous() and weight.dtype == y.dtype
    out = torch.empty(num_tokens, heads, head_dim, dtype=out_dtype, device=y.device)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(head_dim)
    _rms_norm_then_gate_kernel[(num_tokens, heads)](
        y, y.stride(0), y.stride(1), gate, gate.stride(0), gate.stride(1), weight, out,
        head_dim, float(eps),
        BLOCK=block, num_warps=min(16, max(4, block // 512)), **launch_options(),
    )
    return out
