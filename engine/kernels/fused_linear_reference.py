"""A linear layer with the RMS norm before it and the residual add after it, in pure PyTorch:
the reference of engine/kernels/gpu/skinny_gemm.py's fused single-row launch.

In a decoder layer every linear layer's input is a normalised row and every output projection
is added to the residual stream. At one row (decode at batch 1) the single-row GEMM reads the
whole input row in every program anyway, so it can take both in: the norm's sum of squares is
accumulated in the same loop that streams the weight, and since rms_norm(x) = s * x with one
scalar s = rsqrt(mean(x^2) + eps), the scale is applied to the dot products at the end:
W (w * s x) = s W (w * x). The residual add happens where each output feature is written.

- RowNorm: the RMS norm applied to the input row, rms_norm(x) * weight, statistics over the
  whole row (one norm group);
- ResidualAdd: the output added to the residual stream, residual + output * multiplier;
- fused_linear: what the fused launch computes, as separate PyTorch operations;
- add_residual: the residual add alone (for a layer whose output is all-reduced first).

Shapes: K input features, N output features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RowNorm:
    """x -> x * rsqrt(mean(x^2) + eps) * weight over the whole row (K,) of x."""

    weight: torch.Tensor  # (K,)
    eps: float


@dataclass(frozen=True)
class ResidualAdd:
    """y -> residual + y * multiplier, each operation rounded to the model dtype (as
    norm_reference.add_rms_norm does the decoder layer's update)."""

    residual: torch.Tensor  # (rows, N), the model dtype
    multiplier: float


def fused_linear(
    x: torch.Tensor,  # (rows, K), any float dtype
    weight: torch.Tensor,  # (N, K), the model dtype
    bias: torch.Tensor | None,  # (N,)
    *,
    norm: RowNorm | None = None,
    residual: ResidualAdd | None = None,
) -> torch.Tensor:
    """residual.residual + F.linear(norm(x), weight, bias) * residual.multiplier, (rows, N) in
    weight's dtype; a missing norm or residual is left out. The norm runs in fp32 and is
    rounded to weight's dtype once, before the GEMM."""
    if norm is not None:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
        x = (x32 * norm.weight.float()).to(weight.dtype)
    y = F.linear(x.to(weight.dtype), weight, bias)
    return y if residual is None else add_residual(y, residual)


def add_residual(y: torch.Tensor, residual: ResidualAdd) -> torch.Tensor:
    """residual.residual + y * residual.multiplier, in the residual's dtype."""
    return residual.residual + y * residual.multiplier
