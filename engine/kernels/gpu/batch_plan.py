"""The device-side view of one ForwardBatch, built once per forward pass on CUDA.

The CPU path reads the Python chunk list directly; the GPU kernels need the same facts as
device tensors (chunk boundaries, state slots, reset flags, block tables), split into the
decode chunks (one token each, served by one batched kernel call) and the prefill chunks
(several tokens, served by the varlen chunked scan and SDPA). All integer metadata travels in
one host-to-device copy.

Shapes: T tokens, S chunks, Bd decode chunks, Sp prefill chunks, Tp prefill tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.kernels.gpu.in_pass_capture import InPassCapturePlan


@dataclass(frozen=True)
class PrefillChunkView:
    """One prefill chunk as attention sees it: rows [start, end) of the flat token axis."""

    start: int
    end: int
    start_position: int
    block_table: torch.Tensor  # (num_blocks,) int64 on the device


@dataclass(frozen=True)
class GpuBatchPlan:
    """Device tensors describing a ForwardBatch; read-only once built.

    All chunks (conv kernels): cu_seqlens (S+1,), chunk_slot (S,), chunk_reset (S,),
    token_chunk (T,) = index of the chunk each token belongs to.
    Decode chunks: decode_rows (Bd,) token rows, decode_slots, decode_reset, decode_seq_lens
    (Bd,) = keys each query attends to, decode_block_table (Bd, max_blocks), zero padded.
    Prefill chunks: prefill_rows (Tp,) token rows (None when every row is a prefill row, in
    order), prefill_cu_seqlens (Sp+1,) over the prefill rows, prefill_slots, prefill_reset,
    and prefill_chunks for attention.
    """

    num_chunks: int
    cu_seqlens: torch.Tensor
    chunk_slot: torch.Tensor
    chunk_reset: torch.Tensor
    token_chunk: torch.Tensor
    num_decode: int
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    decode_reset: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_block_table: torch.Tensor
    num_prefill: int
    prefill_rows: torch.Tensor | None
    prefill_cu_seqlens: torch.Tensor
    prefill_cu_seqlens_host: torch.Tensor
    prefill_slots: torch.Tensor
    prefill_reset: torch.Tensor
    prefill_chunks: tuple[PrefillChunkView, ...]
    # In-pass captures of this step (engine/kernels/gpu/in_pass_capture.py); None: none.
    in_pass: InPassCapturePlan | None = None


def build_gpu_batch_plan(batch: ForwardBatch, block_size: int, device: torch.device) -> GpuBatchPlan:
    """Pack the batch's chunk metadata into one int64 tensor, copy it once, and slice views."""
    chunks, cu = batch.chunks, batch.cu_seqlens
    decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    prefill = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
    max_blocks = max(
        [-(-(chunks[i].start_position + 1) // block_size) for i in decode], default=0
    )
    prefill_rows: list[int] = []
    prefill_cu = [0]
    for i in prefill:
        prefill_rows.extend(range(cu[i], cu[i + 1]))
        prefill_cu.append(len(prefill_rows))
    rows_are_identity = len(prefill_rows) == batch.num_tokens

    fields: list[list[int]] = [
        list(cu),
        [c.state_slot for c in chunks],
        [int(c.reset_state) for c in chunks],
        [i for i, c in enumerate(chunks) for _ in range(c.num_tokens)],
        [cu[i] for i in decode],
        [chunks[i].state_slot for i in decode],
        [int(chunks[i].reset_state) for i in decode],
        [chunks[i].start_position + 1 for i in decode],
        [b for i in decode for b in _padded(chunks[i].block_table, max_blocks)],
        [] if rows_are_identity else prefill_rows,
        prefill_cu,
        [chunks[i].state_slot for i in prefill],
        [int(chunks[i].reset_state) for i in prefill],
    ]
    prefill_tables = [list(chunks[i].block_table[: -(-_tokens_after(chunks[i]) // block_size)]) for i in prefill]
    fields.extend(prefill_tables)
    packed = torch.tensor([v for f in fields for v in f], dtype=torch.int64).to(device, non_blocking=True)
    views = list(torch.split(packed, [len(f) for f in fields]))
    (cu_t, slot_t, reset_t, token_chunk, d_rows, d_slots, d_reset, d_lens, d_table,
     p_rows, p_cu, p_slots, p_reset) = views[:13]
    return GpuBatchPlan(
        num_chunks=len(chunks),
        cu_seqlens=cu_t,
        chunk_slot=slot_t,
        chunk_reset=reset_t,
        token_chunk=token_chunk,
        num_decode=len(decode),
        decode_rows=d_rows,
        decode_slots=d_slots,
        decode_reset=d_reset,
        decode_seq_lens=d_lens,
        decode_block_table=d_table.view(len(decode), max_blocks),
        num_prefill=len(prefill),
        prefill_rows=None if rows_are_identity else p_rows,
        prefill_cu_seqlens=p_cu,
        prefill_cu_seqlens_host=torch.tensor(prefill_cu, dtype=torch.int64),
        prefill_slots=p_slots,
        prefill_reset=p_reset,
        prefill_chunks=tuple(
            PrefillChunkView(cu[i], cu[i + 1], chunks[i].start_position, table)
            for i, table in zip(prefill, views[13:])
        ),
    )


def _tokens_after(chunk) -> int:
    """Tokens of the chunk's sequence once the chunk is computed."""
    return chunk.start_position + chunk.num_tokens


def _padded(values: tuple[int, ...], length: int) -> list[int]:
    values = list(values[:length])
    return values + [0] * (length - len(values))


def decode_only_plan(
    chunk_slot: torch.Tensor,  # (B,) int64 state slot of each row
    chunk_reset: torch.Tensor,  # (B,) int64, nonzero = start from a zero state
    seq_lens: torch.Tensor,  # (B,) int64, keys each row's query attends to
    block_table: torch.Tensor,  # (B, max_blocks) int64
    arange: torch.Tensor,  # (>= B + 1,) int64 holding 0, 1, 2, ...
) -> GpuBatchPlan:
    """The plan of a batch of B one-token chunks (row i = chunk i), built over tensors the
    caller owns and refills in place (CUDA graph inputs): no host-to-device copy, no allocation
    beyond two empty tensors. Equal to build_gpu_batch_plan of the same chunks."""
    num_rows = chunk_slot.shape[0]
    rows = arange[:num_rows]
    empty = arange[:0]
    return GpuBatchPlan(
        num_chunks=num_rows,
        cu_seqlens=arange[: num_rows + 1],
        chunk_slot=chunk_slot,
        chunk_reset=chunk_reset,
        token_chunk=rows,
        num_decode=num_rows,
        decode_rows=rows,
        decode_slots=chunk_slot,
        decode_reset=chunk_reset,
        decode_seq_lens=seq_lens,
        decode_block_table=block_table,
        num_prefill=0,
        prefill_rows=None,
        prefill_cu_seqlens=arange[:1],
        prefill_cu_seqlens_host=torch.zeros(1, dtype=torch.int64),
        prefill_slots=empty,
        prefill_reset=empty,
        prefill_chunks=(),
    )
