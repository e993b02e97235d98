"""Routed experts: a router picks each token's K experts, each a gated SiLU MLP or a
non-gated squared-ReLU one (ExpertActivation), and their outputs are summed with the routing
weights ("block_sparse_moe" in GraniteMoeHybrid checkpoints, Nemotron-H's "mixer.experts").
A family's shared MLP (engine/layers/mlp.py) is not part of this layer: the decoder layer
adds it, summing both partial outputs before one all-reduce (below).

Routing is one explicit choice, `RoutingRule`, read by `route()`:
- TOP_K_THEN_SOFTMAX (GraniteMoe): the K largest router logits, softmax over those K only;
- SOFTMAX_THEN_TOP_K (Qwen3-Next): softmax over all E logits, then the K largest
  probabilities, renormalised to sum 1 when Routing.renormalize (the config's norm_topk_prob);
- SIGMOID_GROUPED_TOP_K (Nemotron-H; DeepSeek-V3's "noaux_tc"): scores sigmoid(logits); the
  experts are chosen on scores + a per-expert selection bias (the router's
  e_score_correction_bias, fp32), only among the Routing.top_groups of Routing.num_groups equal
  groups of experts whose two best biased scores sum highest; the weights are the chosen
  experts' unbiased scores, divided by their sum (+1e-20) when Routing.renormalize, times
  Routing.scaling. Its router multiplies in fp32 (Routing.logits_in_fp32), as transformers'.
A variant is a new member and a branch in `route()`, not a new layer. Qwen3-Next's, for
instance, is softmax over all E logits, then the K largest probabilities, renormalised to
sum 1 when the config's norm_topk_prob is set (a `renormalize` field next to `top_k` in
`Routing`); its shared expert scaled by sigmoid(shared_expert_gate(x)) is the family's
decoder layer's business (GatedMLP.forward(x, reduce=False) times the gate, added to this
layer's partial sum). Experts are held stacked, as GraniteMoe checkpoints store them:
`input_linear.weight` (E, 2I, D) = every expert's [gate | up] rows (E, I, D, up rows only,
for non-gated experts) and `output_linear.weight` (E, D, I); a family storing experts one by
one stacks them into these while loading. The experts read and write `input_size` channels
(Nemotron-H's moe_latent_size; hidden_size by default) while the router reads the hidden
states: a family with latent projections routes on x (select) and runs the experts on its
projection of x (run_experts).

Tensor parallel: each rank holds every expert and slice `channels` of each expert's I
intermediate channels (of gate and up, or of up alone, and the matching columns of the down
projection), exactly as GatedMLP splits the shared MLP; the router (E, D) and the selection
bias (E,) are replicated, so every rank
routes every token identically from the same (whole) hidden states. Each rank's expert output
is then a partial sum over its channels; forward(reduce=False) returns it so the decoder layer
adds the shared MLP's partial sum and all-reduces once per layer. Splitting channels rather
than assigning experts to ranks (expert parallelism) keeps every rank's work equal whatever
the routing, needs no token exchange, and reuses the dense MLP's collective.

Kernels: the CPU path runs engine/kernels/grouped_experts_reference.py (a loop over experts);
forward_gpu runs the grouped GEMM of engine/kernels/gpu/grouped_experts.py (two launches,
no host synchronisation, so CUDA graphs capture it), gated and non-gated alike. Every rule's
routing is device ops of fixed output size (topk, scatter, gather), no host synchronisation.

Shapes: T tokens, D hidden, E experts, I channels per expert (I_local on a rank), K experts
per token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels.grouped_experts_reference import ExpertActivation, grouped_experts
from engine.layers.parallel_linear import linear
from engine.parallel.tensor_parallel import IndexRange, ShardedModule, TensorParallel, TensorShard


class RoutingRule(enum.Enum):
    """How router logits become each token's experts and weights (module docstring)."""

    TOP_K_THEN_SOFTMAX = "top_k_then_softmax"
    SOFTMAX_THEN_TOP_K = "softmax_then_top_k"
    SIGMOID_GROUPED_TOP_K = "sigmoid_grouped_top_k"


@dataclass(frozen=True)
class Routing:
    """rule, and top_k: experts per token (1 <= top_k <= number of experts); renormalize: the
    K weights divided by their sum (SOFTMAX_THEN_TOP_K, SIGMOID_GROUPED_TOP_K; TOP_K_THEN_SOFTMAX
    ignores it). SIGMOID_GROUPED_TOP_K only: num_groups (dividing E), top_groups kept of them,
    scaling (the weights' factor). logits_in_fp32: the router's matmul on fp32 operands rather
    than in the model dtype (its weight then held in fp32)."""

    rule: RoutingRule
    top_k: int
    renormalize: bool = False
    num_groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0
    logits_in_fp32: bool = False


def route(
    logits: torch.Tensor, routing: Routing, selection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) fp32 router logits -> expert ids (T, K) int64 and their weights (T, K) fp32.
    selection_bias: (E,) fp32, SIGMOID_GROUPED_TOP_K's (required there, unused elsewhere).
    Ties in the logits go to the lower expert id (torch.topk's order, as transformers')."""
    if routing.rule is RoutingRule.SIGMOID_GROUPED_TOP_K:
        return _sigmoid_grouped_top_k(logits, routing, selection_bias)
    if routing.rule is RoutingRule.TOP_K_THEN_SOFTMAX:
        top_logits, expert_ids = logits.topk(routing.top_k, dim=-1)  # (T, K), (T, K)
        return expert_ids, torch.softmax(top_logits, dim=-1)
    if routing.rule is RoutingRule.SOFTMAX_THEN_TOP_K:
        weights, expert_ids = torch.softmax(logits, dim=-1).topk(routing.top_k, dim=-1)  # (T, K)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights
    raise ValueError(f"unknown routing rule {routing.rule!r}")


def _sigmoid_grouped_top_k(
    logits: torch.Tensor, routing: Routing, selection_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SIGMOID_GROUPED_TOP_K (module docstring): (T, E) -> ids (T, K), weights (T, K) fp32."""
    if selection_bias is None:
        raise ValueError("SIGMOID_GROUPED_TOP_K routing needs the router's selection bias")
    num_tokens, num_experts = logits.shape
    scores = torch.sigmoid(logits)  # (T, E)
    choice = scores + selection_bias  # (T, E): for choosing only
    if routing.top_groups < routing.num_groups:
        per_group = num_experts // routing.num_groups
        grouped = choice.view(num_tokens, routing.num_groups, per_group)  # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
        kept = group_scores.topk(routing.top_groups, dim=-1).indices  # (T, G_kept)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    expert_ids = choice.topk(routing.top_k, dim=-1).indices  # (T, K)
    weights = scores.gather(1, expert_ids)  # (T, K)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return expert_ids, weights * routing.scaling


class ExpertRouter(nn.Module):
    """layer: the (E, D) router weight, replicated on every rank ("router.layer.weight"), in
    fp32 when routing.logits_in_fp32 (the checkpoint's values, exactly), else in the model
    dtype; e_score_correction_bias: the (E,) fp32 selection bias, replicated, for
    SIGMOID_GROUPED_TOP_K only (absent otherwise)."""

    def __init__(self, hidden_size: int, num_experts: int, routing: Routing, dtype: torch.dtype) -> None:
        super().__init__()
        self.logits_in_fp32 = routing.logits_in_fp32
        weight_dtype = torch.float32 if routing.logits_in_fp32 else dtype
        self.layer = nn.Linear(hidden_size, num_experts, bias=False, dtype=weight_dtype)
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.rule is RoutingRule.SIGMOID_GROUPED_TOP_K:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, E) fp32
        """The logits in the model dtype then fp32, or with logits_in_fp32 on x cast to fp32
        (as each family's transformers router)."""
        if self.logits_in_fp32:
            return linear(x.float(), self.layer.weight, None)
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
    """router, input_linear (E, 2 I_local, D_in) = [gate | up] (SILU_GATED) or (E, I_local,
    D_in) = up (RELU_SQUARED), output_linear (E, D_in, I_local); D_in = input_size, default
    hidden_size (the router reads hidden_size channels).

    forward / forward_gpu: (T, D) -> (T, D), the routing-weighted sum of each token's experts;
    with reduce=False the rank's partial sum (no collective), else all-reduced. A family whose
    experts read a projection of x calls select(x) and run_experts(projection, ...) itself.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, routing: Routing,
        channels: IndexRange, tp: TensorParallel, dtype: torch.dtype,
        activation: ExpertActivation = ExpertActivation.SILU_GATED, input_size: int | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= routing.top_k <= num_experts:
            raise ValueError(f"top_k={routing.top_k} must be in [1, num_experts={num_experts}]")
        if num_experts % routing.num_groups or not 1 <= routing.top_groups <= routing.num_groups:
            raise ValueError(
                f"{routing.num_groups} expert groups (keeping {routing.top_groups}) do not fit "
                f"{num_experts} experts"
            )
        self.routing = routing
        self.activation = activation
        self.tp = tp
        input_size = hidden_size if input_size is None else input_size
        self.router = ExpertRouter(hidden_size, num_experts, routing, dtype)
        if activation is ExpertActivation.SILU_GATED:
            up_channels = (intermediate_size + channels[0], intermediate_size + channels[1])
            input_rows, input_ranges = 2 * intermediate_size, (channels, up_channels)
        else:
            input_rows, input_ranges = intermediate_size, (channels,)
        self.input_linear = StackedExpertLinear(num_experts, (input_rows, input_size), 1, input_ranges, dtype)
        self.output_linear = StackedExpertLinear(
            num_experts, (input_size, intermediate_size), 2, (channels,), dtype
        )

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, D) -> expert ids (T, K) int64 and weights (T, K) in x's dtype; device ops only."""
        expert_ids, weights = route(self.router(x), self.routing, self.router.e_score_correction_bias)
        return expert_ids, weights.to(x.dtype)

    def run_experts(
        self, inputs: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    ) -> torch.Tensor:  # (T, D_in) -> (T, D_in), this rank's partial sum
        """The PyTorch path (the reference loop over experts) on select's choice."""
        return grouped_experts(
            inputs, self.input_linear.weight, self.output_linear.weight, expert_ids, weights,
            self.activation,
        )

    def run_experts_gpu(
        self, inputs: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    ) -> torch.Tensor:  # (T, D_in) -> (T, D_in), this rank's partial sum
        """run_experts on CUDA: the grouped GEMM kernel, no host synchronisation."""
        from engine.kernels.gpu.grouped_experts import grouped_experts as grouped_experts_gpu

        return grouped_experts_gpu(
            inputs, self.input_linear.weight, self.output_linear.weight, expert_ids, weights,
            self.activation,
        )

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """The PyTorch path (the reference loop over experts)."""
        out = self.run_experts(x, *self.select(x))
        return self.tp.all_reduce(out) if reduce else out

    def forward_gpu(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA: the grouped GEMM kernel, no host synchronisation (graph-capturable)."""
        out = self.run_experts_gpu(x, *self.select(x))
        return self.tp.all_reduce(out) if reduce else out
