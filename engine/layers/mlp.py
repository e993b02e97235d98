"""The dense gated MLP after every GraniteMoeHybrid block ("shared_mlp" in checkpoints)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """output_linear(silu(gate) * up), where input_linear's output is [gate | up] (gate first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        gate, up = self.input_linear(x).chunk(2, dim=-1)  # (T, I) each
        return self.output_linear(F.silu(gate) * up)
