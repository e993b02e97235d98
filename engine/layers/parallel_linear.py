"""Linear layers split across tensor-parallel ranks.

ColumnParallelLinear holds some output rows of the full weight: its output stays split (each
rank has its own features; no collective). RowParallelLinear holds the matching input
columns: each rank's partial product is summed over ranks (one all-reduce), then the bias,
held whole on every rank, is added once. At world_size 1 both compute exactly nn.Linear's
function (on CUDA a single row may take a Triton kernel: `linear` below). At one row
RowParallelLinear.forward_gated also takes the MLP's [gate | up] row and computes
silu(gate) * up inside that kernel.
Parameter names are nn.Linear's ("weight", "bias"), so checkpoint names map unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.tensor_parallel import IndexRange, ShardedModule, TensorParallel, TensorShard


def _total(ranges: tuple[IndexRange, ...]) -> int:
    return sum(end - start for start, end in ranges)


# Every single-row linear takes the skinny GEMM kernel on CUDA. Measured on the H200 with
# programmatic dependent launch (benchmarks/skinny_gemm.py, weights from HBM, back-to-back
# calls in a CUDA graph): 1.32-2.69x faster than cuBLAS where N <= 2,048 (cuBLAS splits K and
# adds a reduce launch) and 1.01-1.11x on the wide weights (N 8,512 and 11,264). The LM head
# does not come through here: engine/layers/vocab_parallel.py keeps F.linear for it. For
# 2..16 rows a tiled variant gains at most 4% of a step's linear time over cuBLAS: F.linear.
#
# Which kernel a linear runs is decided here, per call, from its operands (routes_to_skinny),
# not by the step's plan: the single-row GEMM's eligibility depends on the weight (its dtype,
# layout and device) as much as on the row count, so the operands are the one place that
# holds every fact the rule needs (each linear of a step sees the step's rows).


def routes_to_skinny(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, gated: bool = False
) -> bool:
    """The routing rule of `linear` (and, gated, of RowParallelLinear.supports_gated): True for
    a one-row x on CUDA whose operands engine/kernels/gpu/skinny_gemm.py supports (gated: x is
    the (1, 2K) [gate | up] row); those run there, everything else runs F.linear. The checks
    are made here once, so callers launch the kernel unchecked."""
    if not (x.is_cuda and x.shape[0] == 1):
        return False
    from engine.kernels.gpu.skinny_gemm import supports

    return supports(x, weight, bias, gated=gated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias); operands that routes_to_skinny accepts run
    engine/kernels/gpu/skinny_gemm.py instead (same result within fp32-accumulation rounding).
    Its first call per weight shape autotunes, so CUDA graphs are captured after an eager
    warm-up (engine/routes/decode_graphs.py does this)."""
    if routes_to_skinny(x, weight, bias):
        from engine.kernels.gpu.skinny_gemm import skinny_linear_unchecked

        return skinny_linear_unchecked(x, weight, bias)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(ShardedModule):
    """y_local = x @ W[rows].T + b[rows], rows = output_ranges of the full (out, in) weight
    concatenated in order (several ranges for fused projections such as Mamba2's in_proj)."""

    def __init__(
        self,
        in_features: int,
        full_out_features: int,
        output_ranges: tuple[IndexRange, ...],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        out_features = _total(output_ranges)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.checkpoint_shards["weight"] = TensorShard(
            (full_out_features, in_features), 0, output_ranges
        )
        if bias:
            self.checkpoint_shards["bias"] = TensorShard((full_out_features,), 0, output_ranges)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out_local)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(ShardedModule):
    """y = all_reduce(x_local @ W[:, cols].T) + b, cols = input_ranges of the full (out, in)
    weight; x_local holds exactly those input features. The bias is replicated."""

    def __init__(
        self,
        full_in_features: int,
        out_features: int,
        input_ranges: tuple[IndexRange, ...],
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.tp = tp
        in_features = _total(input_ranges)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.checkpoint_shards["weight"] = TensorShard(
            (out_features, full_in_features), 1, input_ranges
        )

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, in_local) -> (T, out)
        """reduce=False: this rank's partial product x_local @ W[:, cols].T only, without the
        all-reduce and the bias, for a caller that sums several row-parallel outputs before
        one all-reduce (the routed experts and the shared MLP) and adds any bias itself."""
        if not reduce:
            return linear(x, self.weight, None)
        if self.tp.world_size == 1:
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight, None))
        return y if self.bias is None else y + self.bias

    def supports_row_rms(self, x: torch.Tensor) -> bool:
        """Whether forward_row_rms may take x (1, in_local): world size 1 (the norm's scale
        applies to the whole sum over the input features) and routes_to_skinny."""
        return self.tp.world_size == 1 and routes_to_skinny(x, self.weight, self.bias)

    def forward_row_rms(self, x: torch.Tensor, row_rms) -> torch.Tensor:  # (1, in) -> (1, out)
        """forward of an RMS-normed row whose normalisation is folded into the single-row GEMM
        (skinny_gemm.RowRms: x holds the norm's weight times its input, row_rms its sums of
        squares). Requires supports_row_rms(x), not checked again here."""
        from engine.kernels.gpu.skinny_gemm import skinny_linear_unchecked

        return skinny_linear_unchecked(x, self.weight, self.bias, row_rms=row_rms)

    def supports_gated(self, gate_up: torch.Tensor) -> bool:
        """Whether forward_gated may take gate_up (1, 2 in_local) = [gate | up]: routes_to_skinny
        with the gated layout, for the bias the local GEMM adds (all of it at world_size 1,
        none otherwise)."""
        local_bias = self.bias if self.tp.world_size == 1 else None
        return routes_to_skinny(gate_up, self.weight, local_bias, gated=True)

    def forward_gated(self, gate_up: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (1, 2 in_local) -> (1, out)
        """forward(silu_and_mul(gate_up), reduce) with silu(gate) * up computed inside the
        single-row GEMM (engine/kernels/gpu/skinny_gemm.py's gated variant, one launch), then
        the same all-reduce and bias as forward (neither when reduce is False). Requires
        supports_gated(gate_up), which is not checked again here."""
        from engine.kernels.gpu.skinny_gemm import skinny_linear_unchecked

        if not reduce:
            return skinny_linear_unchecked(gate_up, self.weight, None, gated=True)
        if self.tp.world_size == 1:
            return skinny_linear_unchecked(gate_up, self.weight, self.bias, gated=True)
        y = self.tp.all_reduce(skinny_linear_unchecked(gate_up, self.weight, None, gated=True))
        return y if self.bias is None else y + self.bias
