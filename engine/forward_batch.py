"""What one model forward pass sees: a flat batch of token chunks plus the cache tensors.

The runner builds a ForwardBatch from the scheduler's output; the model reads it and writes
the caches in place. Chunks are concatenated in order: chunk i covers rows
cu_seqlens[i]:cu_seqlens[i+1] of input_ids, positions and slot_mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceChunk:
    """One request's slice of the step.

    start_position: tokens of this sequence already held in its KV blocks and state slot.
    num_tokens: tokens fed in this step (1 for decode).
    block_table: KV block ids covering positions [0, start_position + num_tokens).
    state_slot: row of the recurrent state tensors owned by this request.
    reset_state: start the recurrence from zero (the first chunk of a prefill that restored
        nothing); otherwise continue from what the state slot holds.
    """

    state_slot: int
    start_position: int
    num_tokens: int
    block_table: tuple[int, ...]
    reset_state: bool


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, absolute position of every token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64, block_id * block_size + offset where K/V are written
    chunks: tuple[SequenceChunk, ...]
    cu_seqlens: tuple[int, ...]  # (S + 1,) chunk boundaries in the flat token axis

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


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
