"""Prefill attention on the CPU through torch's fused scaled_dot_product_attention.

attention_reference.paged_attention builds every chunk's full (H, n, S) score matrix, masks it
and softmaxes it: the reference the kernels are held to, and the whole CPU prefill once. On a
2,000-token prompt half of the step went there (two attention layers of the embedded model,
0.38 s of 0.73 s on one thread). paged_attention_sdpa gathers the same keys and values and
hands them to torch's fused kernel (flash-style on the CPU: tiled, no score matrix), with the
causal rule as a boolean mask when the chunk starts after its first key (a restored or chunked
prefill: query j at position start + j sees keys first_key .. start + j) and as is_causal when
it does not. Same contract as paged_attention for caches in the model dtype (not FP8, which
runs on CUDA only); equal to it within the dtype's rounding (tests/numerics/test_cpu_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention_reference import select_rows


def paged_attention_sdpa(
    query: torch.Tensor,  # (n, H, D), the tokens at positions start_position .. start_position+n-1
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), the model dtype
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # (>= ceil((start_position + n) / block_size),) int64
    start_position: int,
    scale: float,
    first_key: int = 0,
) -> torch.Tensor:
    """Causal attention of n new queries over the keys first_key .. start_position + n - 1 of
    their sequence, whose K/V are already written. Returns (n, H, D)."""
    num_queries, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_keys = start_position + num_queries
    blocks = block_table[: -(-num_keys // block_size)]
    keys = select_rows(key_cache, blocks).reshape(-1, num_kv_heads, head_dim)[first_key:num_keys]
    values = select_rows(value_cache, blocks).reshape(-1, num_kv_heads, head_dim)[first_key:num_keys]
    group = num_heads // num_kv_heads
    # (1, H, n, D): torch's fused CPU kernel takes batched 4-D inputs only (3-D ones fall back
    # to the unfused math path, 8x slower at 2,000 tokens)
    q = query.transpose(0, 1)[None]
    k = keys.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # (1, H, S, D)
    v = values.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    if start_position == first_key:  # the chunk's first query is the first key: plain causal
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        query_positions = torch.arange(start_position, num_keys, device=query.device)
        key_positions = torch.arange(first_key, num_keys, device=query.device)
        visible = key_positions[None, :] <= query_positions[:, None]  # (n, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1)  # (n, H, D)
