"""engine/kernels/cpu_attention.py against the reference it replaces on the CPU
(attention_reference.paged_attention): a chunk from the start of its sequence (is_causal), a
chunk after cached keys (the boolean mask), the MTP layer's first_key 1, grouped KV heads,
fp32 and bf16; and the fused path changes nothing past rounding."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention_reference import paged_attention, write_kv
from engine.kernels.cpu_attention import paged_attention_sdpa


def filled_cache(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block_size: int = 16, seed: int = 0):
    """Caches holding num_tokens random K/V in shuffled blocks, and the block table."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    table = torch.randperm(num_blocks, generator=generator)[: -(-num_tokens // block_size)]
    positions = torch.arange(num_tokens)
    slots = table[positions // block_size] * block_size + positions % block_size
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    write_kv(key_cache, value_cache, slots, keys, values)
    return key_cache, value_cache, table


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("start, length, first_key", [(0, 37, 0), (0, 1, 0), (40, 25, 0), (96, 1, 0),
                                                      (1, 30, 1), (20, 12, 1)])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4)])
def test_sdpa_prefill_equals_the_reference(dtype, rtol, start, length, first_key, num_heads, num_kv_heads):
    head_dim = 32
    key_cache, value_cache, table = filled_cache(start + length, num_kv_heads, head_dim, dtype)
    query = torch.randn(length, num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = head_dim ** -0.5
    want = paged_attention(query, key_cache, value_cache, table, start, scale, first_key=first_key)
    got = paged_attention_sdpa(query, key_cache, value_cache, table, start, scale, first_key=first_key)
    assert got.shape == want.shape == (length, num_heads, head_dim) and got.dtype == dtype
    error = float((got.float() - want.float()).norm() / want.float().norm())
    assert error <= rtol, f"relative error {error:.2e}"
    # a query sees no key past its own position: changing a later key changes nothing before it
    if length > 1 and start == first_key:
        key_cache[table[(start + length - 1) // 16], (start + length - 1) % 16] += 10
        again = paged_attention_sdpa(query, key_cache, value_cache, table, start, scale, first_key=first_key)
        assert torch.equal(again[:-1], got[:-1]) and not torch.equal(again[-1], got[-1])
