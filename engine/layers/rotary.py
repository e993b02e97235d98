"""Rotary position embedding (RoPE, "rotate half" layout over the whole head)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """cos/sin tables for absolute positions; stateless apart from (head_dim, theta)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 -> (cos, sin), each (T, head_dim) fp32."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))  # (head_dim / 2,)
        angles = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim), cos/sin (T, head_dim) -> rotated x, in x's dtype."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin
