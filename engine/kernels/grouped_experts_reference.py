"""Routed experts applied to their tokens, in pure PyTorch: a loop over the experts. The CPU
path runs exactly this, and the grouped GEMM kernel (engine/kernels/gpu/grouped_experts.py) is
tested against it.

Each token t goes to the K experts expert_ids[t] with weights expert_weights[t]; expert e is
an MLP with stacked weights, as checkpoints store them, of one of two kinds (ExpertActivation):

    SILU_GATED (GraniteMoe, Qwen3-Next):  [gate | up] = input[e_k] @ x[t],  h = silu(gate) * up
    RELU_SQUARED (Nemotron-H):            up = input[e_k] @ x[t],           h = relu(up)^2
    out[t] = sum_k expert_weights[t, k] * down[e_k] @ h

Roundings (those of transformers' experts in any dtype): the input and the down projections
in the weights' dtype, silu(gate) * up as norm_reference.silu_and_mul, relu(up)^2 as
relu_squared_reference.relu_squared, the routing weight multiplied in the dtype, the K
products summed in the dtype. (transformers' Nemotron-H multiplies and sums in fp32 instead:
the same values in fp32, a rounding apart in half precision.)

Under tensor parallelism the weights hold the rank's slice of every expert's channels, and the
result is the rank's partial sum (the caller all-reduces).

Shapes: T tokens, D the experts' input and output width, E experts, I channels per expert, K
experts per token; the input weight holds 2I rows ([gate | up]) for SILU_GATED, I for
RELU_SQUARED.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from engine.kernels.norm_reference import silu_and_mul
from engine.kernels.relu_squared_reference import relu_squared


class ExpertActivation(enum.Enum):
    """Each expert's MLP: gated SiLU over [gate | up] rows, or squared ReLU over up rows."""

    SILU_GATED = "silu_gated"
    RELU_SQUARED = "relu_squared"

    def channels(self, input_rows: int) -> int:
        """I, from the rows of an expert's input projection (2I or I)."""
        return input_rows // 2 if self is ExpertActivation.SILU_GATED else input_rows

    def apply(self, projected: torch.Tensor) -> torch.Tensor:
        """(n, 2I) [gate | up] or (n, I) up -> (n, I), in projected's dtype."""
        if self is ExpertActivation.SILU_GATED:
            return silu_and_mul(projected)
        return relu_squared(projected)


def grouped_experts(
    hidden: torch.Tensor,  # (T, D)
    input_weight: torch.Tensor,  # (E, 2I, D) [gate | up] rows, or (E, I, D) up rows
    down_weight: torch.Tensor,  # (E, D, I)
    expert_ids: torch.Tensor,  # (T, K) int64 in [0, E)
    expert_weights: torch.Tensor,  # (T, K) in hidden's dtype
    activation: ExpertActivation = ExpertActivation.SILU_GATED,
) -> torch.Tensor:  # (T, D) in hidden's dtype
    """The weighted sum over each token's K experts (module docstring). Reads which experts
    are used on the host: for the CPU path and tests, not for CUDA graphs."""
    out = torch.zeros_like(hidden)
    for expert in expert_ids.unique().tolist():
        tokens, slots = torch.where(expert_ids == expert)  # (n,), (n,)
        projected = F.linear(hidden[tokens], input_weight[expert])  # (n, 2I) or (n, I)
        expert_out = F.linear(activation.apply(projected), down_weight[expert])  # (n, D)
        weighted = expert_out * expert_weights[tokens, slots, None].to(hidden.dtype)
        out.index_add_(0, tokens, weighted)
    return out
