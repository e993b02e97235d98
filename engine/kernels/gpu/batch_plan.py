"""The device-side view of one ForwardBatch, built once per forward pass on CUDA.

The CPU path reads the Python chunk list directly; the GPU kernels need the same facts as
device tensors (chunk boundaries, state slots, reset flags, block tables), split into the
decode chunks (one token each, served by one batched kernel call) and the prefill chunks
(several tokens, served by the chunked scan and by the paged prefill-attention kernel, or SDPA
for a chunk that starts its sequence). All integer metadata travels in one host-to-device copy;
a CUDA graph builds its plan over its own static buffers instead (decode_only_plan,
single_prefill_plan).

Shapes: T tokens, S chunks, Bd decode chunks, Sp prefill chunks, Tp prefill tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.interfaces.forward_batch import ForwardBatch
from engine.interfaces.host_index import concat_ranges, cumulative_bounds, int64_array, padded_rows, range_index, to_device
from engine.kernels.gpu.in_pass_capture import (
    CaptureSplit, InPassCapturePlan, ScanChunks, build_in_pass_plan, scan_chunk_arrays,
)


# Decode-only steps of at most this many sequences take the Mamba mixers' fused conv + SSD
# kernel. On the H200 (benchmarks/decode_kernels.py, one layer's decode step) it is faster at
# batch 1 (4.6 vs 6.7 us) and 16 (19.3 vs 20.0 us) and slower at 64 (86.4 vs 83.1 us), where
# every one of its programs also convolves its group's B and C channels.
FUSED_DECODE_MAX_ROWS = 16


def kernel_choices(
    num_rows: int, num_decode: int, num_prefill: int, *, in_pass: bool, fold_gated_norm: bool
) -> dict[str, bool]:
    """GpuBatchPlan's kernel choices for a step of `num_rows` token rows (padding included),
    `num_decode` one-token and `num_prefill` longer chunks, with or without in-pass captures;
    fold_gated_norm: whether the model's Mamba mixers can fold their gated norm at one row
    (HybridModel.folds_gated_norm, engine/models/registry.py).
    - stacked_qkv: one row (where the single-row GEMM takes the stacked weight: the layer
      checks the operands, as linear() does);
    - fused_mamba_decode: no prefill chunk, no in-pass capture, at most FUSED_DECODE_MAX_ROWS
      decode chunks;
    - folded_gated_norm: that, at one row, and fold_gated_norm."""
    fused = num_prefill == 0 and not in_pass and num_decode <= FUSED_DECODE_MAX_ROWS
    return dict(
        stacked_qkv=num_rows == 1,
        fused_mamba_decode=fused,
        folded_gated_norm=fused and num_rows == 1 and fold_gated_norm,
    )


@dataclass(frozen=True)
class FreshChunkView:
    """A prefill chunk that starts its sequence: rows [start, end) of the flat token axis."""

    start: int
    end: int


@dataclass(frozen=True)
class GpuBatchPlan:
    """Device tensors describing a ForwardBatch; read-only once built.

    All chunks (conv kernels): cu_seqlens (S+1,), chunk_slot (S,), chunk_reset (S,),
    token_chunk (T,) = index of the chunk each token belongs to.
    Decode chunks: decode_rows (Bd,) token rows, decode_slots, decode_reset, decode_seq_lens
    (Bd,) = keys each query attends to, decode_block_table (Bd, max_blocks), zero padded.
    Prefill chunks: prefill_rows (Tp,) token rows (None when every row is a prefill row, in
    order), prefill_cu_seqlens (Sp+1,) over the prefill rows, prefill_slots, prefill_reset;
    prefill_scan_chunks: the scan's chunks when it has several sequences (its varlen path),
    None for one;
    prefill_valid (Tp,) bool, None when every prefill row is a real token: a CUDA graph's
    padded prefill, where the scan must leave the state unchanged over the padding rows.
    Prefill attention: fresh_chunks, the chunks that start their sequence, served by SDPA over
    their own K/V (outside graphs); every other prefill chunk goes to one paged kernel launch
    over paged_first_rows, paged_lengths (0 for a fresh chunk), paged_positions (Sp,) and
    paged_tables (Sp, max_blocks), at most paged_max_length queries each.
    Kernel choices, made once when the plan is built (kernel_choices) and read by the layers:
    stacked_qkv, attention projects q, k and v in one GEMM over its stacked weight;
    fused_mamba_decode, the Mamba mixers run the fused conv + SSD decode kernel instead of
    the chunked path; folded_gated_norm, they also fold their gated norm into that kernel and
    out_proj's single-row GEMM.
    first_key: the first key position both attention kernels read (SequenceChunk.first_key,
    the same for every chunk of the batch: 1 for the MTP drafter's layer, 0 otherwise).
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
    prefill_scan_chunks: ScanChunks | None
    prefill_slots: torch.Tensor
    prefill_reset: torch.Tensor
    fresh_chunks: tuple[FreshChunkView, ...]
    paged_first_rows: torch.Tensor
    paged_lengths: torch.Tensor
    paged_positions: torch.Tensor
    paged_tables: torch.Tensor
    paged_max_length: int
    stacked_qkv: bool
    fused_mamba_decode: bool
    folded_gated_norm: bool
    prefill_valid: torch.Tensor | None = None
    # In-pass captures of this step (engine/kernels/gpu/in_pass_capture.py); None: none.
    in_pass: InPassCapturePlan | None = None
    # Speculative verification chunks of this step, for the recurrent mixers
    # (engine/speculative/verify_gpu.py); None: none. The other fields describe every chunk.
    verification: VerificationPlan | None = None
    first_key: int = 0


def build_gpu_batch_plan(
    batch: ForwardBatch, block_size: int, device: torch.device, *, fold_gated_norm: bool = False
) -> GpuBatchPlan:
    """Pack the batch's chunk metadata into one int64 tensor, copy it once, and slice views.
    fold_gated_norm: as kernel_choices. ValueError (naming first_key) when the chunks' first_key
    differ, or a chunk starts before its first_key (a query with no key to read)."""
    chunks, cu = batch.chunks, batch.cu_seqlens
    first_key = _shared_first_key(chunks)
    cu_array = int64_array(cu)
    lengths = int64_array([c.num_tokens for c in chunks])
    starts = int64_array([c.start_position for c in chunks])
    slots = int64_array([c.state_slot for c in chunks])
    resets = int64_array([c.reset_state for c in chunks])
    decode = np.flatnonzero(lengths == 1)
    prefill = np.flatnonzero(lengths > 1)
    paged = starts[prefill] > 0  # (Sp,) bool: continues its sequence; else a fresh chunk
    decode_seq_lens = starts[decode] + 1
    max_blocks = _max_blocks(decode_seq_lens, block_size)
    paged_blocks = _max_blocks(starts[prefill] + lengths[prefill], block_size)
    prefill_rows = concat_ranges(cu_array[prefill], lengths[prefill])
    prefill_cu = cumulative_bounds(lengths[prefill])
    rows_are_identity = len(prefill_rows) == batch.num_tokens

    fields: list[np.ndarray] = [
        cu_array,
        slots,
        resets,
        range_index(lengths),
        cu_array[decode],
        slots[decode],
        resets[decode],
        decode_seq_lens,
        _block_tables(chunks, decode, max_blocks).ravel(),
        prefill_rows[:0] if rows_are_identity else prefill_rows,
        prefill_cu,
        slots[prefill],
        resets[prefill],
        cu_array[prefill],
        np.where(paged, lengths[prefill], 0),
        starts[prefill],
        _block_tables(chunks, prefill, paged_blocks).ravel(),
        *(scan_chunk_arrays(lengths[prefill]) if len(prefill) > 1 else [prefill[:0], prefill[:0]]),
    ]
    (cu_t, slot_t, reset_t, token_chunk, d_rows, d_slots, d_reset, d_lens, d_table,
     p_rows, p_cu, p_slots, p_reset, a_rows, a_lens, a_positions, a_tables,
     p_chunk_pairs, p_chunk_offsets) = to_device(fields, device)
    fresh = prefill[~paged].tolist()
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
        prefill_scan_chunks=ScanChunks(p_chunk_pairs.view(-1, 2), p_chunk_offsets) if len(prefill) > 1 else None,
        prefill_slots=p_slots,
        prefill_reset=p_reset,
        fresh_chunks=tuple(FreshChunkView(cu[i], cu[i + 1]) for i in fresh),
        paged_first_rows=a_rows,
        paged_lengths=a_lens,
        paged_positions=a_positions,
        paged_tables=a_tables.view(len(prefill), paged_blocks),
        paged_max_length=int(lengths[prefill][paged].max(initial=0)),
        **kernel_choices(batch.num_tokens, len(decode), len(prefill), in_pass=False,
                         fold_gated_norm=fold_gated_norm),
        first_key=first_key,
    )


def _shared_first_key(chunks) -> int:
    """The first_key every chunk shares (0 for no chunk): one scalar serves a whole kernel
    launch. ValueError when they differ, or when a chunk starts before it: its first query
    would have no key, and a chunk from position 0 goes to SDPA, which reads every key."""
    values = {chunk.first_key for chunk in chunks}
    if len(values) > 1:
        raise ValueError(f"chunks of one batch have different first_key values {sorted(values)}")
    first_key = values.pop() if values else 0
    early = [chunk.start_position for chunk in chunks if chunk.start_position < first_key]
    if early:
        raise ValueError(f"a chunk starts at position {early[0]}, before first_key {first_key}")
    return first_key


def _max_blocks(seq_lens: np.ndarray, block_size: int) -> int:
    """Blocks that hold the longest of the sequences (0 for none)."""
    blocks = -(-seq_lens // block_size)
    return int(blocks.max(initial=0))


def _block_tables(chunks, indices: np.ndarray, width: int) -> np.ndarray:
    """(len(indices), width): the block tables of chunks[indices], cut to width, zero padded."""
    return padded_rows([chunks[i].block_table for i in indices.tolist()], width)


def _no_decode_rows(empty: torch.Tensor) -> dict:
    """GpuBatchPlan's decode fields for a step without decode chunks (`empty`: a 0-length
    int64 tensor on the plan's device)."""
    return dict(num_decode=0, decode_rows=empty, decode_slots=empty, decode_reset=empty,
                decode_seq_lens=empty, decode_block_table=empty.view(0, 0))


def _no_prefill_rows(arange: torch.Tensor) -> dict:
    """GpuBatchPlan's prefill and prefill-attention fields for a step without prefill chunks,
    as views of `arange` (0, 1, 2, ...: no allocation)."""
    empty = arange[:0]
    return dict(num_prefill=0, prefill_rows=None, prefill_cu_seqlens=arange[:1],
                prefill_scan_chunks=None, prefill_slots=empty, prefill_reset=empty,
                fresh_chunks=(), paged_first_rows=empty, paged_lengths=empty,
                paged_positions=empty, paged_tables=empty.view(0, 0), paged_max_length=0)


def decode_only_plan(
    chunk_slot: torch.Tensor,  # (B,) int64 state slot of each row
    chunk_reset: torch.Tensor,  # (B,) int64, nonzero = start from a zero state
    seq_lens: torch.Tensor,  # (B,) int64, keys each row's query attends to
    block_table: torch.Tensor,  # (B, max_blocks) int64
    arange: torch.Tensor,  # (>= B + 1,) int64 holding 0, 1, 2, ...
    *,
    fold_gated_norm: bool = False,
) -> GpuBatchPlan:
    """The plan of a batch of B one-token chunks (row i = chunk i), built over tensors the
    caller owns and refills in place (CUDA graph inputs): no host-to-device copy, no allocation
    beyond two empty tensors. Equal to build_gpu_batch_plan of the same chunks (with the same
    fold_gated_norm)."""
    num_rows = chunk_slot.shape[0]
    rows = arange[:num_rows]
    return GpuBatchPlan(
        num_chunks=num_rows, cu_seqlens=arange[: num_rows + 1], chunk_slot=chunk_slot,
        chunk_reset=chunk_reset, token_chunk=rows,
        num_decode=num_rows, decode_rows=rows, decode_slots=chunk_slot, decode_reset=chunk_reset,
        decode_seq_lens=seq_lens, decode_block_table=block_table,
        **_no_prefill_rows(arange),
        **kernel_choices(num_rows, num_rows, 0, in_pass=False, fold_gated_norm=fold_gated_norm),
    )


def single_prefill_plan(
    cu_seqlens: torch.Tensor,  # (3,) int64: 0, n, padded size Tpad
    chunk_slot: torch.Tensor,  # (2,) int64: the chunk's state slot, then a scratch slot
    chunk_reset: torch.Tensor,  # (2,) int64: the chunk's reset flag, then 1
    token_chunk: torch.Tensor,  # (Tpad,) int64: 0 for the n real rows, 1 for the padding
    start_position: torch.Tensor,  # (1,) int64: position of the chunk's first token
    length: torch.Tensor,  # (1,) int64: n
    block_table: torch.Tensor,  # (1, max_blocks) int64
    scan_bounds: torch.Tensor,  # (2,) int64 on the device: 0, Tpad
    arange: torch.Tensor,  # (>= 2,) int64 holding 0, 1, ...
) -> GpuBatchPlan:
    """The plan of one prefill chunk of n tokens padded to Tpad rows, over tensors the caller
    owns and refills in place (CUDA graph inputs). The conv sees two chunks, the real one and
    the padding (which resets and writes only the scratch slot); the scan sees one sequence of
    Tpad rows whose padding rows are invalid (dt = 0 there, so the final state is the state
    after token n); attention serves the n real queries through the paged kernel."""
    num_rows = token_chunk.shape[0]
    return GpuBatchPlan(
        num_chunks=2, cu_seqlens=cu_seqlens, chunk_slot=chunk_slot, chunk_reset=chunk_reset,
        token_chunk=token_chunk,
        **_no_decode_rows(arange[:0]),
        num_prefill=1, prefill_rows=None, prefill_cu_seqlens=scan_bounds, prefill_scan_chunks=None,
        prefill_slots=chunk_slot[:1], prefill_reset=chunk_reset[:1], prefill_valid=token_chunk == 0,
        fresh_chunks=(), paged_first_rows=arange[:1], paged_lengths=length,
        paged_positions=start_position, paged_tables=block_table, paged_max_length=num_rows,
        **kernel_choices(num_rows, 0, 1, in_pass=False, fold_gated_norm=False),
    )


def verification_only_plan(
    cu_seqlens: torch.Tensor,  # (b+1,) int64: 0, n, 2n, ..., b n
    chunk_slot: torch.Tensor,  # (b,) int64: each chunk's state slot (only read)
    no_reset: torch.Tensor,  # (b,) int64 zeros
    lengths: torch.Tensor,  # (b,) int64: n each
    start_positions: torch.Tensor,  # (b,) int64: position of each chunk's first row
    block_table: torch.Tensor,  # (b, max_blocks) int64
    max_length: int,  # n
    verification: VerificationPlan,  # its rest None
) -> GpuBatchPlan:
    """The plan of b speculative verification chunks of n rows each (row v n + i: position i of
    chunk v), over tensors the caller owns and refills in place (CUDA graph inputs,
    engine/speculative/verify_graphs.py): attention serves every chunk through the paged
    prefill kernel (each continues from its cached KV), the recurrent mixers through
    `verification`; no decode chunk, no scan."""
    num_chunks = chunk_slot.shape[0]
    num_rows = num_chunks * max_length
    token_chunk = torch.arange(num_rows, dtype=torch.int64, device=chunk_slot.device) // max_length
    return GpuBatchPlan(
        num_chunks=num_chunks, cu_seqlens=cu_seqlens, chunk_slot=chunk_slot, chunk_reset=no_reset,
        token_chunk=token_chunk,
        **_no_decode_rows(no_reset[:0]),
        num_prefill=num_chunks, prefill_rows=None, prefill_cu_seqlens=cu_seqlens, prefill_scan_chunks=None,
        prefill_slots=chunk_slot, prefill_reset=no_reset, fresh_chunks=(),
        paged_first_rows=cu_seqlens[:-1], paged_lengths=lengths, paged_positions=start_positions,
        paged_tables=block_table, paged_max_length=max_length,
        **kernel_choices(num_rows, 0, num_chunks, in_pass=False, fold_gated_norm=False),
        verification=verification,
    )


@dataclass(frozen=True)
class VerificationIndex:
    """Where the verification chunks' positions are, on the host. V chunks, n = the longest
    length: chunk v's rows first_rows[v] .. first_rows[v] + lengths[v] - 1 (V,) each;
    source_slots (V,) the chunks' own state slots (only read); scratch_slots (n, V) the
    scratch slot of position i of chunk v (all n of the chunk's own; those past its length
    are not written)."""

    first_rows: np.ndarray
    lengths: np.ndarray
    source_slots: np.ndarray
    scratch_slots: np.ndarray


@dataclass(frozen=True)
class VerificationPlan:
    """The recurrent mixers' view of a step with verification chunks (GpuBatchPlan.verification),
    device tensors of a VerificationIndex, the arguments of the one-pass verification kernels
    (engine/kernels/gpu/mamba_verify.py, delta_rule_verify.py).

    rest: the plan of the step's other chunks, rows [0, num_rest_rows) (None when there are
    none); first_rows, lengths, source_slots (V,) and scratch_slots (n, V), int64, each
    16-byte aligned (to_device)."""

    rest: GpuBatchPlan | None
    num_rest_rows: int
    first_rows: torch.Tensor
    lengths: torch.Tensor
    source_slots: torch.Tensor
    scratch_slots: torch.Tensor


def build_verification_plan(index: VerificationIndex, rest: GpuBatchPlan | None, num_rest_rows: int,
                            device: torch.device) -> VerificationPlan:
    """VerificationPlan of `index`, its tensors in one host-to-device copy."""
    first_rows, lengths, sources, scratch = to_device(
        [index.first_rows, index.lengths, index.source_slots, index.scratch_slots.ravel()], device)
    return VerificationPlan(
        rest=rest, num_rest_rows=num_rest_rows, first_rows=first_rows, lengths=lengths,
        source_slots=sources, scratch_slots=scratch.view(index.scratch_slots.shape),
    )


def with_in_pass_captures(plan, batch, splits: dict[int, int], conv_out, ssm_out):
    """`plan` (a GpuBatchPlan of `batch`) with the in-pass captures `splits` (chunk index ->
    tokens of the chunk before the capture position) and their output buffers attached, and
    its kernel choices made again for a step with in-pass captures."""
    cu = batch.cu_seqlens
    prefill = [(i, cu[i], c.num_tokens) for i, c in enumerate(batch.chunks) if c.num_tokens > 1]
    capture_splits = [
        CaptureSplit(i, cu[i], splits[i], batch.chunks[i].state_slot, batch.chunks[i].reset_state)
        for i, _, _ in prefill if i in splits
    ]
    device = plan.cu_seqlens.device
    choices = kernel_choices(batch.num_tokens, plan.num_decode, plan.num_prefill, in_pass=True, fold_gated_norm=False)
    in_pass = build_in_pass_plan(prefill, capture_splits, conv_out, ssm_out, device)
    return replace(plan, in_pass=in_pass, **choices)
