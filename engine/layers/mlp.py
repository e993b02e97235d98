"""The dense gated MLP after every GraniteMoeHybrid block ("shared_mlp" in checkpoints)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from engine.tensor_parallel import IndexRange, TensorParallel


class GatedMLP(nn.Module):
    """output_linear(silu(gate) * up), where input_linear's output is [gate | up] (gate first).

    Tensor parallel: each rank holds intermediate channels `channels` of both gate and up
    (column-parallel input_linear) and the matching columns of output_linear (row-parallel,
    one all-reduce).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, channels: IndexRange,
        tp: TensorParallel, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        up_channels = (intermediate_size + channels[0], intermediate_size + channels[1])
        self.input_linear = ColumnParallelLinear(
            hidden_size, 2 * intermediate_size, (channels, up_channels), bias=False, dtype=dtype
        )
        self.output_linear = RowParallelLinear(
            intermediate_size, hidden_size, (channels,), bias=False, dtype=dtype, tp=tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        gate, up = self.input_linear(x).chunk(2, dim=-1)  # (T, I_local) each
        return self.output_linear(F.silu(gate) * up)
