"""How many KV blocks and recurrent state slots one rank's byte budgets hold.

Computed from the model's configuration, the rank's shard layout and, for budgets that come
from memory_utilization, the rank's free memory (engine/parallel/memory_budget.py), without
loading weights: the worker sizes its caches with `size_caches`, and `check_cache_budgets`
runs the same computation for every rank when the application is built, so a configuration
the worker would refuse (max_model_len beyond the model's context, a budget that cannot hold
one request) fails `build_app` naming the key, before any replica starts. Budgets from memory
are checked where the memory is known: when the worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.cache_manager import BundleSizing
from engine.engine_config import EngineConfig
from engine.parallel.kv_cache_format import kv_cache_format, kv_storage_dtype
from engine.parallel.memory_budget import FreeMemory, cache_budgets, needs_free_memory
from engine.model_config import GATED_DELTA_NET, HybridModelConfig
from engine.parallel.shard_layout import RankShardLayout, rank_shard_layout, width
from engine.parallel.tensor_parallel import TensorParallel


class CacheBudgetError(ValueError):
    """The configured memory budgets cannot hold what the configuration asks for."""


@dataclass(frozen=True)
class CacheCapacity:
    """What the worker allocated; the scheduler's pools are sized from it."""

    num_blocks: int
    num_state_slots: int
    block_size: int
    max_model_len: int
    bundle_sizing: BundleSizing
    checkpoint_bytes: int = 0  # the checkpoint budget (checkpoint_cache_bytes, or from memory)
    host_checkpoint_bytes: int = 0  # the host tier's budget (0: off)
    world_size: int = 1  # tensor-parallel ranks that must confirm each capture
    # The worker can capture at a position inside a prefill chunk during its forward pass
    # (CaptureOp.in_pass): the CUDA path of a single rank.
    in_pass_capture: bool = False


def mamba_state_shape(
    config: HybridModelConfig, layout: RankShardLayout,
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The rank's ((conv_dim, K-1), (H, P, N)) of one state slot of one Mamba layer."""
    heads, groups = width(layout.mamba_heads), width(layout.mamba_groups)
    conv_dim = heads * config.mamba_d_head + 2 * groups * config.mamba_d_state
    return (conv_dim, config.mamba_d_conv - 1), (heads, config.mamba_d_head, config.mamba_d_state)


def gated_delta_net_state_shape(
    config: HybridModelConfig, layout: RankShardLayout,
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The rank's ((conv_dim, K-1), (H_v, d_k, d_v)) of one state slot of one gated delta-net
    layer: the conv window over its q, k (key heads) and v (value heads) channels, and one
    d_k x d_v recurrent matrix per value head (fp32)."""
    key_heads, value_heads = width(layout.linear_key_heads), width(layout.linear_value_heads)
    d_k, d_v = config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * key_heads * d_k + value_heads * d_v
    return (conv_dim, config.linear_conv_kernel_dim - 1), (value_heads, d_k, d_v)


def recurrent_state_shape(
    config: HybridModelConfig, layout: RankShardLayout,
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The rank's (conv slot, recurrent slot) shapes of one recurrent layer, whatever its mixer:
    the two tensors of a state slot (ModelCaches.conv_state / ssm_state) hold either kind, so
    checkpoints, import checks and transfer move them unchanged. A model without recurrent
    layers gets empty shapes (no layer holds them, and its config may not size a mixer: an
    attention-only Qwen3-Next's Mamba fields are unset)."""
    if not config.recurrent_layers:
        return (0, 0), (0, 0, 0)
    if config.recurrent_kind == GATED_DELTA_NET:
        return gated_delta_net_state_shape(config, layout)
    return mamba_state_shape(config, layout)


def kv_bytes_per_block(
    config: HybridModelConfig, layout: RankShardLayout, dtype: torch.dtype, block_size: int,
    num_drafter_layers: int = 0,
) -> int:
    """Bytes of one KV block on the rank across all attention layers and num_drafter_layers
    more (drafter_kv_layers) (K and V of the rank's KV heads, in `dtype`: the blocks' storage
    dtype, kv_storage_dtype; FP8 takes half of bf16)."""
    per_layer = 2 * block_size * width(layout.kv_heads) * config.head_dim * dtype.itemsize
    return (len(config.attention_layers) + num_drafter_layers) * per_layer


def drafter_kv_layers(config: EngineConfig, model_config: HybridModelConfig) -> tuple[int, ...]:
    """The layers past the model's own whose KV the caches hold: the MTP drafter's one layer,
    numbered num_hidden_layers (engine/speculative/mtp.py), when speculative decoding drafts
    with mtp; none otherwise (also with num_speculative_tokens unset: the engine and the
    workers size their caches from the config the speculation policy resolved)."""
    drafts_by_mtp = (config.num_speculative_tokens or 0) > 0 and config.speculative_drafter == "mtp"
    return (model_config.num_hidden_layers,) if drafts_by_mtp else ()


def state_bytes_per_slot(config: HybridModelConfig, layout: RankShardLayout, dtype: torch.dtype) -> int:
    """Bytes of one recurrent state slot on the rank across all recurrent layers (the rank's
    conv channels in model dtype, its heads' recurrent state in fp32)."""
    (conv_dim, taps), (heads, head_dim, state_size) = recurrent_state_shape(config, layout)
    conv = conv_dim * taps * dtype.itemsize
    ssm = heads * head_dim * state_size * torch.float32.itemsize
    return len(config.recurrent_layers) * (conv + ssm)


def size_caches(config: EngineConfig, model_config: HybridModelConfig, tp: TensorParallel,
                memory: FreeMemory | None = None) -> CacheCapacity:
    """Blocks and state slots of rank tp.rank from the byte budgets (engine/parallel/
    memory_budget.py; `memory`, the rank's free memory, is needed only when a budget comes from
    memory_utilization). Raises CacheBudgetError naming the key when max_model_len exceeds the
    model's context, the KV budget cannot hold one request of max_model_len tokens, or the
    state budget not one state slot; ValueError when the model cannot be split tp.world_size
    ways."""
    layout = rank_shard_layout(model_config, tp)
    dtype = getattr(torch, config.dtype)
    max_model_len = _max_model_len(config, model_config)
    block_bytes = kv_bytes_per_block(
        model_config, layout, kv_storage_dtype(config), config.block_size,
        len(drafter_kv_layers(config, model_config)))
    slot_bytes = state_bytes_per_slot(model_config, layout, dtype)
    budgets = cache_budgets(config, slot_bytes, memory)
    num_blocks = budgets.kv_bytes // block_bytes
    # a model without recurrent layers holds nothing in a slot: one a sequence, for free
    num_slots = min(config.max_num_seqs, budgets.state_bytes // slot_bytes) if slot_bytes else config.max_num_seqs
    if num_blocks * config.block_size < max_model_len:
        raise CacheBudgetError(
            f"{_named('kv_cache_bytes', budgets.kv_bytes, budgets, config)} holds {num_blocks} blocks of "
            f"{config.block_size} tokens, fewer than max_model_len={max_model_len}; "
            f"raise {_knob('kv_cache_bytes', budgets)} or lower max_model_len"
        )
    if num_slots < 1:
        raise CacheBudgetError(
            f"{_named('state_cache_bytes', budgets.state_bytes, budgets, config)} cannot hold one "
            f"recurrent state slot ({slot_bytes} bytes); raise {_knob('state_cache_bytes', budgets)}"
        )
    return CacheCapacity(
        num_blocks=num_blocks,
        num_state_slots=num_slots,
        block_size=config.block_size,
        max_model_len=max_model_len,
        checkpoint_bytes=budgets.checkpoint_bytes,
        host_checkpoint_bytes=budgets.host_checkpoint_bytes,
        world_size=tp.world_size,
        in_pass_capture=config.device.startswith("cuda") and tp.world_size == 1,
        bundle_sizing=BundleSizing(
            state_bytes=slot_bytes,
            kv_bytes_per_token=block_bytes // config.block_size,
            hidden_row_bytes=model_config.hidden_size * dtype.itemsize,
        ),
    )


def check_cache_budgets(config: EngineConfig, model_config: HybridModelConfig) -> None:
    """size_caches for every rank of config, for the model config.model_dir holds (its parsed
    config.json): raises what the workers would raise when they start, a bad KV scales file
    included (engine/parallel/kv_cache_format.py). With budgets from memory, only
    max_model_len and the KV format are checked here (the memory is the worker's)."""
    kv_cache_format(config, model_config, drafter_kv_layers(config, model_config))
    if needs_free_memory(config):
        _max_model_len(config, model_config)
        return
    for rank in range(config.tensor_parallel_size):
        size_caches(config, model_config, TensorParallel(rank, config.tensor_parallel_size))


def _max_model_len(config: EngineConfig, model_config: HybridModelConfig) -> int:
    """config.max_model_len, else the model's context; CacheBudgetError beyond the latter."""
    model_max_len = model_config.max_position_embeddings
    max_model_len = config.max_model_len or model_max_len
    if max_model_len > model_max_len:
        raise CacheBudgetError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{model_max_len}; lower max_model_len (or leave it unset for the model's own)"
        )
    return max_model_len


def _named(key: str, value: int, budgets, config: EngineConfig) -> str:
    """How an error names a budget: `key=value`, or what memory_utilization gave it."""
    if key in budgets.from_memory:
        return f"{key} from memory_utilization={config.memory_utilization} ({value} bytes)"
    return f"{key}={value}"


def _knob(key: str, budgets) -> str:
    return f"memory_utilization or set {key}" if key in budgets.from_memory else key
