"""The cache methods every model family shares: sizes of this rank's KV blocks and recurrent
state slots (engine/parallel/cache_capacity.py) and allocate_caches (engine/models/registry.py
HybridModel), written once for GraniteMoeHybrid (and Bamba, Falcon-H1), Nemotron-H and
Qwen3-Next.

A family's model class lists RankCaches among its bases; RankCaches reads the model's
`config` (HybridModelConfig), `layout` (RankShardLayout), `dtype` and `embed_tokens` (the
embedding, whose device allocate_caches defaults to). It defines no __init__ and holds no state.
"""

from __future__ import annotations

import torch

from engine.interfaces.forward_batch import ModelCaches
from engine.parallel import cache_capacity
from engine.parallel.shard_layout import width


class RankCaches:
    """Cache sizes and allocation of the rank the model is built for; every recurrent layer
    (Mamba2, gated delta-net, or the Mamba half of a HYBRID layer) owns a state slot, every
    attention layer (or attention half) a KV block row."""

    def kv_heads_per_rank(self) -> int:
        return width(self.layout.kv_heads)

    def recurrent_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """This rank's (conv slot, recurrent slot) shapes of one recurrent layer: ((C, K-1),
        (H, P, N)) for Mamba2, ((C, K-1), (Hv, dk, dv)) for a gated delta-net."""
        return cache_capacity.recurrent_state_shape(self.config, self.layout)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block of model-dtype K/V on this rank (engine/parallel/cache_capacity.py;
        FP8 blocks take kv_bytes_per_block with their own dtype)."""
        return cache_capacity.kv_bytes_per_block(self.config, self.layout, self.dtype, block_size)

    def state_bytes_per_slot(self) -> int:
        """Bytes of one recurrent state slot on this rank (engine/parallel/cache_capacity.py)."""
        return cache_capacity.state_bytes_per_slot(self.config, self.layout, self.dtype)

    def allocate_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, device=None,
        drafter_layers: tuple[int, ...] = (),
        kv_scale: torch.Tensor | None = None,
    ) -> ModelCaches:
        """Zeroed KV blocks and state slots of this rank (layouts in engine/interfaces/forward_batch.py;
        the KV heads, recurrent heads and conv channels are the rank's own), on `device`, or
        the embedding's device when None. One tensor per kind, stacked over its layers (K/V
        in the model dtype or FP8, conv state in the model dtype, recurrent state fp32); each
        layer's cache is a view of it. Layers without a mixer cache (MLP blocks) get none.
        drafter_layers: layer indices past the model's own whose KV the blocks also hold, after
        the attention layers' (the MTP drafter's layer, engine/parallel/cache_capacity.py
        drafter_kv_layers), so checkpoints and transfers carry it with the rest.
        kv_scale: (2, L_attention + drafter layers, Hkv of this rank) fp32 for FP8 blocks
        (KvCacheFormat.rank_scales): the K/V are then float8_e4m3fn and ModelCaches.kv_scale
        holds each layer's (2, Hkv) view of it, on `device`; None: K/V in the model dtype."""
        c = self.config
        if device is None:
            device = self.embed_tokens.weight.device
        kv_shape = (num_blocks, block_size, self.kv_heads_per_rank(), c.head_dim)
        conv_slot, state_slot = self.recurrent_state_shape()
        attention, recurrent = [*c.attention_layers, *drafter_layers], c.recurrent_layers
        kv_dtype = self.dtype if kv_scale is None else torch.float8_e4m3fn
        kv = torch.zeros((2, len(attention), *kv_shape), dtype=kv_dtype, device=device)
        if kv_scale is not None:
            if tuple(kv_scale.shape) != (2, len(attention), kv_shape[2]):
                raise ValueError(f"kv_scale {tuple(kv_scale.shape)}: the caches need "
                                 f"(2, {len(attention)}, {kv_shape[2]}) (K/V, attention layers, KV heads)")
            kv_scale = kv_scale.to(device=device, dtype=torch.float32).contiguous()
        conv = torch.zeros((len(recurrent), num_state_slots, *conv_slot), dtype=self.dtype, device=device)
        state = torch.zeros((len(recurrent), num_state_slots, *state_slot), dtype=torch.float32, device=device)
        return ModelCaches(
            block_size=block_size,
            key_cache={layer: kv[0, j] for j, layer in enumerate(attention)},
            value_cache={layer: kv[1, j] for j, layer in enumerate(attention)},
            conv_state={layer: conv[j] for j, layer in enumerate(recurrent)},
            ssm_state={layer: state[j] for j, layer in enumerate(recurrent)},
            conv_stack=conv,
            ssm_stack=state,
            kv_stack=kv,
            kv_scale={} if kv_scale is None else {layer: kv_scale[:, j] for j, layer in enumerate(attention)},
        )
