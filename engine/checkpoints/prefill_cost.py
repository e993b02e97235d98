"""What a prefill costs, from the model's shapes: the compute a checkpoint saves, which the
value eviction order divides by the bytes it holds (cache/eviction.py).

An estimate of the matrix work, 2 FLOPs per multiply-add, for the whole model (every rank
together; the order only compares checkpoints of one model):

    per token   every layer's projections (attention q, k, v, o and its output gate; Mamba2's
                in_proj, conv and out_proj; the gated delta-net's projections and conv), its
                MLP (dense, or the routed experts a token goes to plus the shared expert), and
                the recurrent update of each state (about 6 FLOPs per state element)
    per pair    each attention layer's scores and weighted sum over the causal (query, key)
                pairs: 4 * heads * head_dim per pair

Norms, activations, the embedding and the LM head are left out. Families whose blocks are one
mixer each (Nemotron-H: MLP and MoE blocks of their own) get an MLP only in those blocks; the
others an MLP after every layer.
"""

from __future__ import annotations

from cache.eviction import PrefillCost
from engine.model_config import ATTENTION, GATED_DELTA_NET, HYBRID, MAMBA, MLP, MOE, HybridModelConfig


def prefill_cost(config: HybridModelConfig) -> PrefillCost:
    """The PrefillCost of `config`'s model (see the module doc)."""
    separate_mlps = any(kind in (MLP, MOE) for kind in config.layer_types)
    per_token = 0.0
    per_pair = 0.0
    for layer, kind in enumerate(config.layer_types):
        if kind in (ATTENTION, HYBRID):
            per_token += _attention_projections(config)
            per_pair += 4 * config.num_attention_heads * config.head_dim
        if kind in (MAMBA, HYBRID):
            per_token += _mamba(config)
        if kind == GATED_DELTA_NET:
            per_token += _gated_delta_net(config)
        if kind in (MLP, MOE) or not separate_mlps:
            per_token += _mlp(config, layer, routed=kind == MOE or (not separate_mlps and config.has_routed_experts(layer)))
    return PrefillCost(flops_per_token=per_token, flops_per_token_pair=per_pair)


def _attention_projections(config: HybridModelConfig) -> float:
    d = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    gate = q if config.attention_output_gate else 0
    return 2 * d * (q + gate + 2 * kv) + 2 * q * d


def _mamba(config: HybridModelConfig) -> float:
    d, inner = config.hidden_size, config.mamba_intermediate_size
    groups_state = config.mamba_n_groups * config.mamba_d_state
    in_proj = 2 * d * (2 * inner + 2 * groups_state + config.mamba_n_heads)
    conv = 2 * config.mamba_conv_dim * config.mamba_d_conv
    update = 6 * config.mamba_n_heads * config.mamba_d_head * config.mamba_d_state
    return in_proj + conv + update + 2 * inner * d


def _gated_delta_net(config: HybridModelConfig) -> float:
    d, key, value = config.hidden_size, config.linear_key_dim, config.linear_value_dim
    heads = config.linear_num_value_heads
    projections = 2 * d * (2 * key + 2 * value + 2 * heads) + 2 * value * d
    conv = 2 * (2 * key + value) * config.linear_conv_kernel_dim
    update = 6 * heads * config.linear_key_head_dim * config.linear_value_head_dim
    return projections + conv + update


def _mlp(config: HybridModelConfig, layer: int, routed: bool) -> float:
    """A gated MLP of width I costs 6 * D * I a token: the shared or dense MLP, plus the
    experts a token is routed to when the layer has them."""
    d = config.hidden_size
    if routed:
        shared = config.shared_intermediate_size or config.shared_expert_intermediate_size
        return 6 * d * (config.num_experts_per_tok * config.intermediate_size + shared)
    width = (config.dense_intermediate_size if layer in config.dense_mlp_layers and config.dense_intermediate_size
             else config.shared_intermediate_size or config.intermediate_size)
    return 6 * d * width
