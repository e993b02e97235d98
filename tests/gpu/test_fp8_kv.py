"""FP8 KV blocks on the device: each Triton kernel against the PyTorch reference
(engine/kernels/attention_reference.py quantize_kv, dequantize_kv, write_kv, paged_attention with
kv_scale), and the attention layer's CUDA path reading back exactly what it wrote.

Every KV head gets its own scale (powers of two and not), so a kernel that takes another head's
scale, or none, fails. Outputs are poisoned with NaN, so a kernel that skips a row or writes a
stray one fails. Triton's interpreter rounds fp32 to FP8 wrongly where the rounding carries into
the exponent (7.99 becomes 4.0) and fp32 to bf16 by truncation: there the write test takes
values FP8 holds exactly, and the attention tests take fp32 queries only.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.execution.loader import load_model
from engine.interfaces.forward_batch import build_forward_batch
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk
from engine.kernels.attention_reference import FP8_E4M3_MAX, paged_attention, quantize_kv, write_kv as write_kv_reference
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

FP8 = torch.float8_e4m3fn
# bf16 queries where Triton's interpreter does not stand in for the GPU
QUERY_DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="bf16 is not emulated faithfully")),
]


def _scales(num_kv_heads: int, device) -> torch.Tensor:
    """(2, Hkv) fp32: a different key and value scale for every head."""
    keys = torch.tensor([0.5, 0.037, 2.0, 0.31, 1.0, 0.0625, 3.3, 0.9])[:num_kv_heads]
    values = torch.tensor([0.02, 0.25, 0.77, 4.0, 0.125, 1.5, 0.011, 0.6])[:num_kv_heads]
    return torch.stack([keys, values]).to(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _representable(shape, scale: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 values (..., Hkv, D) that are FP8 E4M3 values times their head's (power-of-two)
    scale (finite codes drawn at random, signed zeros and subnormals included), so quantizing
    them needs no rounding."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[~codes.isnan()]
    picks = finite[torch.randint(0, finite.numel(), shape, generator=generator)]
    return picks * scale.cpu()[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("values", [
    "representable",
    pytest.param("random", marks=pytest.mark.skipif(
        INTERPRETED, reason="the interpreter rounds fp32 to FP8 wrongly when the rounding carries")),
])
def test_write_kv_fp8_stores_the_reference_bytes(device, dtype, values):
    """write_kv with kv_scale stores exactly quantize_kv's bytes at each token's slot and
    nothing elsewhere: values of every magnitude, some past 448 x scale (saturated), on K/V
    that are views of wider rows, as the layer's projections give them."""
    from engine.kernels.gpu.kv_write import write_kv

    g = torch.Generator().manual_seed(21)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 4, 3, 16, 9
    shape = (num_tokens, num_kv_heads, head_dim)
    if values == "representable":  # power-of-two scales: code x scale is exact in bf16 too
        kv_scale = torch.tensor([[0.5, 0.0625, 4.0], [2.0, 0.125, 0.25]], device=device)
        key, value = _representable(shape, kv_scale[0], g), _representable(shape, kv_scale[1], g)
    else:
        kv_scale = _scales(num_kv_heads, device)
        spread = torch.exp(2 * torch.randn(2, *shape, generator=g))  # 1e-3 .. 1e3 times the scale
        key, value = (torch.randn(2, *shape, generator=g) * spread * kv_scale.cpu()[:, None, :, None]).unbind(0)
        key[0, 0, :4] = torch.tensor([1e4, -1e4, 449.0, -448.5]) * kv_scale[0, 0].item()  # saturate
    width = num_kv_heads * head_dim
    wide = torch.zeros(num_tokens, width + 8)
    wide[:, 3 : 3 + width] = key.reshape(num_tokens, width)
    key = wide.to(device=device, dtype=dtype)[:, 3 : 3 + width].view(shape)  # row stride > Hkv * D
    value = value.to(device=device, dtype=dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    poison = torch.full(cache_shape, 0x7E, dtype=torch.uint8, device=device).view(FP8)  # 448, written by no one
    key_cache, value_cache = poison.clone(), poison.clone()
    expected_k, expected_v = poison.clone(), poison.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(device)

    write_kv(key_cache, value_cache, slots, key, value, kv_scale)
    write_kv_reference(expected_k, expected_v, slots, key, value, kv_scale)
    assert torch.equal(_bytes(key_cache), _bytes(expected_k)), "keys"
    assert torch.equal(_bytes(value_cache), _bytes(expected_v)), "values"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots.cpu()] = True
    untouched = _bytes(key_cache).view(num_blocks * block_size, -1)[~written.to(device)]
    assert (untouched == 0x7E).all(), "a slot no token maps to was written"
    if values == "random":
        assert key_cache.float().abs().max() == FP8_E4M3_MAX, "the values past 448 x scale saturate"


def _fp8_paged_setup(device, seq_lens, num_kv_heads, head_dim=128, block_size=16, seed=0):
    """FP8 caches holding quantize_kv of random K/V (per-head scales) in shuffled blocks, with
    5 blocks to spare: (key_cache, value_cache, kv_scale, block tables)."""
    g = torch.Generator().manual_seed(seed)
    kv_scale = _scales(num_kv_heads, device)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=g) * kv_scale[0].cpu()[:, None] * 4
    value = torch.randn(shape, generator=g) * kv_scale[1].cpu()[:, None] * 4
    key_cache = quantize_kv(key, kv_scale[0].cpu()).to(device)
    value_cache = quantize_kv(value, kv_scale[1].cpu()).to(device)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, taken = [], 0
    for n in seq_lens:
        k = -(-n // block_size)
        tables.append(order[taken : taken + k])
        taken += k
    return key_cache, value_cache, kv_scale, tables


def _poison_before(caches, tables, first_key, block_size=16):
    """FP8 NaN (byte 0x7F) into each sequence's positions before first_key (read under a zero
    weight, they still give NaN)."""
    for blocks in tables:
        for position in range(first_key):
            for cache in caches:
                _bytes(cache)[blocks[position // block_size], position % block_size] = 0x7F


@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 5, None])  # None: decode_splits decides
@pytest.mark.parametrize("first_key", [0, 1])
def test_paged_attention_decode_fp8(device, dtype, num_splits, first_key):
    """One query per sequence (1 to 700 keys, split over several programs or not) at rows
    between NaN rows, against paged_attention on the same FP8 blocks and scales."""
    from engine.kernels.gpu.paged_attention import paged_attention_decode

    H, Hkv, Dh = 16, 4, 128
    seq_lens = [2, 17, 700, 65]
    key_cache, value_cache, kv_scale, tables = _fp8_paged_setup(device, seq_lens, Hkv, Dh, seed=4)
    _poison_before((key_cache, value_cache), tables, first_key)
    g = torch.Generator().manual_seed(5)
    rows = [1, 2, 4, 5]
    query = torch.randn(len(seq_lens) + 2, H, Dh, generator=g).to(device=device, dtype=dtype)
    out = torch.full_like(query, float("nan"))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    scale = Dh**-0.5

    paged_attention_decode(query, key_cache, value_cache, out, as_t(rows), as_t(seq_lens), table, scale,
                           num_splits=num_splits, first_key=first_key, kv_scale=kv_scale)
    for row, n, blocks in zip(rows, seq_lens, tables):
        ref = paged_attention(query[row : row + 1].float(), key_cache, value_cache,
                              torch.tensor(blocks, device=device), n - 1, scale, first_key=first_key,
                              kv_scale=kv_scale)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: the same dequantized values, IEEE dots
        assert relative_error(out[row : row + 1], ref) < tol, f"row {row}"
    assert torch.isnan(out[[0, 3]]).all(), "a non-decode row was written"


@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("launch", [
    {"num_splits": 1, "heads_per_program": 1},  # one query head a program
    {"num_splits": 3},  # the default grouping, keys split over 3 programs
    {"num_splits": 1, "heads_per_program": 2, "block_m": 16, "block_n": 32, "num_stages": 2},
])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 4), (8, 2)])
def test_paged_attention_prefill_fp8(device, dtype, launch, num_heads, num_kv_heads):
    """Prefill chunks with and without cached keys (one skipped: its rows stay NaN) in one
    launch over FP8 blocks, against paged_attention per chunk on the same blocks and scales."""
    from engine.kernels.gpu.paged_attention import paged_attention_prefill

    Dh = 128
    chunks = [(40, 0), (7, 0), (19, 45), (33, 130)]  # (queries, start position)
    skipped = 1
    key_cache, value_cache, kv_scale, tables = _fp8_paged_setup(
        device, [n + p for n, p in chunks], num_kv_heads, Dh, seed=6)
    first_rows, row = [], 2
    for n, _ in chunks:
        first_rows.append(row)
        row += n + 1
    g = torch.Generator().manual_seed(7)
    query = torch.randn(row, num_heads, Dh, generator=g).to(device=device, dtype=dtype)
    out = torch.full_like(query, float("nan"))
    width = max(len(t) for t in tables)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    lengths = [0 if s == skipped else n for s, (n, _) in enumerate(chunks)]
    scale = Dh**-0.5

    paged_attention_prefill(
        query, key_cache, value_cache, out, as_t(first_rows), as_t(lengths), as_t([p for _, p in chunks]),
        as_t([t + [0] * (width - len(t)) for t in tables]), max(lengths), scale, kv_scale=kv_scale, **launch,
    )
    written = torch.zeros(row, dtype=torch.bool)
    for s, ((n, start), first, blocks) in enumerate(zip(chunks, first_rows, tables)):
        if s == skipped:
            continue
        ref = paged_attention(query[first : first + n].float(), key_cache, value_cache,
                              torch.tensor(blocks, device=device), start, scale, kv_scale=kv_scale)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert relative_error(out[first : first + n], ref) < tol, f"chunk {s}"
        written[first : first + n] = True
    assert torch.isnan(out[~written.to(out.device)]).all(), "a row outside the served chunks was written"


def _chunk(request: int, tokens: list[int], start: int) -> ScheduledChunk:
    blocks = tuple(range(request * 8 + 7, request * 8 - 1, -1))  # 128 positions, blocks in reverse
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens), start_position=start, block_table=blocks,
        state_slot=request, reset_state=start == 0, sample=True, sampling=SamplingParams(),
    )


def test_attention_layer_reads_back_what_it_wrote(device):
    """The attention layer on FP8 caches, through the CUDA path (GpuBatchPlan: write kernel,
    decode and prefill kernels, SDPA for chunks that start their sequence; in Triton's
    interpreter the PyTorch path): after each step the cache holds quantize_kv of the layer's
    own K/V at every token's slot, and its output is o_proj of paged_attention over those FP8
    blocks, for fresh prefills (SDPA: they must read the dequantized values too, not the K/V
    they computed), continued prefills and decodes in one batch."""
    from engine.kernels.gpu.batch_plan import build_gpu_batch_plan

    model, config = load_model(DEFAULT_MODEL_DIR, dtype=torch.float32, device=device)
    layer = next(block.self_attn for block in model.layers if block.self_attn is not None)
    num_kv_heads = layer.num_kv_heads
    kv_scale = _scales(num_kv_heads, device)
    attention = list(config.attention_layers)
    caches = model.allocate_caches(num_blocks=32, block_size=16, num_state_slots=4, device=device,
                                   kv_scale=kv_scale[:, None].expand(2, len(attention), num_kv_heads))
    first = attention[0]
    key_cache, value_cache = caches.key_cache[first], caches.value_cache[first]
    assert key_cache.dtype == FP8 and torch.equal(caches.kv_scale[first], kv_scale)
    g = torch.Generator().manual_seed(8)
    ids = lambda n: torch.randint(0, config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    steps = [
        [_chunk(0, ids(40), 0), _chunk(1, ids(9), 0)],
        [_chunk(1, ids(70), 9), _chunk(0, ids(1), 40), _chunk(2, ids(3), 0)],
        [_chunk(2, ids(1), 3), _chunk(0, ids(1), 41), _chunk(1, ids(1), 79)],
    ]
    with torch.inference_mode():
        for step, chunks in enumerate(steps):
            batch = build_forward_batch(chunks, 16, torch.device(device))
            hidden = torch.randn(batch.num_tokens, config.hidden_size, generator=g).to(device)
            plan = build_gpu_batch_plan(batch, 16, torch.device(device)) if device.type == "cuda" else None
            out = layer(hidden, batch, key_cache, value_cache, None, plan, kv_scale)
            query, key, value = layer.project_qkv(hidden, stacked=plan is not None and plan.stacked_qkv)
            flat = (-1, num_kv_heads, layer.head_dim)
            stored_k = _bytes(key_cache).view(flat)[batch.slot_mapping]
            stored_v = _bytes(value_cache).view(flat)[batch.slot_mapping]
            assert torch.equal(stored_k, _bytes(quantize_kv(key, kv_scale[0]))), f"step {step} keys"
            assert torch.equal(stored_v, _bytes(quantize_kv(value, kv_scale[1]))), f"step {step} values"
            attended = torch.empty_like(query)
            for chunk, a, b in zip(batch.chunks, batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
                attended[a:b] = paged_attention(query[a:b], key_cache, value_cache,
                                                torch.tensor(chunk.block_table, device=device),
                                                chunk.start_position, layer.scale, kv_scale=kv_scale)
            ref = layer.o_proj(attended.reshape(batch.num_tokens, -1))
            assert relative_error(out, ref) < 1e-5, f"step {step} output"
