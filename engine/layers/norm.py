"""RMS norms: the plain one around every block, and the gated, grouped one inside Mamba2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """weight * x / rms(x), the normalisation computed in fp32 and cast back to x's dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """weight * norm_g(y * silu(gate)): the gate is applied first, then each group of group_size
    consecutive channels is normalised by its own rms. All in fp32; returns `out_dtype`."""

    def __init__(
        self, hidden_size: int, group_size: int, eps: float, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if hidden_size % group_size != 0:
            raise ValueError(f"group_size {group_size} does not divide hidden_size {hidden_size}")
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, gate: (T, I) -> (T, I)."""
        gated = y.float() * F.silu(gate.float())
        grouped = gated.view(*gated.shape[:-1], -1, self.group_size)  # (T, G, I/G)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * grouped.view_as(gated)).to(out_dtype)
