"""Rotary position embedding (RoPE, "rotate half" layout over the first rotary_dim channels of
each head: the whole head by default, a part of it with a partial rotary factor)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """cos/sin tables for absolute positions; stateless apart from (head_dim, theta, rotary_dim).

    rotary_dim: the channels of a head that rotate, the first ones (None: all head_dim); the
    frequencies are those of a rotary_dim-wide head."""

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 -> (cos, sin), each (T, rotary_dim) fp32."""
        dim = self.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (exponents / dim))  # (rotary_dim / 2,)
        angles = positions.float()[:, None] * inv_freq[None, :]  # (T, rotary_dim / 2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, rotary_dim)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim), cos/sin (T, rotary_dim) -> x with its first rotary_dim channels
    of each head rotated and the rest passed through, in x's dtype."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin
