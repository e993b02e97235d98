"""The host-side batch builder build_forward_batch against a per-token oracle written here from
its contract, over random mixes of chunks: decode chunks of one token, prefill chunks that start their sequence or continue it, several
block sizes, reset flags, distinct state slots, block tables longer than a chunk needs. CPU only."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceChunk
from engine.sampling_params import SamplingParams
from engine.step_io import ScheduledChunk
from engine.worker import build_forward_batch

CPU = torch.device("cpu")
BLOCK_SIZES = (1, 3, 16, 64)
SEEDS = range(60)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _random_chunks(rng: random.Random, block_size: int) -> list[ScheduledChunk]:
    """1..8 chunks, all decode, all prefill or mixed; each with a block table covering its
    positions plus 0..3 spare blocks, and its own state slot."""
    mix = rng.choice(["decode", "prefill", "mixed"])
    num_chunks = rng.randint(1, 8)
    slots = rng.sample(range(64), num_chunks)
    chunks = []
    for i in range(num_chunks):
        kind = {"decode": "decode", "prefill": rng.choice(["fresh", "continued"])}.get(
            mix, rng.choice(["decode", "fresh", "continued"]))
        if kind == "decode":
            num_tokens, start = 1, rng.randint(0, 300)
        elif kind == "fresh":
            num_tokens, start = rng.randint(2, 300), 0
        else:
            num_tokens, start = rng.randint(2, 300), rng.randint(1, 500)
        num_blocks = _ceil_div(start + num_tokens, block_size) + rng.randint(0, 3)
        chunks.append(ScheduledChunk(
            request_id=f"r{i}",
            token_ids=tuple(rng.randrange(50_000) for _ in range(num_tokens)),
            start_position=start,
            block_table=tuple(rng.sample(range(100_000), num_blocks)),
            state_slot=slots[i],
            reset_state=rng.random() < 0.5,
            sample=True,
            sampling=SamplingParams(),
        ))
    return chunks


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _assert_same_tensor(actual: torch.Tensor | None, expected: torch.Tensor | None, name: str) -> None:
    if expected is None:
        assert actual is None, name
        return
    assert actual.dtype == torch.int64 and actual.device == CPU, name
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), name


# --- build_forward_batch ---------------------------------------------------------------------


def _forward_batch_oracle(chunks: list[ScheduledChunk], block_size: int) -> ForwardBatch:
    input_ids, positions, slots, cu = [], [], [], [0]
    for chunk in chunks:
        for offset, token in enumerate(chunk.token_ids):
            position = chunk.start_position + offset
            input_ids.append(token)
            positions.append(position)
            slots.append(chunk.block_table[position // block_size] * block_size + position % block_size)
        cu.append(len(input_ids))
    return ForwardBatch(
        input_ids=_int64(input_ids),
        positions=_int64(positions),
        slot_mapping=_int64(slots),
        chunks=tuple(
            SequenceChunk(c.state_slot, c.start_position, len(c.token_ids), c.block_table, c.reset_state)
            for c in chunks
        ),
        cu_seqlens=tuple(cu),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_forward_batch_matches_the_per_token_oracle(seed):
    rng = random.Random(seed)
    block_size = rng.choice(BLOCK_SIZES)
    chunks = _random_chunks(rng, block_size)
    batch = build_forward_batch(chunks, block_size, CPU)
    want = _forward_batch_oracle(chunks, block_size)
    for name in ("input_ids", "positions", "slot_mapping"):
        _assert_same_tensor(getattr(batch, name), getattr(want, name), name)
    assert batch.chunks == want.chunks
    assert batch.cu_seqlens == want.cu_seqlens and all(type(v) is int for v in batch.cu_seqlens)


def test_forward_batch_rejects_a_block_table_that_does_not_cover_the_chunk():
    rng = random.Random(0)
    chunk = _random_chunks(rng, 16)[0]
    short = replace(chunk, start_position=40, token_ids=(5, 6, 7, 8, 9), block_table=(3, 4, 5))
    assert build_forward_batch([short], 16, CPU).slot_mapping.tolist() == [5 * 16 + 8 + k for k in range(5)]
    too_short = replace(short, token_ids=tuple(range(9)))  # position 48 needs a fourth block
    with pytest.raises(ValueError):
        build_forward_batch([short, too_short], 16, CPU)
