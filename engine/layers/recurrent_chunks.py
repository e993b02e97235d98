"""The recurrent mixers' PyTorch path over a batch of chunks, shared by Mamba2 and the gated
delta-net: the decode rows (engine/interfaces/decode_rows.py) in one batched step that advances
their state slots in place, every other chunk on its own (a prefill chunk through the mixer's
sequence scan, a verification chunk token by token into its scratch slots).

A mixer passed here has three methods over its per-token inputs (token_inputs, each (n, ...):
Mamba2's (xBC, dt_raw), the gated delta-net's (qkv, b, a)):
    mix_decode_(*inputs, conv (n, C, K-1), state (n, ...))  -> y; both states advanced in place
    mix_decode(*inputs, conv, state)                        -> (y, new conv, new state)
    mix_sequence(*inputs, conv (C, K-1), state (...))       -> (y, new conv, new state), one chunk
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.interfaces.decode_rows import DecodeRows
from engine.interfaces.forward_batch import ForwardBatch


def mix_chunks(
    mixer,
    token_inputs: Sequence[torch.Tensor],  # each (T, ...), pre-conv
    conv_state: torch.Tensor,  # (num_slots, C, K-1), the chunks' slots updated in place
    state: torch.Tensor,  # (num_slots, ...) fp32, the chunks' slots updated in place
    batch: ForwardBatch,
    row_shape: tuple[int, ...],  # y's shape per token
) -> torch.Tensor:
    """y (T, *row_shape) fp32 of every chunk of the batch, each continuing from its state slot
    (zeros where reset_state) and leaving the state after its last token there; a verification
    chunk (position_state_slots) reads its slot and leaves the state after each of its tokens
    in that token's scratch slot (engine/layers/verification.py mix_verification)."""
    decode = batch.decode
    if decode is not None and decode.identity:  # every chunk one token: one batched step
        return decode_step(mixer, token_inputs, conv_state, state, decode)
    num_tokens = token_inputs[0].shape[0]
    y = token_inputs[0].new_empty(num_tokens, *row_shape, dtype=torch.float32)
    batched: set[int] = set()
    if decode is not None:  # the one-token chunks in one batched step
        rows = [decode.take(t) for t in token_inputs]
        decode.put(y, decode_step(mixer, rows, conv_state, state, decode))
        batched = set(decode.chunk_indices)
    for index, (chunk, start, end) in enumerate(zip(batch.chunks, batch.cu_seqlens[:-1], batch.cu_seqlens[1:])):
        if index in batched:
            continue
        inputs = [t[start:end] for t in token_inputs]
        if chunk.position_state_slots:  # speculative verification: chunk.state_slot only read
            from engine.layers.verification import mix_verification

            y[start:end] = mix_verification(mixer.mix_decode, inputs, conv_state, state, chunk)
            continue
        slot = chunk.state_slot
        conv_in = torch.zeros_like(conv_state[slot]) if chunk.reset_state else conv_state[slot]
        state_in = torch.zeros_like(state[slot]) if chunk.reset_state else state[slot]
        y[start:end], conv_out, state_out = mixer.mix_sequence(*inputs, conv_in, state_in)
        conv_state[slot].copy_(conv_out)
        state[slot].copy_(state_out)
    return y


def decode_step(
    mixer,
    token_inputs: Sequence[torch.Tensor],  # each (n, ...): the decode rows' tokens, pre-conv
    conv_state: torch.Tensor,  # (num_slots, C, K-1), the rows' slots advanced
    state: torch.Tensor,  # (num_slots, ...) fp32, the rows' slots advanced
    decode: DecodeRows,
) -> torch.Tensor:
    """One token of every decode row from its slot (zeros for a reset row), through
    mixer.mix_decode_: on views of the slots where they are one run (DecodeRows.read_states),
    else on gathered copies scattered back. Returns y (n, ...) fp32."""
    conv, recurrent = decode.read_states(conv_state), decode.read_states(state)
    y = mixer.mix_decode_(*token_inputs, conv, recurrent)
    decode.write_states(conv_state, conv)
    decode.write_states(state, recurrent)
    return y
