"""A chunk with reset_state must not read its state slot at all: slots are reused, and a
reset slot may hold anything (NaN included), also for one-token (decode-path) chunks."""

from __future__ import annotations

import torch

from engine.engine_config import DEFAULT_MODEL_DIR
from engine.execution.loader import load_model
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk
from engine.interfaces.forward_batch import build_forward_batch


def _chunk(slot: int, tokens: list[int], first_block: int) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=f"r{slot}", token_ids=tuple(tokens), start_position=0,
        block_table=(first_block,), state_slot=slot, reset_state=True, sample=True,
        sampling=SamplingParams(),
    )


def test_reset_chunks_ignore_garbage_in_their_slots():
    model, _ = load_model(DEFAULT_MODEL_DIR)
    chunks = [_chunk(0, [5], 0), _chunk(1, [9, 17, 33], 1)]  # a one-token and a longer prefill
    with torch.inference_mode():
        clean = model.allocate_caches(num_blocks=4, block_size=16, num_state_slots=2)
        expected = model(build_forward_batch(chunks, 16, torch.device("cpu")), clean)
        poisoned = model.allocate_caches(num_blocks=4, block_size=16, num_state_slots=2)
        for layer in poisoned.conv_state:
            poisoned.conv_state[layer].fill_(float("nan"))
            poisoned.ssm_state[layer].fill_(float("nan"))
        actual = model(build_forward_batch(chunks, 16, torch.device("cpu")), poisoned)
    assert torch.isfinite(actual).all()
    assert torch.equal(actual, expected)
    for layer in clean.ssm_state:
        assert torch.equal(poisoned.ssm_state[layer], clean.ssm_state[layer])
