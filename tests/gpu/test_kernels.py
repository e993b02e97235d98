"""Each GPU kernel against its pure-PyTorch reference on fresh random inputs.

Outputs and untouched state slots are poisoned with NaN before each run, so a kernel that skips
a row, writes a stray slot or reads the state of a resetting chunk fails.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention_reference import paged_attention
from engine.kernels.conv_reference import causal_conv1d
from engine.kernels.ssd_reference import ssd_chunk_scan, ssd_step
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]


def _varlen(lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(cu_seqlens (S+1,), token_chunk (T,)) as int64 device tensors, plus the Python cu list."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    token_chunk = [i for i, n in enumerate(lengths) for _ in range(n)]
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_t(cu), as_t(token_chunk), cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_varlen(device, dtype):
    from engine.kernels.gpu.conv import causal_conv1d_varlen

    torch.manual_seed(1)
    lengths, resets, slots = [5, 1, 17, 1, 3, 40], [1, 0, 0, 1, 0, 0], [6, 0, 3, 2, 7, 5]
    channels, width, num_slots = 200, 4, 9
    cu_t, token_chunk, cu = _varlen(lengths, device)
    x_full = torch.randn(cu[-1], channels + 8, device=device, dtype=dtype)
    x = x_full[:, 3 : 3 + channels]  # a strided view, as the split of in_proj's output is
    weight = torch.randn(channels, width, device=device, dtype=dtype)
    bias = torch.randn(channels, device=device, dtype=dtype)
    state = torch.randn(num_slots, channels, width - 1, device=device, dtype=dtype)
    for slot, reset in zip(slots, resets):
        if reset:
            state[slot] = float("nan")  # must not be read
    unused = [s for s in range(num_slots) if s not in slots]
    state[unused] = float("nan")
    before = state.clone()

    out = torch.full((cu[-1], channels), float("nan"), device=device, dtype=dtype)
    causal_conv1d_varlen(
        x, state, weight, bias, cu_t,
        torch.tensor(slots, device=device), torch.tensor(resets, device=device), token_chunk,
        apply_silu=True, out=out,
    )
    for i, (slot, reset) in enumerate(zip(slots, resets)):
        old = torch.zeros_like(before[slot]) if reset else before[slot]
        ref_out, ref_state = causal_conv1d(
            x[cu[i] : cu[i + 1]].float(), old.float(), weight.float(), bias.float(), apply_silu=True
        )
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert relative_error(out[cu[i] : cu[i + 1]], ref_out) < tol, f"chunk {i} output"
        assert torch.equal(state[slot].float(), ref_state.to(dtype).float()), f"chunk {i} state"
    assert torch.isnan(state[unused]).all(), "an unused slot was written"


def test_ssd_decode_update(device):
    from engine.kernels.gpu.ssd import ssd_decode_update

    torch.manual_seed(2)
    T, H, P, G, N, num_slots = 9, 8, 64, 2, 128, 12
    rows, slots, resets = [0, 2, 3, 5, 8], [4, 0, 11, 7, 2], [0, 1, 0, 0, 1]
    x = torch.randn(T, H, P, device=device, dtype=torch.bfloat16)
    dt = torch.nn.functional.softplus(torch.randn(T, H, device=device))
    A = -torch.exp(torch.rand(H, device=device) * 2)
    B = torch.randn(T, G, N, device=device, dtype=torch.bfloat16)
    C = torch.randn(T, G, N, device=device, dtype=torch.bfloat16)
    D = torch.randn(H, device=device)
    state = torch.randn(num_slots, H, P, N, device=device)
    for slot, reset in zip(slots, resets):
        if reset:
            state[slot] = float("nan")
    unused = [s for s in range(num_slots) if s not in slots]
    state[unused] = float("nan")
    before = state.clone()
    y = torch.full((T, H, P), float("nan"), device=device)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731

    ssd_decode_update(x, dt, A, B, C, D, state, y, as_t(rows), as_t(slots), as_t(resets))
    for row, slot, reset in zip(rows, slots, resets):
        old = torch.zeros_like(before[slot]) if reset else before[slot]
        ref_y, ref_state = ssd_step(x[row], dt[row], A, B[row], C[row], D, old)
        assert relative_error(y[row], ref_y) < 1e-5, f"row {row} y"
        assert relative_error(state[slot], ref_state) < 1e-5, f"row {row} state"
    untouched = [r for r in range(T) if r not in rows]
    assert torch.isnan(y[untouched]).all(), "a non-decode row was written"
    assert torch.isnan(state[unused]).all(), "an unused slot was written"


@pytest.mark.skipif(INTERPRETED, reason="fla-core kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_chunk_scan_varlen(device, dtype):
    pytest.importorskip("fla", reason="fla-core is not installed")
    from engine.kernels.gpu.ssd import ssd_chunk_scan_varlen

    torch.manual_seed(3)
    lengths = [300, 2, 64, 1000, 129]
    H, P, G, N = 8, 64, 1, 128
    cu_t, _, cu = _varlen(lengths, device)
    T = cu[-1]
    x = torch.randn(T, H, P, device=device, dtype=dtype)
    dt = torch.nn.functional.softplus(torch.randn(T, H, device=device) - 2)
    A = -torch.exp(torch.rand(H, device=device) * 2)
    B = torch.randn(T, G, N, device=device, dtype=dtype) / N**0.5
    C = torch.randn(T, G, N, device=device, dtype=dtype)
    D = torch.randn(H, device=device)
    initial = torch.randn(len(lengths), H, P, N, device=device)

    y, final = ssd_chunk_scan_varlen(x, dt, A, B, C, D, initial, cu_t, torch.tensor(cu))
    assert y.shape == (T, H, P) and final.shape == initial.shape
    for i in range(len(lengths)):
        s, e = cu[i], cu[i + 1]
        ref_y, ref_state = ssd_chunk_scan(
            x[s:e].double(), dt[s:e].double(), A.double(), B[s:e].double(), C[s:e].double(),
            D.double(), initial[i].double(), chunk_size=64,
        )
        assert relative_error(y[s:e], ref_y) < 5e-3, f"sequence {i} y"
        assert relative_error(final[i], ref_state) < 5e-3, f"sequence {i} final state"


def _paged_setup(device, seq_lens, Hkv=4, Dh=128, block_size=16, dtype=torch.bfloat16):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    key_cache = torch.randn(num_blocks, block_size, Hkv, Dh, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    order = torch.randperm(num_blocks).tolist()
    tables, taken = [], 0
    for n in seq_lens:
        k = -(-n // block_size)
        tables.append(order[taken : taken + k])
        taken += k
    return key_cache, value_cache, tables


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(INTERPRETED, reason="bf16 dot is not emulated faithfully"),
        ),
    ],
)
def test_paged_attention_decode(device, dtype):
    from engine.kernels.gpu.paged_attention import paged_attention_decode

    torch.manual_seed(4)
    seq_lens = [1, 17, 1000, 64, 333]
    H, Dh, block_size = 16, 128, 16
    key_cache, value_cache, tables = _paged_setup(device, seq_lens, dtype=dtype)
    T = len(seq_lens) + 2
    rows = [1, 2, 3, 5, 6]
    query = torch.randn(T, H, Dh, device=device, dtype=dtype)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    out = torch.full_like(query, float("nan"))
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    scale = Dh**-0.5

    paged_attention_decode(query, key_cache, value_cache, out, as_t(rows), as_t(seq_lens), table, scale)
    for row, n, blocks in zip(rows, seq_lens, tables):
        ref = paged_attention(
            query[row : row + 1].float(), key_cache.float(), value_cache.float(),
            torch.tensor(blocks, device=device), n - 1, scale,
        )
        assert relative_error(out[row : row + 1], ref) < 1e-2, f"row {row}"
    assert torch.isnan(out[[0, 4]]).all(), "a non-decode row was written"


@pytest.mark.skipif(INTERPRETED, reason="SDPA path: nothing to interpret")
@pytest.mark.parametrize("start_position", [0, 37, 512])
def test_paged_attention_prefill(device, start_position):
    from engine.kernels.gpu.paged_attention import paged_attention_prefill

    torch.manual_seed(5)
    n, H, Dh = 100, 16, 128
    key_cache, value_cache, tables = _paged_setup(device, [start_position + n])
    query = torch.randn(n, H, Dh, device=device, dtype=torch.bfloat16)
    table = torch.tensor(tables[0], device=device)
    out = paged_attention_prefill(query, key_cache, value_cache, table, start_position, Dh**-0.5)
    ref = paged_attention(
        query.float(), key_cache.float(), value_cache.float(), table, start_position, Dh**-0.5
    )
    assert relative_error(out, ref) < 1e-2
