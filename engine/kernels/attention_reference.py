"""Paged causal attention in pure PyTorch: K/V live in fixed-size blocks addressed by a table.

key_cache / value_cache: (num_blocks, block_size, num_kv_heads, head_dim). A token at position p
of a sequence lives at block_table[p // block_size], offset p % block_size; its flat slot is
block * block_size + offset. Query head h reads KV head h // (num_heads / num_kv_heads) (GQA).
"""

from __future__ import annotations

import torch


def write_kv(
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), written in place
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), written in place
    slot_mapping: torch.Tensor,  # (T,) int64 flat slots
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
) -> None:
    """Store each token's K/V at its slot."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    key_cache.view(flat_shape).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(flat_shape).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,  # (n, H, D), the tokens at positions start_position .. start_position+n-1
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_table: torch.Tensor,  # (>= ceil((start_position + n) / block_size),) int64
    start_position: int,
    scale: float,
    first_key: int = 0,
) -> torch.Tensor:
    """Causal attention of n new queries over the sequence's keys first_key .. start_position
    + n - 1 (first_key 1: the MTP layer, whose position 0 holds no key; engine/speculative/mtp.py).

    The new tokens' K/V must already be written. Scores are computed in the query dtype and the
    softmax in fp32 (as transformers' eager attention does). Returns (n, H, D).
    """
    num_queries, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_keys = start_position + num_queries
    blocks = block_table[: -(-num_keys // block_size)]
    keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[first_key:num_keys]  # (S, Hkv, D)
    values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[first_key:num_keys]  # (S, Hkv, D)
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)  # (S, H, D)
    values = values.repeat_interleave(group, dim=1)  # (S, H, D)

    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale  # (H, n, S)
    query_positions = torch.arange(start_position, num_keys, device=query.device)
    key_positions = torch.arange(first_key, num_keys, device=query.device)
    future = key_positions[None, :] > query_positions[:, None]  # (n, S)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.einsum("hqk,khd->qhd", probs, values)  # (n, H, D)


def decode_key_slots(block_tables: list[tuple[int, ...]], num_keys: list[int], block_size: int) -> torch.Tensor:
    """(B, S) int64, S = max(num_keys): the flat cache slot of key position s of sequence b
    (block_tables[b][s // block_size] * block_size + s % block_size) for s < num_keys[b], and
    slot 0 past it (a padding read, masked by paged_decode_attention)."""
    width = max(num_keys)
    num_blocks = -(-width // block_size)
    tables = torch.zeros(len(block_tables), num_blocks, dtype=torch.int64)
    for b, (table, keys) in enumerate(zip(block_tables, num_keys, strict=True)):
        used = -(-keys // block_size)
        tables[b, :used] = torch.tensor(table[:used], dtype=torch.int64)
    positions = torch.arange(width)
    slots = tables[:, positions // block_size] * block_size + positions % block_size  # (B, S)
    return slots.masked_fill(positions[None, :] >= torch.tensor(num_keys)[:, None], 0)


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D): the one new token of each of B sequences
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    key_slots: torch.Tensor,  # (B, S) int64: decode_key_slots
    num_keys: torch.Tensor,  # (B,) int64: keys of each sequence, its new token's included
    scale: float,
) -> torch.Tensor:
    """paged_attention of B one-token chunks (first_key 0) in one batched pass: query b attends
    to the first num_keys[b] keys of its sequence; the padding past them is masked out before
    the softmax, so it adds exactly nothing. Same dtypes as paged_attention. Returns (B, H, D)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    flat = (-1, num_kv_heads, head_dim)
    keys = key_cache.view(flat)[key_slots]  # (B, S, Hkv, D)
    values = value_cache.view(flat)[key_slots]  # (B, S, Hkv, D)
    grouped = query.view(batch, num_kv_heads, group, head_dim)  # query head h reads KV head h // group
    scores = torch.einsum("bkgd,bskd->bkgs", grouped, keys) * scale  # (B, Hkv, G, S)
    padding = torch.arange(key_slots.shape[1], device=key_slots.device) >= num_keys[:, None]  # (B, S)
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.einsum("bkgs,bskd->bkgd", probs, values).reshape(batch, num_heads, head_dim)
