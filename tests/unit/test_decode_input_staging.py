"""The host packing of decode graph inputs (engine/routes/decode_graphs.py:DecodeInputStaging) against the
obvious per-row oracle, over steps whose batches grow, shrink, keep requests in their rows
across block boundaries and hand rows to other requests, some rows fed a pending token (read
from the previous step's sampled row); and the graph's copy of the buffer, which receives only
the prefix a step's size reads."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.routes.decode_graphs import DecodeInputStaging
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk

BLOCK_SIZE, MAX_BATCH, MAX_BLOCKS = 4, 8, 12
SCRATCH_SLOT, SCRATCH_BLOCK = 99, 77
NUM_SAMPLED = 10  # sampled-token rows ahead of the buffer in the graph's token pool


def _chunk(request: int, token: int, position: int, blocks: tuple[int, ...], reset: bool) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=(token,), start_position=position, block_table=blocks,
        state_slot=request, reset_state=reset, sample=True, sampling=SamplingParams(),
    )


def _check_rows(
    staging: DecodeInputStaging, chunks: list[ScheduledChunk], size: int, pending_rows: dict[str, int],
) -> None:
    fields, table = staging.views()
    for i, c in enumerate(chunks):
        p = c.start_position
        used = p // BLOCK_SIZE + 1
        pending = c.token_ids[0] == PENDING_TOKEN
        assert fields[:, i].tolist() == [
            0 if pending else c.token_ids[0], p, c.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE,
            c.state_slot, int(c.reset_state), p + 1,
            pending_rows[c.request_id] if pending else NUM_SAMPLED + i,
        ], f"row {i} fields"
        assert table[i, :used].tolist() == list(c.block_table[:used]), f"row {i} blocks"
    for i in range(len(chunks), size):
        assert fields[:, i].tolist() == [
            0, 0, SCRATCH_BLOCK * BLOCK_SIZE, SCRATCH_SLOT, 1, 1, NUM_SAMPLED + i,
        ], f"padding row {i}"
        assert table[i, 0] == SCRATCH_BLOCK, f"padding row {i} block"


def test_staging_matches_per_row_oracle():
    rng = random.Random(0)
    buffer = np.full(DecodeInputStaging.width(MAX_BATCH, MAX_BLOCKS), -5, dtype=np.int64)
    staging = DecodeInputStaging(buffer, MAX_BATCH, MAX_BLOCKS, BLOCK_SIZE, SCRATCH_SLOT, SCRATCH_BLOCK, NUM_SAMPLED)
    # what the graph's input buffer holds when each step copies only staging.used_length(size)
    device = np.full_like(buffer, -7)
    device_view = DecodeInputStaging(device, MAX_BATCH, MAX_BLOCKS, BLOCK_SIZE, SCRATCH_SLOT, SCRATCH_BLOCK, NUM_SAMPLED)
    num_requests = 12
    # each request's blocks, in a fresh tuple every step as the scheduler builds them
    blocks = {r: rng.sample(range(60), MAX_BLOCKS) for r in range(num_requests)}
    positions = {r: rng.randrange(0, 20) for r in range(num_requests)}
    # (requests in row order, padded size): the same rows for several steps (crossing block
    # boundaries), a shrink that pads rows the next step fills again, rows handed to others
    steps = [
        ([0, 1, 2], 4), ([0, 1, 2], 4), ([0, 1, 2], 4), ([0, 1, 2], 4), ([0, 1, 2], 4),
        ([0], 4), ([0, 1, 2, 3, 4], 8), ([5, 1, 2, 3, 4, 6, 7, 8], 8), ([5, 1, 2, 3, 4, 6, 7, 8], 8),
        ([9, 10], 2), ([1, 2, 3], 4), ([11, 2, 3, 1], 4),
    ]
    for step, (requests, size) in enumerate(steps):
        # from step 2 on, every other request's token is pending (sampled by the step before)
        pending = {f"r{r}" for r in requests if step >= 2 and r % 2 == 0}
        pending_rows = {request_id: rng.randrange(NUM_SAMPLED) for request_id in pending}
        chunks = [
            _chunk(r, PENDING_TOKEN if f"r{r}" in pending else rng.randrange(1000), positions[r],
                   tuple(blocks[r]), reset=(step == 6 and r == 3))
            for r in requests
        ]
        staging.stage(chunks, size, pending_rows)
        _check_rows(staging, chunks, size, pending_rows)
        used = staging.used_length(size)
        device[:used] = buffer[:used]
        _check_rows(device_view, chunks, size, pending_rows)
        for r in requests:
            positions[r] += 1
    assert max(positions.values()) // BLOCK_SIZE > 3, "the steps never crossed a block boundary"


def test_a_block_table_that_does_not_cover_the_position_is_refused():
    buffer = np.zeros(DecodeInputStaging.width(MAX_BATCH, MAX_BLOCKS), dtype=np.int64)
    staging = DecodeInputStaging(buffer, MAX_BATCH, MAX_BLOCKS, BLOCK_SIZE, SCRATCH_SLOT, SCRATCH_BLOCK, NUM_SAMPLED)
    covered = _chunk(0, 5, 2 * BLOCK_SIZE - 1, (3, 4), reset=False)  # last key of block 4
    staging.stage([covered], 1)
    _check_rows(staging, [covered], 1, {})
    short = _chunk(0, 5, 2 * BLOCK_SIZE, (3, 4), reset=False)  # needs a third block
    with pytest.raises(ValueError, match="does not cover position"):
        staging.stage([short], 1)


def test_a_pending_token_the_previous_step_did_not_sample_is_refused():
    buffer = np.zeros(DecodeInputStaging.width(MAX_BATCH, MAX_BLOCKS), dtype=np.int64)
    staging = DecodeInputStaging(buffer, MAX_BATCH, MAX_BLOCKS, BLOCK_SIZE, SCRATCH_SLOT, SCRATCH_BLOCK, NUM_SAMPLED)
    pending = _chunk(0, PENDING_TOKEN, 3, (3,), reset=False)
    with pytest.raises(ValueError, match="sampled none"):
        staging.stage([pending], 1, {"r1": 0})
