"""The pure-PyTorch kernels against plainer formulations of the same maths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.interfaces.decode_rows import decode_keys
from engine.kernels.attention_reference import paged_attention, paged_decode_attention, write_kv
from engine.kernels.conv_reference import causal_conv1d
from engine.kernels.ssd_reference import ssd_chunk_scan, ssd_recurrent


def _ssd_inputs(T: int, H: int = 4, P: int = 8, G: int = 2, N: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g)
    dt = F.softplus(torch.randn(T, H, generator=g))
    A = -torch.rand(H, generator=g) * 4
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    state = torch.randn(H, P, N, generator=g)
    return x, dt, A, B, C, D, state


@pytest.mark.parametrize("T, chunk_size", [(1, 8), (7, 8), (8, 8), (29, 8), (29, 64)])
def test_chunk_scan_equals_recurrence(T, chunk_size):
    x, dt, A, B, C, D, state = _ssd_inputs(T)
    y_ref, final_ref = ssd_recurrent(x, dt, A, B, C, D, state)
    y, final = ssd_chunk_scan(x, dt, A, B, C, D, state, chunk_size)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


def test_chunk_scan_in_pieces_equals_whole():
    x, dt, A, B, C, D, state = _ssd_inputs(40, seed=1)
    y_whole, final_whole = ssd_chunk_scan(x, dt, A, B, C, D, state, 16)
    y1, mid = ssd_chunk_scan(x[:11], dt[:11], A, B[:11], C[:11], D, state, 16)
    y2, final = ssd_chunk_scan(x[11:], dt[11:], A, B[11:], C[11:], D, mid, 16)
    torch.testing.assert_close(torch.cat([y1, y2]), y_whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [2, 4])
def test_causal_conv_in_pieces_equals_padded_conv(kernel):
    g = torch.Generator().manual_seed(0)
    T, channels = 13, 5
    x = torch.randn(T, channels, generator=g)
    weight, bias = torch.randn(channels, kernel, generator=g), torch.randn(channels, generator=g)
    padded = F.conv1d(x.T[None], weight[:, None, :], bias, padding=kernel - 1, groups=channels)[0, :, :T]
    expected = F.silu(padded).T  # (T, C)
    state = torch.zeros(channels, kernel - 1)
    outputs = []
    for a, b in [(0, 1), (1, 6), (6, 7), (7, 13)]:  # pieces shorter and longer than the kernel
        out, state = causal_conv1d(x[a:b], state, weight, bias, apply_silu=True)
        outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs), expected)
    torch.testing.assert_close(state, x[T - (kernel - 1) :].T)


def test_paged_attention_equals_dense_causal_attention():
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, block_size, T = 4, 2, 8, 4, 11
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    key_cache, value_cache = torch.zeros(6, block_size, Hkv, D), torch.zeros(6, block_size, Hkv, D)
    block_table = torch.tensor([4, 0, 5])
    positions = torch.arange(T)
    slot_mapping = block_table[positions // block_size] * block_size + positions % block_size
    write_kv(key_cache, value_cache, slot_mapping, k, v)
    start = 6
    got = paged_attention(q[start:], key_cache, value_cache, block_table, start, scale=0.3)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, dim=1).transpose(0, 1),
        v.repeat_interleave(2, dim=1).transpose(0, 1), is_causal=True, scale=0.3,
    ).transpose(0, 1)[start:]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_batched_decode_attention_equals_one_sequence_at_a_time():
    """paged_decode_attention over sequences of different lengths (shorter ones padded, in
    blocks scattered over the cache) gives each query what paged_attention gives it alone."""
    g = torch.Generator().manual_seed(1)
    H, Hkv, D, block_size = 6, 2, 8, 4
    key_cache = torch.randn(24, block_size, Hkv, D, generator=g)
    value_cache = torch.randn(24, block_size, Hkv, D, generator=g)
    num_keys = [1, 5, 13, 8]
    tables = [(7,), (3, 11), (0, 9, 2, 23), (15, 1)]
    query = torch.randn(len(num_keys), H, D, generator=g)
    keys = decode_keys(tables, [n - 1 for n in num_keys], block_size, Hkv, torch.device("cpu"))
    assert keys.width == 16 and keys.padding[:, 0, 0].sum(-1).tolist() == [16 - n for n in num_keys]
    got = paged_decode_attention(query, key_cache, value_cache, keys.rows, keys.padding, scale=0.3)
    for b, (table, keys) in enumerate(zip(tables, num_keys)):
        alone = paged_attention(query[b : b + 1], key_cache, value_cache, torch.tensor(table), keys - 1, scale=0.3)
        torch.testing.assert_close(got[b : b + 1], alone, rtol=1e-5, atol=1e-6)
