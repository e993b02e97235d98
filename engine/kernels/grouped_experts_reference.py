"""Routed experts applied to their tokens, in pure PyTorch: a loop over the experts. The CPU
path runs exactly this, and the grouped GEMM kernel (engine/kernels/gpu/grouped_experts.py) is
tested against it.

Each token t goes to the K experts expert_ids[t] with weights expert_weights[t]; expert e is a
gated SiLU MLP with stacked weights, as checkpoints store them:

    out[t] = sum_k expert_weights[t, k] * down[e_k] @ (silu(gate) * up),  [gate | up] = gate_up[e_k] @ x[t]

Roundings (those of transformers' experts in any dtype): [gate | up] and the down projection
in the weights' dtype, silu(gate) * up as norm_reference.silu_and_mul, the routing weight
multiplied in the dtype, the K products summed in the dtype.

Under tensor parallelism the weights hold the rank's slice of every expert's channels, and the
result is the rank's partial sum (the caller all-reduces).

Shapes: T tokens, D hidden, E experts, I channels per expert, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.norm_reference import silu_and_mul


def grouped_experts(
    hidden: torch.Tensor,  # (T, D)
    gate_up_weight: torch.Tensor,  # (E, 2I, D): [gate | up] rows of each expert
    down_weight: torch.Tensor,  # (E, D, I)
    expert_ids: torch.Tensor,  # (T, K) int64 in [0, E)
    expert_weights: torch.Tensor,  # (T, K) in hidden's dtype
) -> torch.Tensor:  # (T, D) in hidden's dtype
    """The weighted sum over each token's K experts (module docstring). Reads which experts
    are used on the host: for the CPU path and tests, not for CUDA graphs."""
    out = torch.zeros_like(hidden)
    for expert in expert_ids.unique().tolist():
        tokens, slots = torch.where(expert_ids == expert)  # (n,), (n,)
        gate_up = F.linear(hidden[tokens], gate_up_weight[expert])  # (n, 2I)
        expert_out = F.linear(silu_and_mul(gate_up), down_weight[expert])  # (n, D)
        weighted = expert_out * expert_weights[tokens, slots, None].to(hidden.dtype)
        out.index_add_(0, tokens, weighted)
    return out
