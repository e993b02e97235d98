"""The dense gated MLP after every GraniteMoeHybrid block ("shared_mlp" in checkpoints)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.norm_reference import silu_and_mul
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
        return self.output_linear(silu_and_mul(self.input_linear(x)))  # [gate | up]: (T, 2 I_local)

    def forward_gpu(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA tensors. One row (decode at batch 1) whose [gate | up] the single-row
        GEMM takes (output_linear.supports_gated): silu(gate) * up is computed inside
        output_linear's GEMM, no launch of its own. Otherwise silu(gate) * up is one Triton
        launch (engine/kernels/gpu/activation.py) before output_linear."""
        gate_up = self.input_linear(x)  # (T, 2 I_local)
        if self.output_linear.supports_gated(gate_up):
            return self.output_linear.forward_gated(gate_up)
        from engine.kernels.gpu.activation import silu_and_mul as silu_and_mul_gpu

        return self.output_linear(silu_and_mul_gpu(gate_up))
