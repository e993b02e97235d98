"""The FP8 KV cache's PyTorch reference (engine/kernels/attention_reference.py), on the CPU.

quantize_kv against a brute-force nearest-value search over every FP8 E4M3 code; write_kv and
paged_attention on FP8 blocks against dense attention over the dequantized values; and the
tiny model on FP8 blocks through its PyTorch path: a request restored from a checkpoint (full
blocks shared, the FP8 attention tail copied, the state copied) gives what the same request
computed from scratch gives. The engine runs FP8 on CUDA only; these are the reference the
device tests (tests/gpu/test_fp8_kv.py) compare the Triton kernels against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.execution.loader import load_model
from engine.interfaces.forward_batch import ForwardBatch, SequenceChunk
from engine.kernels.attention_reference import (
    FP8_E4M3_MAX, dequantize_kv, paged_attention, quantize_kv, storage_view, write_kv,
)
from engine.kernels.bundle_copy import gather_bundle, scatter_bundle

FP8 = torch.float8_e4m3fn
BLOCK = 16


def _finite_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite FP8 E4M3 code: (byte values, their values as fp32)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(FP8).float()
    finite = ~values.isnan()
    return codes[finite], values[finite]


def _nearest_code(x: torch.Tensor) -> torch.Tensor:
    """The byte of the FP8 value nearest each element of x (fp32), ties to the even code
    (mantissa bit 0 clear), zero with x's sign, beyond +-448 the largest: round to nearest
    even with saturation, found by search over every code rather than by converting."""
    codes, values = _finite_codes()
    x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).reshape(-1, 1)
    distance = (x - values[None, :]).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values  # two at a tie, and +0 / -0
    even = (codes & 1) == 0
    same_sign = (codes[None, :] >= 128) == (x < 0)  # the sign bit
    score = nearest.int() * 4 + even.int()[None, :] * 2 + same_sign.int()
    return codes[score.argmax(dim=1)]  # flat


def test_quantize_kv_rounds_to_the_nearest_fp8_value_per_head():
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.37, 2.0, 0.011])
    spread = torch.exp(3 * torch.randn(50, 3, 8, generator=g))
    x = torch.randn(50, 3, 8, generator=g) * spread * scale[:, None]
    x[0, 1, :3] = torch.tensor([1e6, -1e6, 448.5 * 2.0])  # past the range: saturate
    x[1, 1, :2] = torch.tensor([1.0625, 1.1875]) * 2.0  # halfway between two FP8 values
    stored = quantize_kv(x, scale)
    assert stored.dtype == FP8 and stored.shape == x.shape
    expected = _nearest_code(x / scale[:, None]).reshape(x.shape)
    assert torch.equal(storage_view(stored), expected)
    assert stored[0, 1, :3].float().tolist() == [448.0, -448.0, 448.0]
    assert stored[1, 1, :2].float().tolist() == [1.0, 1.25]  # ties to the even mantissa


def test_dequantize_kv_multiplies_each_head_by_its_scale():
    codes, values = _finite_codes()
    stored = codes[:96].view(FP8).reshape(4, 3, 8)
    scale = torch.tensor([0.5, 3.0, 0.07])
    got = dequantize_kv(stored, scale, torch.float32)
    assert torch.equal(got, values[:96].reshape(4, 3, 8) * scale[:, None])
    assert dequantize_kv(stored, scale, torch.bfloat16).dtype == torch.bfloat16


def test_write_kv_quantizes_into_the_slots_only():
    g = torch.Generator().manual_seed(1)
    kv_scale = torch.tensor([[0.2, 1.5], [0.05, 0.8]])
    key_cache = torch.zeros(5, 4, 2, 8, dtype=FP8)
    value_cache = torch.zeros(5, 4, 2, 8, dtype=FP8)
    key, value = torch.randn(2, 6, 2, 8, generator=g).unbind(0)
    slots = torch.tensor([19, 0, 7, 8, 13, 2])
    write_kv(key_cache, value_cache, slots, key, value, kv_scale)
    flat = lambda cache: storage_view(cache).reshape(20, 2, 8)  # noqa: E731
    assert torch.equal(flat(key_cache)[slots], storage_view(quantize_kv(key, kv_scale[0])))
    assert torch.equal(flat(value_cache)[slots], storage_view(quantize_kv(value, kv_scale[1])))
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert (flat(key_cache)[untouched] == 0).all() and (flat(value_cache)[untouched] == 0).all()
    # the bytes of a token depend on its K/V and scales only: written again alone, in another
    # batch and at another slot, they are the same
    again = torch.zeros(5, 4, 2, 8, dtype=FP8)
    write_kv(again, again.clone(), torch.tensor([5]), key[3:4], value[3:4], kv_scale)
    assert torch.equal(flat(again)[5], flat(key_cache)[8])


def test_paged_attention_on_fp8_blocks_is_attention_over_the_dequantized_values():
    g = torch.Generator().manual_seed(2)
    H, Hkv, D, T, start = 4, 2, 8, 11, 6
    kv_scale = torch.tensor([[0.3, 0.04], [1.7, 0.2]])
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g) * kv_scale[0][:, None] * 20
    v = torch.randn(T, Hkv, D, generator=g) * kv_scale[1][:, None] * 20
    key_cache, value_cache = torch.zeros(6, 4, Hkv, D, dtype=FP8), torch.zeros(6, 4, Hkv, D, dtype=FP8)
    block_table = torch.tensor([4, 0, 5])
    positions = torch.arange(T)
    write_kv(key_cache, value_cache, block_table[positions // 4] * 4 + positions % 4, k, v, kv_scale)
    got = paged_attention(q[start:], key_cache, value_cache, block_table, start, scale=0.3, kv_scale=kv_scale)
    # dense causal attention over what the blocks hold: the FP8 values times each head's scale
    k_held = quantize_kv(k, kv_scale[0]).float() * kv_scale[0][:, None]
    v_held = quantize_kv(v, kv_scale[1]).float() * kv_scale[1][:, None]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_held.repeat_interleave(2, dim=1).transpose(0, 1),
        v_held.repeat_interleave(2, dim=1).transpose(0, 1), is_causal=True, scale=0.3,
    ).transpose(0, 1)[start:]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and FP8 is close to, not equal to, attention over the unquantized K/V
    exact = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, dim=1).transpose(0, 1),
        v.repeat_interleave(2, dim=1).transpose(0, 1), is_causal=True, scale=0.3,
    ).transpose(0, 1)[start:]
    error = float((got - exact).norm() / exact.norm())
    assert 0 < error < 0.1


def _step(model, caches, chunks) -> torch.Tensor:
    """One forward of chunks (state slot, start position, tokens, block table); the logits."""
    ids, positions, slots, sequence_chunks, cu = [], [], [], [], [0]
    for slot, start, tokens, table in chunks:
        for i, token in enumerate(tokens):
            ids.append(token)
            positions.append(start + i)
            slots.append(table[(start + i) // BLOCK] * BLOCK + (start + i) % BLOCK)
        sequence_chunks.append(SequenceChunk(slot, start, len(tokens), tuple(table), reset_state=start == 0))
        cu.append(len(ids))
    as_t = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(as_t(ids), as_t(positions), as_t(slots), tuple(sequence_chunks), tuple(cu))
    with torch.no_grad():
        return model.compute_logits(model(batch, caches))


def test_a_restored_request_on_fp8_blocks_gives_what_scratch_gives():
    """Request A computes a 45-token prompt in two chunks; its checkpoint at 45 (state, FP8
    tail of 13 tokens) is restored into request B, which shares A's two full blocks and
    continues with 12 more tokens; request C computes all 57 from scratch in one chunk, in
    other blocks. B's logits are C's (within the exactness suite's 1e-4 relative), the tail
    travels as FP8 bytes, and FP8 moves the logits a little from a model-dtype cache."""
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=torch.float32)
    layers = len(config.attention_layers)
    kv_scale = torch.tensor([[0.05, 0.11], [0.03, 0.07]])[:, None].expand(2, layers, 2)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, config.vocab_size, (45,), generator=g).tolist()
    suffix = torch.randint(0, config.vocab_size, (12,), generator=g).tolist()
    logits = {}
    for name, scale in (("fp8", kv_scale), ("model dtype", None)):
        caches = model.allocate_caches(num_blocks=32, block_size=BLOCK, num_state_slots=3, kv_scale=scale)
        a, b, c = [0, 1, 2, 3], [0, 1, 10, 11], [20, 21, 22, 23]
        _step(model, caches, [(0, 0, prompt[:20], a)])
        _step(model, caches, [(0, 20, prompt[20:], a)])
        conv, ssm, tail = gather_bundle(caches, 0, a[2], 45 % BLOCK)
        scatter_bundle(caches, 1, b[2], conv, ssm, tail)
        restored = _step(model, caches, [(1, 45, suffix, b)])
        scratch = _step(model, caches, [(2, 0, prompt + suffix, c)])[45:]
        error = float((restored - scratch).abs().max() / scratch.abs().max())
        assert error < 1e-4, f"{name}: restored logits differ from scratch by {error:.2e}"
        assert torch.equal(restored.argmax(-1), scratch.argmax(-1)), name
        logits[name] = scratch
        if scale is not None:
            assert tail.dtype == FP8 and tail.shape[2] == 45 % BLOCK
            first = min(caches.key_cache)
            assert torch.equal(storage_view(tail[0, 0]), storage_view(caches.key_cache[first][a[2], :13]))
            assert torch.equal(caches.kv_scale[first], kv_scale[:, 0]), "the scales are static"
    drift = float((logits["fp8"] - logits["model dtype"]).abs().max() / logits["model dtype"].abs().max())
    assert 0 < drift < 0.05, drift
