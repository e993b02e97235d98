"""In-pass capture: the recurrent state at a position p strictly inside a prefill chunk, read
during that chunk's one forward pass instead of cutting the chunk at p.

For a chunk whose first k tokens lie before p (0 < k < its length):
- SSM state at p: the chunked scan stores the state at the start of every chunk of SCAN_CHUNK
  rows it walks. The scan sees the chunk's sequence front-padded with (-k) mod SCAN_CHUNK
  identity rows (q = k = v = 0, g = 0: decay 1, no input, and no later row attends to them), so
  p falls on a chunk edge and the state there is one of those stored states. The padding
  changes neither the chunk's outputs nor its final state (up to the scan's rounding: its chunks
  now start at p, as the split path's second step does); one scan call, nothing to correct.
- conv state at p: the K-1 pre-conv inputs before p, from the chunk's rows where k >= K-1,
  else completed on the left by the chunk's old conv state (zeros if it resets).
Outputs and final states are those of the uncut chunk; the captured states are those the split
path (two steps, the chunk cut at p) leaves in the slot, up to the scan's rounding.

The gated delta-net takes its recurrent state at p another way, from the same plan (its `split`:
engine/kernels/gpu/delta_rule_capture.py), and its conv state at p as above.

Shapes: T tokens, Tp prefill rows, Ts scan rows (prefill rows and padding), Sp prefill chunks,
Sc captures, NS scan chunks, L_m Mamba layers, C conv channels, H heads, P head dim, N state size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.interfaces.host_index import chunk_pairs, concat_ranges, cumulative_bounds, int64_array, to_device
from engine.kernels.gpu.delta_rule_capture import SplitPrefill, split_prefill, split_prefill_arrays


@dataclass(frozen=True)
class CaptureSplit:
    """One capture: chunk `chunk` of the batch (row `start` first), split after `split` tokens."""

    chunk: int
    start: int
    split: int
    state_slot: int
    reset_state: bool


SCAN_CHUNK = 64  # rows per chunk of the chunked scan (fla-core's chunk size): its state edges


@dataclass(frozen=True)
class ScanChunks:
    """The SCAN_CHUNK-row chunks of a scan over several sequences (its varlen path), on the
    device, built on the host with the step's other indices (scan_chunk_arrays) so that the
    scan never reads them back: indices (NS, 2), the (sequence, chunk of it) pair of each chunk
    in order (fla-core's chunk_indices); offsets (Sp+1,), the first chunk of each sequence and NS."""

    indices: torch.Tensor
    offsets: torch.Tensor

    @property
    def count(self) -> int:
        """NS, known on the host from the shape."""
        return self.indices.shape[0]


def scan_chunk_arrays(lengths: np.ndarray) -> list[np.ndarray]:
    """[indices flattened (2 NS,), offsets (Sp+1,)]: ScanChunks' arrays for sequences of `lengths`
    rows, to copy to the device with the step's other arrays (ScanChunks(indices.view(-1, 2),
    offsets))."""
    return [chunk_pairs(lengths, SCAN_CHUNK), cumulative_bounds(-(-lengths // SCAN_CHUNK))]


@dataclass(frozen=True)
class InPassCapturePlan:
    """The scan's rows with each captured chunk front-padded (Mamba2), the two calls of the
    gated delta rule (split), and where each recurrent layer writes what it captures.

    scan_rows (Ts,): token row of each scan row, -1 for a padding row; scan_cu (Sp+1,) over the
    scan rows; scan_chunks: ScanChunks of the scan when it has several sequences, None for one;
    out_rows (Tp,): scan row of each prefill row, and
    out_start: the first of them when they are one run of consecutive rows (one prefill
    sequence: the outputs are then a view, not a gathered copy), else None;
    capture_chunks (Sc,): per capture, the scan chunk that starts at its position;
    split: the gated delta rule's heads and tails calls (delta_rule_capture.SplitPrefill);
    conv_out[layer] (Sc, C, K-1) and ssm_out[layer] (Sc, *recurrent slot) fp32, the layer's
    state-slot shapes (Mamba2 (H, P, N), gated delta-net (Hv, dk, dv)): written by the layer.
    """

    splits: tuple[CaptureSplit, ...]
    scan_rows: torch.Tensor
    scan_cu: torch.Tensor
    scan_chunks: ScanChunks | None
    out_rows: torch.Tensor
    out_start: int | None
    capture_chunks: torch.Tensor
    split: SplitPrefill
    conv_out: dict[int, torch.Tensor]
    ssm_out: dict[int, torch.Tensor]


def build_in_pass_plan(
    prefill: list[tuple[int, int, int]],  # (chunk index, first token row, num tokens) of every prefill chunk
    splits: list[CaptureSplit],  # in the prefill chunks' order
    conv_out: dict[int, torch.Tensor],
    ssm_out: dict[int, torch.Tensor],
    device: torch.device,
) -> InPassCapturePlan:
    """The plan of `splits` over the prefill chunks. ValueError: a split not strictly inside
    its chunk, or naming a chunk that is not a prefill chunk."""
    pads, capture_chunks = _front_padding(prefill, splits)
    first_rows = int64_array([first_row for _, first_row, _ in prefill])
    lengths = int64_array([num_tokens for _, _, num_tokens in prefill])
    scan_cu = cumulative_bounds(pads + lengths)
    out_rows = concat_ranges(scan_cu[:-1] + pads, lengths)
    scan_rows = np.full(int(scan_cu[-1]), -1, dtype=np.int64)
    scan_rows[out_rows] = concat_ranges(first_rows, lengths)
    several = len(prefill) > 1
    chunks = scan_chunk_arrays(pads + lengths) if several else [pads[:0], pads[:0]]
    split = split_prefill_arrays(prefill, [(s.chunk, s.split) for s in splits])
    scan_rows_t, scan_cu_t, out_rows_t, capture_chunks_t, pairs_t, offsets_t, *split_t = to_device(
        [scan_rows, scan_cu, out_rows, capture_chunks, *chunks, *split], device
    )
    return InPassCapturePlan(
        splits=tuple(splits),
        scan_rows=scan_rows_t,
        scan_cu=scan_cu_t,
        scan_chunks=ScanChunks(pairs_t.view(-1, 2), offsets_t) if several else None,
        out_rows=out_rows_t,
        out_start=_start_of_one_run(out_rows),
        capture_chunks=capture_chunks_t,
        split=split_prefill(split_t),
        conv_out=conv_out,
        ssm_out=ssm_out,
    )


def _front_padding(
    prefill: list[tuple[int, int, int]], splits: list[CaptureSplit]
) -> tuple[np.ndarray, np.ndarray]:
    """(Sp,) padding rows in front of each prefill chunk ((-split) mod SCAN_CHUNK for a captured
    chunk, else 0) and (Sc,) the scan chunk that starts at each capture, counting the scan
    chunks of all sequences in order. ValueError as build_in_pass_plan."""
    by_chunk = {s.chunk: s for s in splits}
    pads: list[int] = []
    capture_chunks: list[int] = []
    scan_chunks_before = 0
    for chunk, _, num_tokens in prefill:
        split = by_chunk.get(chunk)
        pad = 0
        if split is not None:
            if not 0 < split.split < num_tokens:
                raise ValueError(
                    f"in-pass capture after {split.split} of {num_tokens} tokens: not inside the chunk"
                )
            pad = -split.split % SCAN_CHUNK
            capture_chunks.append(scan_chunks_before + (pad + split.split) // SCAN_CHUNK)
        pads.append(pad)
        scan_chunks_before += -(-(pad + num_tokens) // SCAN_CHUNK)
    if len(capture_chunks) != len(splits):
        raise ValueError("an in-pass capture names a chunk that is not a prefill chunk")
    return int64_array(pads), int64_array(capture_chunks)


def _start_of_one_run(rows: np.ndarray) -> int | None:
    """rows[0] when the (increasing) rows are one run of consecutive integers, else None (also
    when there are none)."""
    if len(rows) == 0 or rows[-1] - rows[0] != len(rows) - 1:
        return None
    return int(rows[0])


def capture_conv_states(
    xBC: torch.Tensor,  # (T, C) pre-conv inputs of the step
    conv_state: torch.Tensor,  # (num_slots, C, K-1), not yet updated by this step
    splits: tuple[CaptureSplit, ...],
    out: torch.Tensor,  # (Sc, C, K-1), written
) -> None:
    """The conv state at each split: the last K-1 inputs before it."""
    width = conv_state.shape[2]
    for c, s in enumerate(splits):
        take = min(width, s.split)
        out[c, :, width - take :] = xBC[s.start + s.split - take : s.start + s.split].transpose(0, 1)
        if take < width:
            old = conv_state[s.state_slot, :, take:]
            out[c, :, : width - take] = 0.0 if s.reset_state else old


def scan_with_captures(
    scan,  # engine.kernels.gpu.ssd.chunk_scan, or any function with its signature
    q: torch.Tensor,  # (Ts, H, N) fp32 scan rows (plan.scan_rows; zeros on padding): C per head
    k: torch.Tensor,  # (Ts, H, N) fp32: B per head
    v: torch.Tensor,  # (Ts, H, P) fp32: x * dt
    g: torch.Tensor,  # (Ts, H) fp32: dt * A
    initial: torch.Tensor,  # (Sp, H, P, N) fp32
    plan: InPassCapturePlan,
    ssm_out: torch.Tensor,  # (Sc, H, P, N): the states at the captures, written
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of the prefill chunks as if uncut, in one call: returns (y (Tp, H, P) fp32
    without the D skip, final states (Sp, H, P, N)); writes the states at the captures into
    ssm_out."""
    y, final, chunk_states = scan(q, k, v, g, initial, plan.scan_cu, plan.scan_chunks)
    ssm_out.copy_(chunk_states.index_select(0, plan.capture_chunks))
    if plan.out_start is not None:
        return y[plan.out_start : plan.out_start + plan.out_rows.shape[0]], final
    return y.index_select(0, plan.out_rows), final
