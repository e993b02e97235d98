"""Which heads, groups and channels of a GraniteMoeHybrid model one tensor-parallel rank holds.

Splitting rules (docs/design.md section 6):
- attention query heads split evenly; KV heads split evenly when they divide by world_size,
  otherwise (fewer KV heads than ranks) each rank holds the one KV head its query heads read;
- Mamba2 heads split evenly (their x, z, dt, conv channels, A_log, D, dt_bias, norm channels);
  B/C groups split evenly when n_groups divides by world_size, otherwise each rank holds the
  one group its heads read (replicated across the ranks sharing it);
- gated delta-net key heads split evenly, and value heads with them (each key head's value
  heads are consecutive, so a rank holds whole key-head groups of q, k, v, z, b and a);
- MLP intermediate channels split evenly, and so are each routed expert's (every rank holds
  every expert, a slice of its channels; the router is replicated) and those of the dense MLPs
  of a model with experts (dense_mlp_layers); vocabulary rows split in
  pieces of ceil(vocab / world_size) (the last rank's piece may be shorter); a MoE block's
  shared expert (Nemotron-H) splits its channels evenly too.
Anything else (e.g. 6 query heads on 4 ranks) is a ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import GATED_DELTA_NET, HybridModelConfig
from engine.parallel.tensor_parallel import IndexRange, TensorParallel, covering_range


def width(index_range: IndexRange) -> int:
    return index_range[1] - index_range[0]


@dataclass(frozen=True)
class RankShardLayout:
    """One rank's ranges, in units of the full model (heads, groups, channels, vocab rows)."""

    attention_heads: IndexRange
    kv_heads: IndexRange
    mamba_heads: IndexRange
    mamba_groups: IndexRange
    mlp_channels: IndexRange
    vocab_rows: IndexRange
    vocab_rows_per_rank: int  # ceil(vocab / world_size): every rank's logits are padded to it
    linear_key_heads: IndexRange = (0, 0)  # gated delta-net key heads
    linear_value_heads: IndexRange = (0, 0)  # gated delta-net value heads (those of its key heads)
    expert_channels: IndexRange = (0, 0)  # each routed expert's intermediate channels
    dense_mlp_channels: IndexRange = (0, 0)  # the dense MLPs' channels in a model with experts
    shared_expert_channels: IndexRange = (0, 0)  # a MoE block's shared expert's channels


def rank_shard_layout(config: HybridModelConfig, tp: TensorParallel) -> RankShardLayout:
    """The ranges rank tp.rank holds; ValueError if the model cannot be split tp.world_size ways."""
    world = tp.world_size
    attention_heads = kv_heads = (0, 0)
    if config.attention_layers:
        attention_heads = tp.split_evenly(config.num_attention_heads, "num_attention_heads")
        kv_heads = _split_or_cover(
            tp, attention_heads, config.num_key_value_heads, config.num_attention_heads,
            "num_key_value_heads",
        )
    mamba_heads = mamba_groups = (0, 0)
    if config.mamba_layers:
        mamba_heads = tp.split_evenly(config.mamba_n_heads, "mamba_n_heads")
        mamba_groups = _split_or_cover(
            tp, mamba_heads, config.mamba_n_groups, config.mamba_n_heads, "mamba_n_groups"
        )
    linear_key_heads = linear_value_heads = (0, 0)
    if GATED_DELTA_NET in config.layer_types:
        linear_key_heads = tp.split_evenly(config.linear_num_key_heads, "linear_num_key_heads")
        linear_value_heads = tp.split_evenly(config.linear_num_value_heads, "linear_num_value_heads")
    return RankShardLayout(
        linear_key_heads=linear_key_heads,
        linear_value_heads=linear_value_heads,
        attention_heads=attention_heads,
        kv_heads=kv_heads,
        mamba_heads=mamba_heads,
        mamba_groups=mamba_groups,
        mlp_channels=tp.split_evenly(config.shared_intermediate_size, "shared_intermediate_size"),
        vocab_rows=tp.split_padded(config.vocab_size),
        vocab_rows_per_rank=-(-config.vocab_size // world),
        expert_channels=(
            tp.split_evenly(config.intermediate_size, "intermediate_size")
            if config.num_local_experts > 0 else (0, 0)
        ),
        dense_mlp_channels=(
            tp.split_evenly(config.dense_intermediate_size, "dense_intermediate_size")
            if config.dense_mlp_layers else (0, 0)
        ),
        shared_expert_channels=(
            tp.split_evenly(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
            if config.shared_expert_intermediate_size > 0 else (0, 0)
        ),
    )


def _split_or_cover(
    tp: TensorParallel, users: IndexRange, num_owners: int, num_users: int, what: str
) -> IndexRange:
    """Owners (KV heads, groups) split evenly, or the one owner this rank's users need."""
    if num_owners % tp.world_size == 0:
        return tp.split_evenly(num_owners, what)
    if tp.world_size % num_owners != 0:
        raise ValueError(
            f"{what}={num_owners} neither divides by nor divides "
            f"tensor_parallel_size={tp.world_size}"
        )
    return covering_range(users, num_users // num_owners)
