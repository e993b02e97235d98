"""The one-token chunks of a forward batch (its decode rows), laid out once per batch on the host
and read by every layer of the PyTorch path: the recurrent mixers take their state slots from
it, the attention layers their key rows. Built lazily by ForwardBatch.decode
(engine/interfaces/forward_batch.py), so a batch that never asks pays nothing and a batch
rebuilt with other chunks (dataclasses.replace) builds its own.

Order: the decode rows are listed in increasing state-slot order when their slots are exactly
one run slot_start .. slot_start + n - 1 (then a recurrent layer updates a view of its state
tensors in place instead of gathering and scattering them), in chunk order otherwise. Every
reader indexes by `rows`, so the order changes no result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.interfaces.host_index import int64_array, padded_rows


@dataclass
class DeferredWrites:
    """The cache writes of a decode pass that must not write the caches itself: a pass traced
    by torch.compile (engine/routes/cpu_decode.py), which would copy every cache tensor it saw
    written. The layers record what they would have written, in layer order, and the caller
    writes it after the pass (engine/routes/cpu_decode.py apply_deferred_writes).

    states: (slot tensor (num_slots, ...), the decode rows' new states (n, ...)) per recurrent
        layer and state kind, for DecodeRows.state_slots.
    kv: (key_cache, value_cache, key (n, Hkv, Dh), value) per attention layer, for the batch's
        slot_mapping.
    """

    states: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    kv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class DecodeKeys:
    """Where the decode rows' attention keys live, for one cache layout: the rows of the cache
    viewed as (num_blocks * block_size * Hkv, Dh) that hold key position s of KV head k of
    decode row i, and which positions are padding.

    rows: (n * Hkv * S,) int64, laid out as (n, Hkv, S), S = the longest row's blocks times
        block_size; a padding position reads a row of some block (finite, masked out).
    padding: (n, 1, 1, S) bool, True past a row's keys (broadcasts over (n, Hkv, G, S) scores).
    last: (n,) int64 each row's own position (its newest key, S > last).
    """

    rows: torch.Tensor
    padding: torch.Tensor
    width: int
    last: torch.Tensor


@dataclass(frozen=True)
class DecodeRows:
    """The batch's one-token chunks that are not verification chunks, n >= 1 of them.

    chunk_indices: their indices in batch.chunks, in this object's order (module doc).
    rows: (n,) int64 their flat token rows; identity: rows is 0 .. n-1 and n the batch's
        token count (every chunk a decode chunk, in this order): readers slice instead of
        gathering.
    state_slots: (n,) int64; slot_start: the slots are slot_start .. slot_start + n - 1 in
        this order (read_states returns views), None otherwise.
    resets: (r,) int64 the positions (0 .. n-1) whose chunk has reset_state, None when none
        has: their recurrence starts from zeros, whatever the slot holds (NaN too).
    first_key_zero: every chunk's first_key is 0 (attention may take the batched path).
    positions: the chunks' start positions (each attends to positions 0 .. position);
    block_tables: their block tables.
    deferred: None, or (a pass that must not write the caches, every chunk a decode row) where
        the layers record their cache writes instead of making them: read_states then always
        gathers, write_states records, and attention attends to the rows' new K/V in place
        of the cache's (DeferredWrites).
    """

    chunk_indices: tuple[int, ...]
    rows: torch.Tensor
    identity: bool
    state_slots: torch.Tensor
    slot_start: int | None
    resets: torch.Tensor | None
    first_key_zero: bool
    positions: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    deferred: DeferredWrites | None = None
    _keys: dict[tuple[int, int], DecodeKeys] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The decode rows of a (T, ...) per-token tensor: (n, ...), t itself when identity."""
        return t if self.identity else t.index_select(0, self.rows)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """out[rows] = values (n, ...) for a (T, ...) per-token tensor."""
        if self.identity:
            out.copy_(values)
        else:
            out.index_copy_(0, self.rows, values)

    def read_states(self, states: torch.Tensor) -> torch.Tensor:
        """The decode rows' slots of `states` (num_slots, ...): (n, ...), the reset rows zeroed.
        With slot_start set, a view of `states` (its reset slots zeroed in place: they are
        about to be overwritten), so updating it in place updates the slots; otherwise a
        gathered copy, which write_states puts back (always, with deferred writes)."""
        if self.slot_start is not None and self.deferred is None:
            view = states[self.slot_start : self.slot_start + self.num_rows]
            if self.resets is not None:
                view.index_fill_(0, self.resets, 0)
            return view
        gathered = states.index_select(0, self.state_slots)
        if self.resets is not None:
            gathered.index_fill_(0, self.resets, 0)
        return gathered

    def write_states(self, states: torch.Tensor, values: torch.Tensor) -> None:
        """Store the decode rows' new states (n, ...) in their slots of `states`: `values` is
        what read_states returned, advanced; a view (slot_start set) is there already. With
        deferred writes, recorded instead (DeferredWrites.states)."""
        if self.deferred is not None:
            self.deferred.states.append((states, values))
        elif self.slot_start is None:
            states.index_copy_(0, self.state_slots, values.to(states.dtype))

    def keys(self, block_size: int, num_kv_heads: int) -> DecodeKeys:
        """The rows' keys in a cache of `block_size` tokens a block and num_kv_heads heads,
        built on the first call for that layout and shared by every layer that asks again."""
        layout = (block_size, num_kv_heads)
        if layout not in self._keys:
            self._keys[layout] = decode_keys(self.block_tables, self.positions, block_size,
                                              num_kv_heads, self.rows.device)
        return self._keys[layout]


def decode_rows(chunks: Sequence, cu_seqlens: Sequence[int], device: torch.device) -> DecodeRows | None:
    """The DecodeRows of a batch's chunks (engine.interfaces.forward_batch.SequenceChunk), None
    when none is a one-token chunk outside verification."""
    indices = [i for i, chunk in enumerate(chunks)
               if chunk.num_tokens == 1 and not chunk.position_state_slots]
    if not indices:
        return None
    slots = [chunks[i].state_slot for i in indices]
    low = min(slots)
    slot_start = None
    if max(slots) - low == len(slots) - 1 and len(set(slots)) == len(slots):
        slot_start = low
        indices = sorted(indices, key=lambda i: chunks[i].state_slot)
        slots = sorted(slots)
    picked = [chunks[i] for i in indices]
    rows = [cu_seqlens[i] for i in indices]
    resets = [j for j, chunk in enumerate(picked) if chunk.reset_state]
    identity = rows == list(range(len(rows))) and cu_seqlens[-1] == len(rows)
    rows_t = torch.from_numpy(int64_array(rows)).to(device)
    return DecodeRows(
        chunk_indices=tuple(indices),
        rows=rows_t,
        identity=identity,
        state_slots=torch.from_numpy(int64_array(slots)).to(device),
        slot_start=slot_start,
        resets=torch.from_numpy(int64_array(resets)).to(device) if resets else None,
        first_key_zero=all(chunk.first_key == 0 for chunk in picked),
        positions=tuple(chunk.start_position for chunk in picked),
        block_tables=tuple(chunk.block_table for chunk in picked),
    )


def decode_keys(
    block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int,
    num_kv_heads: int, device: torch.device,
) -> DecodeKeys:
    """DecodeKeys of rows attending to keys 0 .. position each, S = the blocks of the longest
    row times block_size: one broadcast over whole blocks (a row's blocks past its table read
    block 0; every position past its keys is padding). ValueError when a block table does not
    cover its keys."""
    num_keys = int64_array(positions) + 1
    num_blocks = int(-(-num_keys.max() // block_size))
    needed = -(-num_keys // block_size)
    short = [i for i, table in enumerate(block_tables) if len(table) < needed[i]]
    if short:
        raise ValueError(f"block table {short[0]} has {len(block_tables[short[0]])} blocks, "
                         f"its {int(num_keys[short[0]])} keys need {int(needed[short[0]])}")
    tables = padded_rows(block_tables, num_blocks)  # (n, M)
    heads = np.arange(num_kv_heads, dtype=np.int64)[None, :, None, None]
    offsets = (np.arange(block_size, dtype=np.int64) * num_kv_heads)[None, None, None, :]
    # (n, Hkv, M, bs): row of (block, offset, head) in the cache viewed as (blocks * bs * Hkv, Dh)
    rows = tables[:, None, :, None] * (block_size * num_kv_heads) + offsets + heads
    width = num_blocks * block_size
    padding = np.arange(width, dtype=np.int64)[None, :] >= num_keys[:, None]  # (n, S)
    return DecodeKeys(
        rows=torch.from_numpy(rows.reshape(-1)).to(device),
        padding=torch.from_numpy(padding).to(device)[:, None, None, :],
        width=width,
        last=torch.from_numpy(num_keys - 1).to(device),
    )
