"""The dense gated MLP after every block: GraniteMoeHybrid's fused [gate | up] layout (GatedMLP,
"shared_mlp" in checkpoints) and the Llama layout (SplitGatedMLP; Bamba, Falcon-H1); and
Nemotron-H's non-gated squared-ReLU MLP block (SquaredReluMLP)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.norm_reference import silu_and_mul
from engine.kernels.relu_squared_reference import relu_squared
from engine.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from engine.model_config import MLP_FUSED, MLP_SPLIT, HybridModelConfig
from engine.parallel.tensor_parallel import IndexRange, TensorParallel


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

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """reduce=False: this rank's partial sum, not yet all-reduced (RowParallelLinear.forward),
        for a caller that adds it to other partial sums before one all-reduce."""
        gate_up = self.input_linear(x)  # [gate | up]: (T, 2 I_local)
        return self.output_linear(silu_and_mul(gate_up), reduce)

    def forward_gpu(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA tensors. One row (decode at batch 1) whose [gate | up] the single-row
        GEMM takes (output_linear.supports_gated): silu(gate) * up is computed inside
        output_linear's GEMM, no launch of its own. Otherwise silu(gate) * up is one Triton
        launch (engine/kernels/gpu/activation.py) before output_linear. reduce as in forward."""
        gate_up = self.input_linear(x)  # (T, 2 I_local)
        if self.output_linear.supports_gated(gate_up):
            return self.output_linear.forward_gated(gate_up, reduce)
        from engine.kernels.gpu.activation import silu_and_mul as silu_and_mul_gpu

        return self.output_linear(silu_and_mul_gpu(gate_up), reduce)


class SplitGatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x) * gate_multiplier) * up_proj(x)): the Llama layout (Bamba,
    Falcon-H1; checkpoint names gate_proj, up_proj, down_proj), biases on all three when `bias`.
    gate_multiplier is Falcon-H1's (1.0 elsewhere); a multiplier on the output belongs to the
    decoder layer (its residual multiplier), not to this module.

    Tensor parallel: as GatedMLP, each rank holds intermediate channels `channels` of gate_proj
    and up_proj (column-parallel) and the matching columns of down_proj (row-parallel, one
    all-reduce; its bias replicated and added once).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, channels: IndexRange,
        tp: TensorParallel, dtype: torch.dtype, bias: bool = False, gate_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.gate_multiplier = gate_multiplier
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, (channels,), bias, dtype)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, (channels,), bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, (channels,), bias, dtype, tp)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """(T, D) -> [gate * gate_multiplier | up] (T, 2 I_local), GatedMLP's input_linear layout."""
        gate = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        return torch.cat([gate, self.up_proj(x)], dim=-1)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """reduce=False: this rank's partial sum, neither all-reduced nor with down_proj's bias
        (RowParallelLinear.forward), for a caller that sums partial outputs before one
        all-reduce (Qwen3-Next's sparse block)."""
        return self.down_proj(silu_and_mul(self.gate_up(x)), reduce)

    def forward_gpu(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA tensors, with GatedMLP.forward_gpu's activation: inside down_proj's
        single-row GEMM where it takes the [gate | up] row, else one Triton launch. reduce as
        in forward."""
        gate_up = self.gate_up(x)  # (T, 2 I_local)
        if self.down_proj.supports_gated(gate_up):
            return self.down_proj.forward_gated(gate_up, reduce)
        from engine.kernels.gpu.activation import silu_and_mul as silu_and_mul_gpu

        return self.down_proj(silu_and_mul_gpu(gate_up), reduce)


class SquaredReluMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): Nemotron-H's non-gated MLP ("relu2"), checkpoint names
    up_proj and down_proj.

    Tensor parallel: each rank holds intermediate channels `channels` (rows of the
    column-parallel up_proj, columns of the row-parallel down_proj, one all-reduce). bias:
    both projections carry one (down_proj's held whole on every rank).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, channels: IndexRange,
        tp: TensorParallel, dtype: torch.dtype, bias: bool = False,
    ) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, (channels,), bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, (channels,), bias, dtype, tp)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """reduce=False: this rank's partial sum, neither all-reduced nor with down_proj's bias
        (RowParallelLinear.forward), for a caller that sums partial outputs before one
        all-reduce (Nemotron-H's MoE block with its shared expert)."""
        return self.down_proj(relu_squared(self.up_proj(x)), reduce)  # (T, I_local) in between

    def forward_gpu(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA tensors: the squared ReLU is one Triton launch
        (engine/kernels/gpu/relu_squared.py) between the two GEMMs. reduce as in forward."""
        from engine.kernels.gpu.relu_squared import relu_squared as relu_squared_gpu

        return self.down_proj(relu_squared_gpu(self.up_proj(x)), reduce)


def dense_mlp(
    config: HybridModelConfig, channels: IndexRange, tp: TensorParallel, dtype: torch.dtype,
) -> GatedMLP | SplitGatedMLP:
    """The dense MLP of config.mlp_layout over shared_intermediate_size channels (this rank's
    `channels` of them); ValueError for an unknown layout."""
    size = (config.hidden_size, config.shared_intermediate_size, channels, tp, dtype)
    if config.mlp_layout == MLP_FUSED:
        if config.mlp_bias or config.mlp_gate_multiplier != 1.0:
            raise ValueError("mlp_bias / mlp_gate_multiplier need the split MLP layout")
        return GatedMLP(*size)
    if config.mlp_layout == MLP_SPLIT:
        return SplitGatedMLP(*size, bias=config.mlp_bias, gate_multiplier=config.mlp_gate_multiplier)
    raise ValueError(f"mlp_layout {config.mlp_layout!r} is not {MLP_FUSED!r} or {MLP_SPLIT!r}")
