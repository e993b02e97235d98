"""Paged attention on the GPU: a Triton decode kernel (one query per sequence over its block
table) and, for prefill chunks, torch SDPA over the chunk's gathered K/V blocks.

GPU counterparts of engine/kernels/attention_reference.py:paged_attention. KV layout as there:
(num_blocks, block_size, Hkv, D); query head h reads KV head h // (H / Hkv). The decode kernel
gives each program one (sequence, KV head) pair and all the query heads that share it, so each
K/V byte is read once per step; softmax is online, in fp32.

Shapes: T tokens, H heads, Hkv KV heads, D head dim, Bd decode sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr, stride_qt, stride_qh,  # (T, H, D), unit D stride
    k_ptr, v_ptr, stride_kb, stride_ko, stride_kh,  # (blocks, block_size, Hkv, D), K and V alike
    out_ptr, stride_ot, stride_oh,  # (T, H, D)
    rows_ptr, seq_lens_ptr, table_ptr, stride_table,  # (Bd,), (Bd,), (Bd, max_blocks)
    scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i, kv_head = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + i)
    seq_len = tl.load(seq_lens_ptr + i)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # (BLOCK_G, D)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        t_mask = tok < seq_len
        block = tl.load(table_ptr + i * stride_table + tok // KV_BLOCK, mask=t_mask, other=0)
        offsets = block * stride_kb + (tok % KV_BLOCK) * stride_ko + kv_head * stride_kh
        k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_G, BLOCK_N) fp32
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def paged_attention_decode(
    query: torch.Tensor,  # (T, H, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    out: torch.Tensor,  # (T, H, D), rows written
    rows: torch.Tensor,  # (Bd,) int, token row of each sequence's one query
    seq_lens: torch.Tensor,  # (Bd,) int >= 1, keys each query attends to (its own included)
    block_table: torch.Tensor,  # (Bd, max_blocks) int
    scale: float,
) -> None:
    """For each i: out[rows[i]] = attention of query[rows[i]] over the first seq_lens[i] keys of
    its blocks (K/V already written). Equal to paged_attention with n = 1 within bf16 rounding."""
    num_decode = rows.shape[0]
    if num_decode == 0:
        return
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    assert query.stride(2) == 1 and out.stride(2) == 1 and head_dim == triton.next_power_of_2(head_dim)
    group = num_heads // num_kv_heads
    _decode_kernel[(num_decode, num_kv_heads)](
        query, query.stride(0), query.stride(1),
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        out, out.stride(0), out.stride(1),
        rows, seq_lens, block_table, block_table.stride(0),
        scale,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        KV_BLOCK=block_size, BLOCK_N=64,
    )


def paged_attention_prefill(
    query: torch.Tensor,  # (n, H, D), positions start_position .. start_position + n - 1
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    block_table: torch.Tensor,  # (>= ceil((start_position + n) / block_size),) int64
    start_position: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one prefill chunk over its sequence's cached and new keys, by
    gathering the blocks and calling SDPA (flash kernels from position 0; an explicit lower-right mask after cached keys). Returns
    (n, H, D). A first version: it copies the chunk's K/V once; a paged prefill kernel would not."""
    num_queries, _, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_keys = start_position + num_queries
    blocks = block_table[: -(-num_keys // block_size)]
    keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:num_keys]  # (S, Hkv, D)
    values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:num_keys]
    q, k, v = (t.transpose(0, 1)[None] for t in (query, keys, values))  # (1, heads, len, D)
    if start_position == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # queries sit at the end of the keys: an explicit lower-right mask, KV heads expanded
        group = query.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        positions = torch.arange(num_keys, device=query.device)
        mask = positions[None, :] <= positions[start_position:, None]  # (n, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # (n, H, D)
