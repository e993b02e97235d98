"""In-pass capture (issue 5 item 3): the recurrent state at a position p strictly inside a
prefill chunk, read during that chunk's one forward pass instead of cutting the chunk at p.

For a chunk whose first k tokens lie before p (0 < k < its length):
- SSM state at p: the one varlen scan call sees the chunk as two sequences, [0, k) from the
  chunk's initial state and [k, n) from zeros; the first one's final state is the state at p.
  The second is corrected for the state it did not start from, by linearity of the recurrence:
  with g_t = sum of dt * A over rows k..t of the chunk,
      y_t     += exp(g_t) * (S_p @ C_t)          (rows k .. n-1)
      S_final += exp(g_{n-1}) * S_p
  (a (n - k) x N x P product per head), so the scan stays one call with no gathered copies
  of its inputs. The scan sees the prepared inputs q = C, k = B, v = x * dt, g = dt * A
  (engine/kernels/gpu/ssd.py: scan_inputs).
- conv state at p: the K-1 pre-conv inputs before p, from the chunk's rows where k >= K-1,
  else completed on the left by the chunk's old conv state (zeros if it resets).
Outputs and final states are those of the uncut chunk; the captured states are those the split
path (two steps, the chunk cut at p) leaves in the slot, up to the scan's rounding.

Shapes: T tokens, Tp prefill rows, Sp prefill chunks, Sc captures, L_m Mamba layers,
C conv channels, H heads, P head dim, G groups, N state size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CaptureSplit:
    """One capture: chunk `chunk` of the batch (row `start` first), split after `split` tokens."""

    chunk: int
    start: int
    split: int
    state_slot: int
    reset_state: bool


@dataclass(frozen=True)
class InPassCapturePlan:
    """The scan's sequences with the captured chunks split, and where each Mamba layer writes
    what it captures.

    scan_cu (Sp+Sc+1,) over the prefill rows (device and host copies); chunk_first_seq and
    chunk_last_seq (Sp,): each prefill chunk's first and last sequence of the scan;
    capture_rows: per capture (its prefill chunk, that chunk's first sequence, first row after
    the split, end row), rows in the prefill-row axis;
    conv_out[layer] (Sc, C, K-1) and ssm_out[layer] (Sc, H, P, N) fp32: written by the layer.
    """

    splits: tuple[CaptureSplit, ...]
    scan_cu: torch.Tensor
    scan_cu_host: torch.Tensor
    chunk_first_seq: torch.Tensor
    chunk_last_seq: torch.Tensor
    capture_rows: tuple[tuple[int, int, int, int], ...]
    conv_out: dict[int, torch.Tensor]
    ssm_out: dict[int, torch.Tensor]


def with_in_pass_captures(plan, batch, splits: dict[int, int], conv_out, ssm_out):
    """`plan` (a GpuBatchPlan of `batch`) with the in-pass captures `splits` (chunk index ->
    tokens of the chunk before the capture position) and their output buffers attached."""
    from dataclasses import replace

    cu = batch.cu_seqlens
    prefill = [(i, cu[i], c.num_tokens) for i, c in enumerate(batch.chunks) if c.num_tokens > 1]
    capture_splits = [
        CaptureSplit(i, cu[i], splits[i], batch.chunks[i].state_slot, batch.chunks[i].reset_state)
        for i, _, _ in prefill if i in splits
    ]
    device = plan.cu_seqlens.device
    return replace(plan, in_pass=build_in_pass_plan(prefill, capture_splits, conv_out, ssm_out, device))


def build_in_pass_plan(
    prefill: list[tuple[int, int, int]],  # (chunk index, first row, num tokens) of every prefill chunk
    splits: list[CaptureSplit],  # in the prefill chunks' order
    conv_out: dict[int, torch.Tensor],
    ssm_out: dict[int, torch.Tensor],
    device: torch.device,
) -> InPassCapturePlan:
    by_chunk = {s.chunk: s for s in splits}
    scan_cu, first_seq, last_seq, capture_rows = [0], [], [], []
    for j, (chunk, _, num_tokens) in enumerate(prefill):
        split = by_chunk.get(chunk)
        first_seq.append(len(scan_cu) - 1)
        row = scan_cu[-1]
        if split is not None:
            if not 0 < split.split < num_tokens:
                raise ValueError(
                    f"in-pass capture after {split.split} of {num_tokens} tokens: not inside the chunk"
                )
            scan_cu.append(row + split.split)
            capture_rows.append((j, first_seq[-1], row + split.split, row + num_tokens))
        scan_cu.append(row + num_tokens)
        last_seq.append(len(scan_cu) - 2)
    if len(capture_rows) != len(splits):
        raise ValueError("an in-pass capture names a chunk that is not a prefill chunk")
    host = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return InPassCapturePlan(
        splits=tuple(splits),
        scan_cu=host(scan_cu).to(device),
        scan_cu_host=host(scan_cu),
        chunk_first_seq=host(first_seq).to(device),
        chunk_last_seq=host(last_seq).to(device),
        capture_rows=tuple(capture_rows),
        conv_out=conv_out,
        ssm_out=ssm_out,
    )


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
    q: torch.Tensor,  # (Tp, H, N) fp32 prefill rows: C per head
    k: torch.Tensor,  # (Tp, H, N) fp32: B per head
    v: torch.Tensor,  # (Tp, H, P) fp32: x * dt
    g: torch.Tensor,  # (Tp, H) fp32: dt * A
    initial: torch.Tensor,  # (Sp, H, P, N) fp32
    plan: InPassCapturePlan,
    ssm_out: torch.Tensor,  # (Sc, H, P, N): the states at the splits, written
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of the prefill chunks as if uncut, in one call: returns (y (Tp, H, P) fp32
    without the D skip, final states (Sp, H, P, N)); writes the states at the splits into
    ssm_out."""
    num_seqs = plan.scan_cu_host.shape[0] - 1
    starts = initial.new_zeros(num_seqs, *initial.shape[1:]).index_copy_(0, plan.chunk_first_seq, initial)
    y, final_seqs = scan(q, k, v, g, starts, plan.scan_cu, plan.scan_cu_host)
    final = final_seqs.index_select(0, plan.chunk_last_seq)  # (Sp, H, P, N), a fresh tensor
    for c, (chunk, seq, begin, end) in enumerate(plan.capture_rows):
        at_split = final_seqs[seq]  # (H, P, N), the state at p
        ssm_out[c].copy_(at_split)
        decay = torch.exp(torch.cumsum(g[begin:end], dim=0))  # (n2, H)
        y[begin:end] += torch.einsum("thn,hpn->thp", q[begin:end], at_split) * decay[:, :, None]
        final[chunk] += decay[-1][:, None, None] * at_split
    return y, final
