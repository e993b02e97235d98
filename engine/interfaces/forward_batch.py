"""What one model forward pass sees: a flat batch of token chunks plus the cache tensors.

The worker builds a ForwardBatch from the scheduler's chunks (build_forward_batch); the model
reads it and writes the caches in place. Chunks are concatenated in order: chunk i covers rows
cu_seqlens[i]:cu_seqlens[i+1] of input_ids, positions and slot_mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.interfaces.decode_rows import DecodeRows, decode_rows
from engine.interfaces.host_index import concat_ranges, cumulative_bounds, flat_int64, int64_array, range_index, to_device
from engine.interfaces.step_io import ScheduledChunk


@dataclass(frozen=True)
class SequenceChunk:
    """One request's slice of the step.

    start_position: tokens of this sequence already held in its KV blocks and state slot.
    num_tokens: tokens fed in this step (1 for decode).
    block_table: KV block ids covering positions [0, start_position + num_tokens).
    state_slot: row of the recurrent state tensors owned by this request.
    reset_state: start the recurrence from zero (the first chunk of a prefill that restored
        nothing); otherwise continue from what the state slot holds.
    position_state_slots: a verification chunk (engine/speculative/verify.py): one scratch
        state slot per token, where the recurrent mixers write the state after that token,
        token by token, leaving state_slot as it was; empty for any other chunk.
    first_key: attention reads the keys of positions first_key .. on (the PyTorch path): 1 for
        the MTP drafter's layer, whose position 0 holds no key (engine/speculative/mtp.py).
    """

    state_slot: int
    start_position: int
    num_tokens: int
    block_table: tuple[int, ...]
    reset_state: bool
    position_state_slots: tuple[int, ...] = ()
    first_key: int = 0


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, absolute position of every token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64, block_id * block_size + offset where K/V are written
    chunks: tuple[SequenceChunk, ...]
    cu_seqlens: tuple[int, ...]  # (S + 1,) chunk boundaries in the flat token axis
    # The decode rows laid out by a route that builds them itself (engine/routes/cpu_decode.py,
    # whose batch has no chunks); None: built from `chunks` on first use (decode).
    decode_rows: DecodeRows | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def decode(self) -> DecodeRows | None:
        """The batch's one-token chunks, laid out once for every layer of the PyTorch path
        (engine/interfaces/decode_rows.py); None when it has none. decode_rows when given,
        else built from the chunks on first use and kept (a batch rebuilt with other chunks,
        dataclasses.replace, builds its own)."""
        if self.decode_rows is not None:
            return self.decode_rows
        if "_decode" not in self.__dict__:  # frozen: memoised beside the fields
            self.__dict__["_decode"] = decode_rows(self.chunks, self.cu_seqlens, self.input_ids.device)
        return self.__dict__["_decode"]


@dataclass
class ModelCaches:
    """The tensors that outlive a step, indexed by decoder layer index.

    key_cache[l], value_cache[l]: (num_blocks, block_size, num_kv_heads, head_dim), attention layers.
    conv_state[l]: (num_state_slots, conv_dim, conv_kernel - 1), the last conv inputs, Mamba layers.
    ssm_state[l]: (num_state_slots, num_heads, head_dim, state_size), fp32, Mamba layers.

    The stacks, when given, hold the same tensors stacked over layers (in increasing layer
    order), and the dict entries are views of them, so one copy moves a state slot or a KV block
    of every layer (engine/kernels/bundle_copy.py):
    conv_stack: (L_mamba, num_state_slots, conv_dim, K-1); ssm_stack: (L_mamba, ...) fp32;
    kv_stack: (2, L_attention, num_blocks, block_size, Hkv, Dh), [0] keys and [1] values.
    kv_scale[l]: (2, Hkv) fp32, attention layers, only when the KV blocks hold FP8
    (EngineConfig.kv_cache_dtype fp8_e4m3): the static key [0] and value [1] scale of each of the
    rank's KV heads (engine/parallel/kv_cache_format.py); empty when they hold the model dtype.
    Every writer and reader of key_cache / value_cache takes the layer's scale with them.
    If any dict entry is not the matching view of its stack (caches rebuilt per layer, as with
    dataclasses.replace), the stacks are dropped at construction and copies go layer by layer.
    """

    block_size: int
    key_cache: dict[int, torch.Tensor]
    value_cache: dict[int, torch.Tensor]
    conv_state: dict[int, torch.Tensor]
    ssm_state: dict[int, torch.Tensor]
    conv_stack: torch.Tensor | None = None
    ssm_stack: torch.Tensor | None = None
    kv_stack: torch.Tensor | None = None
    kv_scale: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def views_of(stack, layers: dict[int, torch.Tensor]) -> bool:
            return stack is not None and stack.shape[0] == len(layers) and all(
                t.data_ptr() == stack[j].data_ptr() and t.shape == stack[j].shape
                for j, (_, t) in enumerate(sorted(layers.items()))
            )

        if not (views_of(self.conv_stack, self.conv_state) and views_of(self.ssm_stack, self.ssm_state)):
            self.conv_stack = self.ssm_stack = None
        if self.kv_stack is None or not (
            views_of(self.kv_stack[0], self.key_cache) and views_of(self.kv_stack[1], self.value_cache)
        ):
            self.kv_stack = None

    def copy_state_slot(self, src_slot: int, dst_slot: int) -> None:
        """Copy one request's recurrent state (every Mamba layer) into another slot."""
        for layer, conv in self.conv_state.items():
            conv[dst_slot].copy_(conv[src_slot])
            self.ssm_state[layer][dst_slot].copy_(self.ssm_state[layer][src_slot])

    def read_state_slot(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A detached copy of one slot's state: layer -> (conv_state, ssm_state)."""
        return {
            layer: (conv[slot].clone(), self.ssm_state[layer][slot].clone())
            for layer, conv in self.conv_state.items()
        }

    def write_state_slot(self, slot: int, state: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Restore a state read by read_state_slot (of this rank's shard) into `slot`.

        Every Mamba layer must be present with this cache's per-slot shapes; ValueError otherwise."""
        if set(state) != set(self.conv_state):
            raise ValueError(
                f"state holds layers {sorted(state)}, caches hold {sorted(self.conv_state)}"
            )
        for layer, (conv, ssm) in state.items():
            conv_slot, ssm_slot = self.conv_state[layer][slot], self.ssm_state[layer][slot]
            if conv.shape != conv_slot.shape or ssm.shape != ssm_slot.shape:
                raise ValueError(f"layer {layer}: state shapes do not match this rank's slots")
            self.conv_state[layer][slot].copy_(conv)
            self.ssm_state[layer][slot].copy_(ssm)


def build_forward_batch(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device
) -> ForwardBatch:
    """Flatten chunks (each with at least one token) into one token axis with positions and
    KV write slots. A chunk whose block table does not cover its positions: ValueError."""
    lengths = int64_array([len(chunk.token_ids) for chunk in chunks])
    starts = int64_array([chunk.start_position for chunk in chunks])
    positions = concat_ranges(starts, lengths)
    slot_mapping = _kv_write_slots(chunks, starts, lengths, positions, block_size)
    input_ids = flat_int64(chunk.token_ids for chunk in chunks)
    sequence_chunks = tuple(
        SequenceChunk(
            state_slot=chunk.state_slot,
            start_position=chunk.start_position,
            num_tokens=len(chunk.token_ids),
            block_table=chunk.block_table,
            reset_state=chunk.reset_state,
        )
        for chunk in chunks
    )
    ids_t, positions_t, slot_mapping_t = to_device([input_ids, positions, slot_mapping], device)
    return ForwardBatch(
        input_ids=ids_t,
        positions=positions_t,
        slot_mapping=slot_mapping_t,
        chunks=sequence_chunks,
        cu_seqlens=tuple(cumulative_bounds(lengths).tolist()),
    )


def _kv_write_slots(
    chunks: list[ScheduledChunk], starts: np.ndarray, lengths: np.ndarray, positions: np.ndarray,
    block_size: int,
) -> np.ndarray:
    """(T,) the KV write slot of every token: block_table[p // block_size] * block_size +
    p % block_size, p its position and block_table its chunk's. ValueError as _written_blocks."""
    first_block = starts // block_size
    num_written = -(-(starts + lengths) // block_size) - first_block  # blocks each chunk writes into
    written = _written_blocks(chunks, first_block, num_written)
    chunk = range_index(lengths)
    # each token's block in `written`: where its chunk's blocks begin, plus its block's rank there
    block_index = cumulative_bounds(num_written)[chunk] + positions // block_size - first_block[chunk]
    return written[block_index] * block_size + positions % block_size


def _written_blocks(
    chunks: list[ScheduledChunk], first_block: np.ndarray, num_written: np.ndarray
) -> np.ndarray:
    """Blocks first_block[i] .. first_block[i] + num_written[i] - 1 of each chunk's block table,
    chunk after chunk. ValueError when a block table is too short."""
    written = [
        chunk.block_table[first : first + count]
        for chunk, first, count in zip(chunks, first_block.tolist(), num_written.tolist())
    ]
    for chunk, blocks, count in zip(chunks, written, num_written.tolist()):
        if len(blocks) != count:
            raise ValueError(
                f"request {chunk.request_id}: block table of {len(chunk.block_table)} blocks does not "
                f"cover positions up to {chunk.start_position + len(chunk.token_ids) - 1}"
            )
    return flat_int64(written)
