"""Each GPU kernel against its pure-PyTorch reference on fresh random inputs.

Outputs and untouched state slots are poisoned with NaN before each run, so a kernel that skips
a row, writes a stray slot or reads the state of a resetting chunk fails.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention_reference import paged_attention
from engine.kernels.conv_reference import causal_conv1d
from engine.kernels.ssd_reference import ssd_chunk_scan
from tests.gpu.conftest import INTERPRETED, needs_device, needs_log1p, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

# Kernels built on tl.dot: fp32, and bf16 where Triton's interpreter does not stand in for the GPU.
DOT_DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="bf16 dot is not emulated faithfully")),
]


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


@pytest.mark.skipif(INTERPRETED, reason="fla-core kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[300, 2, 64, 1000, 129], [777]])  # varlen, and fla's fixed-length path
def test_ssd_prefill_scan(device, dtype, lengths):
    """The Mamba2 prefill scan from the conv output and raw dt (what the model runs) against
    the reference chunked scan per sequence, every other row a decode row it must skip; y
    without the D skip (the gated norm adds it), so the reference runs with D None."""
    pytest.importorskip("fla", reason="fla-core is not installed")
    from engine.interfaces.host_index import int64_array, to_device
    from engine.kernels.gpu.in_pass_capture import ScanChunks, scan_chunk_arrays
    from engine.kernels.gpu.ssd import ssd_prefill_scan

    torch.manual_seed(3)
    H, P, G, N = 8, 64, 1, 128
    cu_t, _, cu = _varlen(lengths, device)
    Tp = cu[-1]
    rows = torch.arange(0, 2 * Tp, 2, device=device)  # prefill rows among 2 Tp rows
    conv_dim = H * P + 2 * G * N
    xBC = torch.randn(2 * Tp, conv_dim, device=device, dtype=dtype)
    xBC[:, H * P : H * P + G * N] /= N**0.5  # B
    dt_raw = torch.randn(2 * Tp, H, device=device, dtype=dtype) - 2
    dt_bias = torch.rand(H, device=device) - 0.5
    A_log = torch.rand(H, device=device) * 2
    initial = torch.randn(len(lengths), H, P, N, device=device)
    limit = (0.0, float("inf"))

    chunks = None
    if len(lengths) > 1:  # the varlen path, its chunks built on the host as the batch plan builds them
        pairs, offsets = to_device(scan_chunk_arrays(int64_array(lengths)), device)
        chunks = ScanChunks(pairs.view(-1, 2), offsets)
    y, final = ssd_prefill_scan(xBC, dt_raw, dt_bias, A_log, limit, (H, P, G, N), initial, cu_t,
                                chunks, rows=rows)
    assert y.shape == (Tp, H, P) and final.shape == initial.shape
    x, B, C = xBC[rows].double().split([H * P, G * N, G * N], dim=-1)
    dt = torch.nn.functional.softplus(dt_raw[rows].double() + dt_bias.double())
    for i in range(len(lengths)):
        s, e = cu[i], cu[i + 1]
        ref_y, ref_state = ssd_chunk_scan(
            x[s:e].view(-1, H, P), dt[s:e], -torch.exp(A_log.double()), B[s:e].view(-1, G, N),
            C[s:e].view(-1, G, N), None, initial[i].double(), chunk_size=64,
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


def _poison_before(key_cache, value_cache, tables, first_key, block_size=16):
    """NaN into the K/V of each sequence's positions before first_key: a kernel that reads them
    (even under a zero weight) returns NaN there."""
    for blocks in tables:
        for position in range(first_key):
            for cache in (key_cache, value_cache):
                cache[blocks[position // block_size], position % block_size] = float("nan")


def _check_paged_decode(device, dtype, seq_lens, num_splits, first_key=0):
    """paged_attention_decode of one query per sequence at rows between other rows of a
    NaN-poisoned output (keys before first_key NaN too), against paged_attention. The third
    sequence's last key dominates its scores (by more than exp2 can span from the first
    split's maximum), so combining the splits must rescale by the maximum over all of them."""
    from engine.kernels.gpu.paged_attention import paged_attention_decode

    H, Dh, block_size = 16, 128, 16
    key_cache, value_cache, tables = _paged_setup(device, seq_lens, dtype=dtype)
    _poison_before(key_cache, value_cache, tables, first_key)
    T = len(seq_lens) + 2
    rows = [1, 2, 3, 5, 6]
    query = torch.randn(T, H, Dh, device=device, dtype=dtype)
    num_kv_heads = key_cache.shape[2]
    last = seq_lens[2] - 1
    key_cache[tables[2][last // block_size], last % block_size] = 10 * query[rows[2], :: H // num_kv_heads]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    out = torch.full_like(query, float("nan"))
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    scale = Dh**-0.5

    paged_attention_decode(
        query, key_cache, value_cache, out, as_t(rows), as_t(seq_lens), table, scale, num_splits=num_splits,
        first_key=first_key,
    )
    for row, n, blocks in zip(rows, seq_lens, tables):
        ref = paged_attention(
            query[row : row + 1].float(), key_cache.float(), value_cache.float(),
            torch.tensor(blocks, device=device), n - 1, scale, first_key=first_key,
        )
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: IEEE dots, no tf32
        assert relative_error(out[row : row + 1], ref) < tol, f"row {row}"
    assert torch.isnan(out[[0, 4]]).all(), "a non-decode row was written"


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 5, 16, None])  # None: decode_splits decides
def test_paged_attention_decode(device, dtype, num_splits):
    """Sequences from 1 key (every split but the first empty) to 1,000, keys in one program per
    (sequence, KV head) or split over several."""
    torch.manual_seed(4)
    _check_paged_decode(device, dtype, [1, 17, 1000, 64, 333], num_splits)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 5, 16, None])
def test_paged_attention_decode_first_key(device, dtype, num_splits):
    """first_key 1 (the MTP layer's; position 0 holds NaN): a sequence with one key past it
    (keys 1 .. 1), one whose keys 1 .. 64 fill exactly one tile, long ones split over several
    programs, some splits past the last key."""
    torch.manual_seed(14)
    _check_paged_decode(device, dtype, [2, 17, 1000, 65, 333], num_splits, first_key=1)


def _check_paged_prefill(device, dtype, chunks, skipped, num_heads, num_kv_heads, first_key=0, **launch):
    """paged_attention_prefill over chunks ((queries, start position) each; chunk `skipped` gets
    length 0) at rows between other rows of a NaN-poisoned output, keys before first_key NaN
    too, against paged_attention per chunk; rows outside the served chunks must stay NaN."""
    from engine.kernels.gpu.paged_attention import paged_attention_prefill

    Dh = 128
    key_cache, value_cache, tables = _paged_setup(device, [n + p for n, p in chunks], Hkv=num_kv_heads, dtype=dtype)
    _poison_before(key_cache, value_cache, tables, first_key)
    first_rows, row = [], 2  # rows 0, 1 and one row between chunks belong to nobody
    for n, _ in chunks:
        first_rows.append(row)
        row += n + 1
    query = torch.randn(row, num_heads, Dh, device=device, dtype=dtype)
    out = torch.full_like(query, float("nan"))
    width = max(len(t) for t in tables)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    lengths = [0 if s == skipped else n for s, (n, _) in enumerate(chunks)]
    scale = Dh**-0.5

    paged_attention_prefill(
        query, key_cache, value_cache, out, as_t(first_rows), as_t(lengths),
        as_t([p for _, p in chunks]), as_t([t + [0] * (width - len(t)) for t in tables]),
        max(lengths), scale, first_key=first_key, **launch,
    )
    written = torch.zeros(row, dtype=torch.bool)
    for s, ((n, start), first, blocks) in enumerate(zip(chunks, first_rows, tables)):
        if s == skipped:
            continue
        ref = paged_attention(
            query[first : first + n].float(), key_cache.float(), value_cache.float(),
            torch.tensor(blocks, device=device), start, scale, first_key=first_key,
        )
        assert relative_error(out[first : first + n], ref) < 1e-2, f"chunk {s}"
        written[first : first + n] = True
    assert torch.isnan(out[~written.to(out.device)]).all(), "a row outside the served chunks was written"


PREFILL_TILINGS = {  # keyword arguments of paged_attention_prefill beyond num_splits
    "ungrouped": {"heads_per_program": 1},  # one query head a program
    "grouped": {},  # the wrapper's defaults: every query head of a KV head in one program
    # bf16's default tile (4 heads x 32 queries, 8 warps) in any dtype; stages small enough for fp32
    "grouped_128_rows": {"heads_per_program": 4, "block_m": 32, "block_n": 32, "num_stages": 2},
}


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("tiling", list(PREFILL_TILINGS))
@pytest.mark.parametrize("num_splits", [1, 3, 8, None])  # None: prefill_splits decides
@pytest.mark.parametrize(
    "chunks",  # (queries, start position) of each chunk; the third is skipped (its rows stay NaN)
    [[(100, 0), (37, 512), (20, 7), (3, 64), (70, 33)],
     [(20, 7), (3, 64), (32, 300), (9, 0)]],  # every chunk <= 32 queries: 16-row query blocks
)
def test_paged_attention_prefill(device, dtype, tiling, num_splits, chunks):
    """Several prefill chunks in one launch, at rows between other rows: with and without cached
    keys, shorter and longer than a query block, one skipped (length 0); keys in one program
    per query block, or split over several (more splits than some blocks have key tiles); 16
    query heads over 4 KV heads, one or several query heads a program."""
    torch.manual_seed(5)
    _check_paged_prefill(device, dtype, chunks, 2, 16, 4, num_splits=num_splits, **PREFILL_TILINGS[tiling])


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("tiling", list(PREFILL_TILINGS))
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_paged_attention_prefill_first_key(device, dtype, tiling, num_splits):
    """first_key 1 (the MTP layer's; position 0 holds NaN): chunks from position 1 (longer and
    shorter than a query block; one query: a single key past first_key), continuing ones, one
    skipped; keys split over up to 8 programs, most of them past a short chunk's keys."""
    torch.manual_seed(15)
    chunks = [(100, 1), (1, 1), (37, 512), (20, 7), (3, 1), (70, 64)]
    _check_paged_prefill(device, dtype, chunks, 3, 16, 4, first_key=1, num_splits=num_splits,
                         **PREFILL_TILINGS[tiling])


# (H, Hkv, heads a program): one head a program, two where two divide H / Hkv, and None (the
# wrapper's default grouping) for GQA ratios 1, 2, 3, 4 and 8
GQA_CASES = [
    (heads, kv_heads, per_program)
    for heads, kv_heads in [(4, 4), (8, 4), (12, 4), (16, 4), (16, 2)]
    for per_program in [1, 2, None]
    if per_program is None or (heads // kv_heads) % per_program == 0
]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,heads_per_program", GQA_CASES)
def test_paged_attention_prefill_gqa(device, dtype, num_splits, heads_per_program, num_heads, num_kv_heads):
    """GQA ratios 1, 2, 3 (no power of two above 1 divides it: one head a program), 4 and 8,
    each with one head a program, two, and the default grouping (every head of a KV head, or
    as many as fit the tile): chunks with and without cached keys, one skipped, more splits
    than a short chunk has key tiles."""
    torch.manual_seed(7)
    chunks = [(40, 0), (7, 0), (19, 45), (33, 130)]
    _check_paged_prefill(device, dtype, chunks, 1, num_heads, num_kv_heads, num_splits=num_splits,
                         heads_per_program=heads_per_program)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("Hkv", [4, 16])  # grouped KV heads (repeated before SDPA) and not
def test_causal_attention_from_start(device, dtype, tol, Hkv):
    from engine.kernels.gpu.paged_attention import causal_attention_from_start

    torch.manual_seed(6)
    n, H, Dh = 100, 16, 128
    key_cache, value_cache, tables = _paged_setup(device, [n], Hkv=Hkv, Dh=Dh, dtype=dtype)
    table = torch.tensor(tables[0], device=device)
    flat = lambda cache: cache[table].reshape(-1, Hkv, Dh)[:n]  # noqa: E731
    query = torch.randn(n, H, Dh, device=device, dtype=dtype)
    out = causal_attention_from_start(query, flat(key_cache), flat(value_cache), Dh**-0.5)
    ref = paged_attention(query.float(), key_cache.float(), value_cache.float(), table, 0, Dh**-0.5)
    assert out.dtype == dtype and relative_error(out, ref) < tol


@needs_log1p
@pytest.mark.parametrize(
    "with_rows,with_valid,H,P", [(False, False, 16, 32), (True, False, 16, 32), (False, True, 16, 32),
                                 (False, False, 24, 32), (True, False, 48, 24)],  # a rank's share of 48 heads
)
def test_scan_inputs(device, with_rows, with_valid, H, P):
    """The fused scan-input kernel against the PyTorch ops it replaces (Mamba2Mixer._scan_inputs,
    the repeats over heads, the products), on a strided xBC and dt as in_proj's split gives."""
    from engine.kernels.gpu.ssd import scan_inputs

    torch.manual_seed(9)
    T, G, N = 23, 2, 64
    conv_dim = H * P + 2 * G * N
    projected = torch.randn(T, 5 + conv_dim + H, device=device, dtype=torch.bfloat16) * 3
    xBC, dt_raw = projected[:, 5 : 5 + conv_dim], projected[:, 5 + conv_dim :]
    dt_bias = torch.randn(H, device=device)
    A_log = torch.randn(H, device=device)
    limit = (0.001, 4.0)
    # rows: a subset of the rows, and -1 for a padding row (all zeros)
    rows = torch.tensor([0, 3, -1, 4, 5, 9, -1, -1, 10, 11, 22], device=device) if with_rows else None
    valid = (torch.arange(T, device=device) % 5 != 3) if with_valid else None

    q, k, v, g = scan_inputs(xBC, dt_raw, dt_bias, A_log, limit, (H, P, G, N), rows, valid)
    if rows is None:
        pick = lambda t: t  # noqa: E731
    else:
        real = (rows >= 0)[:, None]
        pick = lambda t: torch.where(real, t[rows.clamp_min(0)], 0)  # noqa: E731
        valid = rows >= 0  # zero rows have dt = 0 too
    dt = torch.nn.functional.softplus(pick(dt_raw).float() + dt_bias).clamp(*limit)
    if valid is not None:
        dt = torch.where(valid[:, None], dt, 0.0)
    x, B, C = pick(xBC).float().split([H * P, G * N, G * N], dim=-1)
    expected = {
        "q": C.reshape(-1, G, N).repeat_interleave(H // G, dim=1),
        "k": B.reshape(-1, G, N).repeat_interleave(H // G, dim=1),
        "v": x.reshape(-1, H, P) * dt[..., None],
        "g": dt * -torch.exp(A_log),
    }
    for name, got in zip("qkvg", (q, k, v, g)):
        assert got.shape == expected[name].shape, name
        assert relative_error(got, expected[name]) < 1e-6, name
    if valid is not None:
        assert (v[~valid] == 0).all() and (g[~valid] == 0).all()


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="the interpreter rounds fp32 to bf16 differently from torch")),
])
def test_write_kv(device, dtype):
    from engine.kernels.attention_reference import write_kv as write_kv_reference
    from engine.kernels.gpu.kv_write import write_kv

    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 4, 3, 8, 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device=device).to(dtype)
    value_cache = torch.randn(shape, device=device).to(dtype)
    # K and V as the layer has them: views of wider projections' rows (row stride > Hkv * D)
    key = torch.randn(num_tokens, num_kv_heads * head_dim + 5, device=device)[:, :num_kv_heads * head_dim]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv_reference(expected_k, expected_v, slots, key, value)
    write_kv(key_cache, value_cache, slots, key, value)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
