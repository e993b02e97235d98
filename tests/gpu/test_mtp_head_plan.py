"""The MTP head through its batch's GpuBatchPlan against its PyTorch path
(engine/models/mtp_head.py; issue 25): what the MTP drafter runs on CUDA, the head's attention
in the Triton paged kernels with the plan's first_key 1 (keys from position 1 on).

On a CUDA device, and on the CPU under TRITON_INTERPRET=1 (the head has no Mamba2 mixer, so no
kernel that calls libdevice.log1p; fp32 only there). The engine-level tests are
tests/gpu/test_mtp_gpu.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.interfaces.forward_batch import build_forward_batch
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _chunk(name: str, start: int, length: int, blocks: tuple[int, ...], slot: int) -> ScheduledChunk:
    tokens = tuple(100 + (7 * start + 13 * i) % 1900 for i in range(length))
    return ScheduledChunk(name, tokens, start, blocks, slot, False, True, GREEDY)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRETED, reason="Triton's interpreter does not emulate the kernels' bf16 dots faithfully (first_key 0 "
    "fails as much)"))])
def test_head_through_its_plan_equals_its_pytorch_path(device, dtype):
    """One batch of what the drafter sends: chunks continuing at positions 1 (the first row a
    head computes), 9 and 30 (several rows, the paged prefill kernel) and one-row chunks at 2
    and 17 (the decode kernel, one with a single key past first_key), over head K/V of random
    earlier positions; h' and the K/V written equal the PyTorch path's."""
    from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
    from engine.execution.loader import load_model

    model, _ = load_model(DEFAULT_MODEL_DIR, dtype=dtype, device=device)
    head = model.random_mtp_head(11)
    layer = head.layer_index
    caches = model.allocate_caches(num_blocks=12, block_size=BLOCK_SIZE, num_state_slots=5,
                                   device=device, drafter_layers=(layer,))
    g = torch.Generator().manual_seed(3)
    for cache in (caches.key_cache[layer], caches.value_cache[layer]):
        cache.copy_(torch.randn(cache.shape, generator=g).to(device, dtype))
    chunks = [
        _chunk("a", 1, 5, (0,), 0),
        _chunk("b", 9, 12, (1, 2), 1),
        _chunk("c", 30, 40, (3, 4, 5, 6, 7), 2),
        _chunk("d", 1, 1, (8,), 3),  # position 1: its one key is its own
        _chunk("e", 17, 1, (9, 10), 4),
    ]
    batch = build_forward_batch(chunks, BLOCK_SIZE, device)
    batch = replace(batch, chunks=tuple(replace(c, first_key=1) for c in batch.chunks))
    plan = build_gpu_batch_plan(batch, BLOCK_SIZE, device)
    assert plan.first_key == 1
    previous = torch.randn(batch.num_tokens, model.config.hidden_size, generator=g).to(device, dtype)
    embedded = model.embed_tokens(batch.input_ids)
    rope = model.rotary(batch.positions - 1) if model.rotary is not None else None
    key_cache, value_cache = caches.key_cache[layer].clone(), caches.value_cache[layer].clone()
    with torch.inference_mode():
        got = head(embedded, previous, batch, caches, rope, plan)
        got_kv = caches.key_cache[layer].clone(), caches.value_cache[layer].clone()
        caches.key_cache[layer].copy_(key_cache)
        caches.value_cache[layer].copy_(value_cache)
        want = head(embedded, previous, batch, caches, rope)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert relative_error(got, want) <= tolerance
    for got_cache, want_cache in zip(got_kv, (caches.key_cache[layer], caches.value_cache[layer])):
        assert relative_error(got_cache, want_cache) <= tolerance
