"""Routed experts: a router picks each token's K experts, each a gated SiLU MLP, and their
outputs are summed with the routing weights ("block_sparse_moe" in GraniteMoeHybrid
checkpoints). A family's shared MLP (engine/layers/mlp.py) is not part of this layer: the
decoder layer adds it, summing both partial outputs before one all-reduce (below).

Routing is one explicit choice, `RoutingRule`, read by `route()`:
- TOP_K_THEN_SOFTMAX (GraniteMoe): the K largest router logits, softmax over those K only;
- SOFTMAX_THEN_TOP_K (Qwen3-Next): softmax over all E logits, then the K largest
  probabilities, renormalised to sum 1 when Routing.renormalize (the config's norm_topk_prob).
A variant is a new member and a branch in `route()`, not a new layer. Qwen3-Next's, for
instance, is softmax over all E logits, then the K largest probabilities, renormalised to
sum 1 when the config's norm_topk_prob is set (a `renormalize` field next to `top_k` in
`Routing`); its shared expert scaled by sigmoid(shared_expert_gate(x)) is the family's
decoder layer's business (GatedMLP.forward(x, reduce=False) times the gate, added to this
layer's partial sum). Experts are held stacked, as GraniteMoe checkpoints store them:
`input_linear.weight` (E, 2I, D) = every expert's [gate | up] rows and `output_linear.weight`
(E, D, I); a family storing experts one by one stacks them into these while loading.

Tensor parallel: each rank holds every expert and slice `channels` of each expert's I
intermediate channels (of gate and up, and the matching columns of the down projection),
exactly as GatedMLP splits the shared MLP; the router (E, D) is replicated, so every rank
routes every token identically from the same (whole) hidden states. Each rank's expert output
is then a partial sum over its channels; forward(reduce=False) returns it so the decoder layer
adds the shared MLP's partial sum and all-reduces once per layer. Splitting channels rather
than assigning experts to ranks (expert parallelism) keeps every rank's work equal whatever
the routing, needs no token exchange, and reuses the dense MLP's collective.

Kernels: the CPU path runs engine/kernels/grouped_experts_reference.py (a loop over experts);
forward_gpu runs the grouped GEMM of engine/kernels/gpu/grouped_experts.py (two launches,
no host synchronisation, so CUDA graphs capture it).

Shapes: T tokens, D hidden, E experts, I channels per expert (I_local on a rank), K experts
per token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels.grouped_experts_reference import grouped_experts
from engine.layers.parallel_linear import linear
from engine.tensor_parallel import IndexRange, ShardedModule, TensorParallel, TensorShard


class RoutingRule(enum.Enum):
    """How router logits become each token's experts and weights (module docstring)."""

    TOP_K_THEN_SOFTMAX = "top_k_then_softmax"
    SOFTMAX_THEN_TOP_K = "softmax_then_top_k"


@dataclass(frozen=True)
class Routing:
    """rule, and top_k: experts per token (1 <= top_k <= number of experts); renormalize:
    SOFTMAX_THEN_TOP_K's K weights divided by their sum (the other rule ignores it)."""

    rule: RoutingRule
    top_k: int
    renormalize: bool = False


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) fp32 router logits -> expert ids (T, K) int64 and their weights (T, K) fp32.
    Ties in the logits go to the lower expert id (torch.topk's order, as transformers')."""
    if routing.rule is RoutingRule.TOP_K_THEN_SOFTMAX:
        top_logits, expert_ids = logits.topk(routing.top_k, dim=-1)  # (T, K), (T, K)
        return expert_ids, torch.softmax(top_logits, dim=-1)
    if routing.rule is RoutingRule.SOFTMAX_THEN_TOP_K:
        weights, expert_ids = torch.softmax(logits, dim=-1).topk(routing.top_k, dim=-1)  # (T, K)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights
    raise ValueError(f"unknown routing rule {routing.rule!r}")


class ExpertRouter(nn.Module):
    """layer: the (E, D) router weight, replicated on every rank ("router.layer.weight")."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, E) fp32
        """The logits in the model dtype, then fp32 (as transformers' router)."""
        return linear(x, self.layer.weight, None).float()


class StackedExpertLinear(ShardedModule):
    """`weight` (E, out, in): one linear per expert, stacked; this rank holds, along `dim`
    (1: output rows, 2: input columns), the given ranges of every expert's full weight."""

    def __init__(
        self, num_experts: int, full_shape: tuple[int, int], dim: int,
        ranges: tuple[IndexRange, ...], dtype: torch.dtype,
    ) -> None:
        super().__init__()
        shard = TensorShard((num_experts, *full_shape), dim, ranges)
        self.weight = nn.Parameter(torch.empty(shard.shape, dtype=dtype))
        self.checkpoint_shards["weight"] = shard


class RoutedExperts(nn.Module):
    """router, input_linear (E, 2 I_local, D) = [gate | up], output_linear (E, D, I_local).

    forward / forward_gpu: (T, D) -> (T, D), the routing-weighted sum of each token's experts;
    with reduce=False the rank's partial sum (no collective), else all-reduced.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, routing: Routing,
        channels: IndexRange, tp: TensorParallel, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not 1 <= routing.top_k <= num_experts:
            raise ValueError(f"top_k={routing.top_k} must be in [1, num_experts={num_experts}]")
        self.routing = routing
        self.tp = tp
        up_channels = (intermediate_size + channels[0], intermediate_size + channels[1])
        self.router = ExpertRouter(hidden_size, num_experts, dtype)
        self.input_linear = StackedExpertLinear(
            num_experts, (2 * intermediate_size, hidden_size), 1, (channels, up_channels), dtype
        )
        self.output_linear = StackedExpertLinear(
            num_experts, (hidden_size, intermediate_size), 2, (channels,), dtype
        )

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, D) -> expert ids (T, K) int64 and weights (T, K) in x's dtype; device ops only."""
        expert_ids, weights = route(self.router(x), self.routing)
        return expert_ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """The PyTorch path (the reference loop over experts)."""
        expert_ids, weights = self.select(x)
        out = grouped_experts(
            x, self.input_linear.weight, self.output_linear.weight, expert_ids, weights
        )
        return self.tp.all_reduce(out) if reduce else out

    def forward_gpu(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA: the grouped GEMM kernel, no host synchronisation (graph-capturable)."""
        from engine.kernels.gpu.grouped_experts import grouped_experts as grouped_experts_gpu

        expert_ids, weights = self.select(x)
        out = grouped_experts_gpu(
            x, self.input_linear.weight, self.output_linear.weight, expert_ids, weights
        )
        return self.tp.all_reduce(out) if reduce else out
