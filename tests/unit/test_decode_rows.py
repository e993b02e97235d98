"""DecodeRows: how a batch's one-token chunks are laid out once for every layer (row order,
state-slot views or gathers, reset rows, attention key rows)."""

from __future__ import annotations

import torch

from engine.interfaces.decode_rows import decode_keys, decode_rows
from engine.interfaces.forward_batch import SequenceChunk

CPU = torch.device("cpu")


def _chunk(slot: int, num_tokens: int = 1, position: int = 5, reset: bool = False, **extra) -> SequenceChunk:
    return SequenceChunk(state_slot=slot, start_position=position, num_tokens=num_tokens,
                         block_table=(slot, 10 + slot), reset_state=reset, **extra)


def _bounds(chunks) -> tuple[int, ...]:
    bounds = [0]
    for chunk in chunks:
        bounds.append(bounds[-1] + chunk.num_tokens)
    return tuple(bounds)


def test_one_run_of_slots_is_listed_in_slot_order_and_read_as_a_view():
    chunks = [_chunk(3), _chunk(7, num_tokens=4), _chunk(2), _chunk(4, reset=True)]
    rows = decode_rows(chunks, _bounds(chunks), CPU)
    assert rows.chunk_indices == (2, 0, 3) and rows.rows.tolist() == [5, 0, 6]
    assert rows.slot_start == 2 and rows.state_slots.tolist() == [2, 3, 4]
    assert not rows.identity and rows.resets.tolist() == [2]
    states = torch.arange(8.0)[:, None].repeat(1, 3)
    states[4] = float("nan")  # a reset row's slot may hold anything
    view = rows.read_states(states)
    assert view.data_ptr() == states[2].data_ptr()  # updating it updates the slots
    assert view[:, 0].tolist() == [2.0, 3.0, 0.0]
    view += 1
    rows.write_states(states, view)
    assert states[:, 0].tolist() == [0, 1, 3, 4, 1, 5, 6, 7]


def test_scattered_slots_are_gathered_and_written_back():
    chunks = [_chunk(5), _chunk(1, reset=True), _chunk(3)]
    rows = decode_rows(chunks, _bounds(chunks), CPU)
    assert rows.identity and rows.slot_start is None
    assert rows.chunk_indices == (0, 1, 2) and rows.state_slots.tolist() == [5, 1, 3]
    states = torch.arange(6.0)[:, None].repeat(1, 2)
    states[1] = float("nan")
    gathered = rows.read_states(states)
    assert gathered.data_ptr() != states.data_ptr() and gathered[:, 0].tolist() == [5.0, 0.0, 3.0]
    rows.write_states(states, gathered * 10)
    assert states[:, 0].tolist() == [0, 0, 2, 30, 4, 50]


def test_verification_and_prefill_chunks_are_not_decode_rows():
    chunks = [_chunk(0, num_tokens=3), _chunk(1, num_tokens=1, position_state_slots=(6,))]
    assert decode_rows(chunks, _bounds(chunks), CPU) is None
    mtp = [_chunk(0, first_key=1), _chunk(1)]
    assert not decode_rows(mtp, _bounds(mtp), CPU).first_key_zero


def test_key_rows_address_every_key_of_every_head():
    """Row (i, h, s) of DecodeKeys is the cache row of key position s of KV head h of decode
    row i in the cache viewed as (blocks * block_size * Hkv, Dh); positions past a row's keys
    are padding."""
    block_size, heads = 4, 3
    tables, positions = [(7, 2, 9), (4,)], [9, 2]  # 10 and 3 keys
    keys = decode_keys(tables, positions, block_size, heads, CPU)
    assert keys.width == 12
    rows = keys.rows.view(2, heads, keys.width)
    for i, (table, position) in enumerate(zip(tables, positions)):
        for s in range(position + 1):
            for h in range(heads):
                slot = table[s // block_size] * block_size + s % block_size
                assert rows[i, h, s] == slot * heads + h
        assert keys.padding[i, 0, 0].tolist() == [s > position for s in range(keys.width)]
