"""Nemotron-H's MoE block (layer type "moe", pattern letter "E"): routed experts plus a shared
expert, the mixer of a block like the Mamba2, attention and MLP mixers
(engine/models/nemotron_h.py).

    ids, w = route(router(x))                   sigmoid scores, grouped top-k (below)
    out = fc2(experts(fc1(x), ids, w)) + shared_experts(x)

Numerically transformers' NemotronHMoE (5.x): NemotronHTopkRouter's routing is
RoutingRule.SIGMOID_GROUPED_TOP_K (engine/layers/routed_experts.py): logits on fp32 operands,
experts chosen on sigmoid(logits) + e_score_correction_bias among the topk_group best of
n_group expert groups, weights the chosen sigmoid scores renormalised when norm_topk_prob,
times routed_scaling_factor. Each expert is non-gated, down(relu(up(x))^2)
(ExpertActivation.RELU_SQUARED); the shared expert a SquaredReluMLP of
moe_shared_expert_intermediate_size channels on x (n_shared_experts is not read: transformers
builds one shared MLP whatever it says). With moe_latent_size the experts run on
fc1_latent_proj(x) (latent width L) and their sum goes back through fc2_latent_proj; without
it both are the identity.

Checkpoint names (under "backbone.layers.{i}.mixer."), mapped by `parameter_name` and
`stacked_piece`:
- gate.weight (E, D) -> experts.router.layer.weight; gate.e_score_correction_bias (E,) fp32
  -> experts.router.e_score_correction_bias;
- experts.{e}.up_proj.weight (I, L) and experts.{e}.down_proj.weight (L, I), one by one as
  the published checkpoints and transformers' save_pretrained store them: pieces of the
  stacked experts.input_linear.weight (E, I, L) and experts.output_linear.weight (E, L, I);
  experts.up_proj / experts.down_proj (fused 3-D, transformers' in-memory names) map whole;
- shared_experts.{up,down}_proj.weight, fc1_latent_proj.weight, fc2_latent_proj.weight as is.

Tensor parallel (engine/parallel/shard_layout.py): each expert's I channels split across ranks
(layout.expert_channels: rows of up_proj, columns of down_proj, every rank holds every
expert) as the other families' experts; the shared expert's channels split
(layout.shared_expert_channels); the router, the selection bias and both latent projections
are replicated (every rank routes alike and computes the whole latent input). fc2 is linear
without bias (mlp_bias is refused), so it maps each rank's partial expert sum on its own; the
experts' and the shared expert's partial sums are added and all-reduced once per block.

GPU: the experts run the grouped GEMM (engine/kernels/gpu/grouped_experts.py, non-gated
variant), routing and projections are device ops: no host synchronisation.

Shapes: T tokens, D hidden, L latent (D without moe_latent_size), E experts, I channels per
expert, K experts per token.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from engine.kernels.grouped_experts_reference import ExpertActivation
from engine.layers.mlp import SquaredReluMLP
from engine.layers.parallel_linear import linear
from engine.layers.routed_experts import RoutedExperts, Routing, RoutingRule
from engine.model_config import HybridModelConfig
from engine.parallel.shard_layout import RankShardLayout
from engine.parallel.tensor_parallel import StackedPiece, TensorParallel

_ROUTER_TENSOR = re.compile(r"^(layers\.\d+\.mixer)\.gate\.(weight|e_score_correction_bias)$")
_FUSED_EXPERTS_TENSOR = re.compile(r"^(layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)$")
_EXPERT_TENSOR = re.compile(
    r"^(?:backbone\.|model\.)?(layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$"
)
_STACKED = {"up_proj": "input_linear.weight", "down_proj": "output_linear.weight"}


def moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The HybridModelConfig fields of the MoE blocks from a nemotron_h config.json
    (transformers' NemotronHConfig defaults); ValueError naming the key it cannot accept."""
    num_experts = raw.get("n_routed_experts", raw.get("num_local_experts", 8))
    top_k = raw.get("num_experts_per_tok", 2)
    n_group, topk_group = raw.get("n_group", 1), raw.get("topk_group", 1)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={num_experts}]")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide n_routed_experts={num_experts}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    per_group = num_experts // n_group
    if topk_group < n_group and per_group < 2:
        raise ValueError(f"n_group={n_group}: a group's score sums its 2 best experts, it holds {per_group}")
    if top_k > topk_group * per_group:
        raise ValueError(
            f"num_experts_per_tok={top_k} exceeds the {topk_group * per_group} experts of "
            f"topk_group={topk_group} groups"
        )
    return dict(
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size=raw.get("moe_intermediate_size", 7688),
        shared_expert_intermediate_size=raw.get("moe_shared_expert_intermediate_size", 7688),
        moe_latent_size=raw.get("moe_latent_size") or 0,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )


def parameter_name(name: str) -> str | None:
    """A MoE block's checkpoint name, prefix already stripped ("layers.1.mixer.gate.weight"),
    -> its parameter name; None for a name this module does not rename."""
    router = _ROUTER_TENSOR.match(name)
    if router is not None:
        leaf = "layer.weight" if router.group(2) == "weight" else "e_score_correction_bias"
        return f"{router.group(1)}.experts.router.{leaf}"
    fused = _FUSED_EXPERTS_TENSOR.match(name)
    if fused is not None:
        return f"{fused.group(1)}.{_STACKED[fused.group(2)]}"
    return None


def stacked_piece(checkpoint_name: str, config: HybridModelConfig) -> StackedPiece | None:
    """An expert's up_proj (I, L) is its slice of the stacked input_linear (E, I, L) along the
    rows, its down_proj (L, I) its slice of output_linear (E, L, I) along the columns. None for
    every other tensor."""
    match = _EXPERT_TENSOR.match(checkpoint_name)
    if match is None:
        return None
    experts, index, projection = match.group(1), int(match.group(2)), match.group(3)
    return StackedPiece(f"{experts}.{_STACKED[projection]}", index, dim=1 if projection == "up_proj" else 2, offset=0)


class NemotronHMoE(nn.Module):
    """experts (RoutedExperts, non-gated, on the latent width), shared_experts
    (SquaredReluMLP), fc1_latent_proj / fc2_latent_proj (nn.Linear, replicated) or None.

    forward / forward_gpu: (T, D) -> (T, D), all-reduced under tensor parallelism.
    """

    def __init__(
        self, config: HybridModelConfig, layout: RankShardLayout, tp: TensorParallel, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        D, latent = config.hidden_size, config.moe_latent_size or config.hidden_size
        routing = Routing(
            RoutingRule.SIGMOID_GROUPED_TOP_K, config.num_experts_per_tok, config.norm_topk_prob,
            num_groups=config.n_group, top_groups=config.topk_group,
            scaling=config.routed_scaling_factor, logits_in_fp32=True,
        )
        self.experts = RoutedExperts(
            D, config.intermediate_size, config.num_local_experts, routing, layout.expert_channels,
            tp, dtype, activation=ExpertActivation.RELU_SQUARED, input_size=latent,
        )
        self.shared_experts = SquaredReluMLP(
            D, config.shared_expert_intermediate_size, layout.shared_expert_channels, tp, dtype
        )
        self.fc1_latent_proj: nn.Linear | None = None
        self.fc2_latent_proj: nn.Linear | None = None
        if config.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(D, latent, bias=False, dtype=dtype)
            self.fc2_latent_proj = nn.Linear(latent, D, bias=False, dtype=dtype)

    def _latent(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, L)
        return x if self.fc1_latent_proj is None else linear(x, self.fc1_latent_proj.weight, None)

    def _from_latent(self, y: torch.Tensor) -> torch.Tensor:  # (T, L) -> (T, D)
        return y if self.fc2_latent_proj is None else linear(y, self.fc2_latent_proj.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        """The PyTorch path: the experts' reference loop, the shared expert's PyTorch ops."""
        expert_ids, weights = self.experts.select(x)
        routed = self._from_latent(self.experts.run_experts(self._latent(x), expert_ids, weights))
        return self.experts.tp.all_reduce(routed + self.shared_experts(x, reduce=False))

    def forward_gpu(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        """forward on CUDA: the experts' grouped GEMM, the shared expert's GPU path."""
        expert_ids, weights = self.experts.select(x)
        routed = self._from_latent(self.experts.run_experts_gpu(self._latent(x), expert_ids, weights))
        return self.experts.tp.all_reduce(routed + self.shared_experts.forward_gpu(x, reduce=False))
