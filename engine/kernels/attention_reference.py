"""Paged causal attention in pure PyTorch: K/V live in fixed-size blocks addressed by a table.

key_cache / value_cache: (num_blocks, block_size, num_kv_heads, head_dim). A token at position p
of a sequence lives at block_table[p // block_size], offset p % block_size; its flat slot is
block * block_size + offset. Query head h reads KV head h // (num_heads / num_kv_heads) (GQA).

FP8 blocks (EngineConfig.kv_cache_dtype fp8_e4m3, docs/design.md "KV cache"): the caches hold
torch.float8_e4m3fn and a kv_scale (2, Hkv) fp32, the key [0] and value [1] scale of each KV
head of the layer. A token's K/V are stored as quantize_kv(x, scale) and read as
dequantize_kv(stored, scale, query dtype); the GPU kernels (engine/kernels/gpu/paged_attention.py)
do the same arithmetic, so every reader sees the same values.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max; the format has no infinity


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., Hkv, D) as FP8 E4M3: x / scale of its KV head (scale (Hkv,) fp32), divided in
    fp32 (correctly rounded), clamped to +-FP8_E4M3_MAX (a value past the format's range
    saturates; NaN stays NaN) and rounded to the nearest float8_e4m3fn, ties to even."""
    scaled = x.float() / scale[:, None]
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 K or V (..., Hkv, D) back to `dtype`: stored * scale of its KV head (scale (Hkv,)
    fp32), multiplied in fp32, then rounded to `dtype` (nearest, ties to even)."""
    return (stored.float() * scale[:, None]).to(dtype)


def write_kv(
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), written in place
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), written in place
    slot_mapping: torch.Tensor,  # (T,) int64 flat slots
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    kv_scale: torch.Tensor | None = None,  # (2, Hkv) fp32 with FP8 caches, else None
) -> None:
    """Store each token's K/V at its slot: cast to the cache dtype, or with kv_scale
    quantized (quantize_kv with the key scale kv_scale[0] and the value scale kv_scale[1])."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    if kv_scale is not None:
        key, value = quantize_kv(key, kv_scale[0]), quantize_kv(value, kv_scale[1])
    for cache, new in ((key_cache, key), (value_cache, value)):
        new = new.to(cache.dtype)
        storage_view(cache).view(flat_shape).index_copy_(0, slot_mapping, storage_view(new))


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """t itself, or for FP8 the same bytes viewed as uint8 (same shape): copies and gathers of
    FP8 caches go through it, since torch's indexing ops do not all take float8 dtypes
    (index_copy_ and equal on the CPU do not)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def select_rows(t: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """t.index_select(dim, index), FP8 included (a copy in t's dtype; index on any device)."""
    return storage_view(t).index_select(dim, index.to(t.device)).view(t.dtype)


def paged_attention(
    query: torch.Tensor,  # (n, H, D), the tokens at positions start_position .. start_position+n-1
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_table: torch.Tensor,  # (>= ceil((start_position + n) / block_size),) int64
    start_position: int,
    scale: float,
    first_key: int = 0,
    kv_scale: torch.Tensor | None = None,  # (2, Hkv) fp32 with FP8 caches, else None
) -> torch.Tensor:
    """Causal attention of n new queries over the sequence's keys first_key .. start_position
    + n - 1 (first_key 1: the MTP layer, whose position 0 holds no key; engine/speculative/mtp.py).

    The new tokens' K/V must already be written. With kv_scale the keys and values read are
    dequantized to the query dtype first (dequantize_kv). Scores are computed in the query
    dtype and the softmax in fp32 (as transformers' eager attention does). Returns (n, H, D).
    """
    num_queries, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_keys = start_position + num_queries
    blocks = block_table[: -(-num_keys // block_size)]
    keys = select_rows(key_cache, blocks).reshape(-1, num_kv_heads, head_dim)[first_key:num_keys]  # (S, Hkv, D)
    values = select_rows(value_cache, blocks).reshape(-1, num_kv_heads, head_dim)[first_key:num_keys]
    if kv_scale is not None:
        keys = dequantize_kv(keys, kv_scale[0], query.dtype)
        values = dequantize_kv(values, kv_scale[1], query.dtype)
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


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D): the one new token of each of B sequences
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), contiguous
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), contiguous
    key_rows: torch.Tensor,  # (B * Hkv * S,) int64: DecodeKeys.rows
    padding: torch.Tensor,  # (B, 1, 1, S) bool: DecodeKeys.padding
    scale: float,
    current: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """paged_attention of B one-token chunks (first_key 0) in one batched pass: query b attends
    to its sequence's keys, which key_rows lists per KV head (engine/interfaces/decode_rows.py
    DecodeKeys: rows of the cache viewed as (num_blocks * block_size * Hkv, D), so the gathered
    keys come out as (B, Hkv, S, D), the layout both products take without a copy); the
    padding past a sequence's keys is masked out before the softmax, so it adds exactly
    nothing. Same dtypes as paged_attention. Returns (B, H, D).

    current: (key (B, Hkv, D), value, last (B,) int64) when the caches do not hold the new
    tokens' K/V yet (a pass whose cache writes are deferred, DecodeKeys.last): they are read in
    place of the cache at each sequence's last position, what write_kv would have stored."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    width = padding.shape[-1]
    keys = key_cache.view(-1, head_dim).index_select(0, key_rows).view(batch, num_kv_heads, width, head_dim)
    values = value_cache.view(-1, head_dim).index_select(0, key_rows).view(batch, num_kv_heads, width, head_dim)
    if current is not None:
        key, value, last = current
        sequences = torch.arange(batch, device=query.device)
        keys[sequences, :, last] = key.to(keys.dtype)
        values[sequences, :, last] = value.to(values.dtype)
    grouped = query.reshape(batch, num_kv_heads, group, head_dim)  # query head h reads KV head h // group
    scores = torch.matmul(grouped, keys.transpose(2, 3)).mul_(scale)  # (B, Hkv, G, S)
    scores.masked_fill_(padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)
