"""In-pass capture (issue 5 item 3): the recurrent state at a position p strictly inside a
prefill chunk, read during that chunk's one forward pass instead of cutting the chunk at p.

For a chunk of rows [start, end) whose first k tokens lie before p (0 < k < end - start):
- SSM state at p: the varlen scan runs in two calls. The first covers every prefill chunk, the
  captured ones only up to their split (rows [start, start + k)); its final state of a captured
  chunk is the state at p. The second covers the captured chunks' remainders, starting from that
  state; its final states are those chunks' final states. Chunks without a capture are finished
  by the first call.
- conv state at p: the K-1 pre-conv inputs before p, from the chunk's rows where k >= K-1,
  else completed on the left by the chunk's old conv state (zeros if it resets).
Outputs and final states are those of the uncut chunk; the captured states are those the split
path (two steps, the chunk cut at p) leaves in the slot, up to the scan's rounding.

Shapes: T tokens, Sp prefill chunks, Sc captures, L_m Mamba layers, C conv channels.
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
    """Scan metadata of the two calls, and where each Mamba layer writes what it captures.

    first_rows (T1,) / first_cu (Sp+1,): flat rows of every prefill chunk cut at its split;
    second_rows (T2,) / second_cu (Sc+1,): the captured chunks' remainders;
    captured_prefill (Sc,): index among the prefill chunks of each capture (first call's order);
    conv_out[layer] (Sc, C, K-1) and ssm_out[layer] (Sc, H, P, N) fp32: written by the layer.
    """

    splits: tuple[CaptureSplit, ...]
    first_rows: torch.Tensor
    first_cu: torch.Tensor
    first_cu_host: torch.Tensor
    second_rows: torch.Tensor
    second_cu: torch.Tensor
    second_cu_host: torch.Tensor
    captured_prefill: torch.Tensor
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
    first_rows, first_cu, second_rows, second_cu, captured = [], [0], [], [0], []
    for j, (chunk, start, num_tokens) in enumerate(prefill):
        split = by_chunk.get(chunk)
        cut = num_tokens if split is None else split.split
        if split is not None:
            if not 0 < cut < num_tokens:
                raise ValueError(f"in-pass capture after {cut} of {num_tokens} tokens: not inside the chunk")
            captured.append(j)
            second_rows.extend(range(start + cut, start + num_tokens))
            second_cu.append(len(second_rows))
        first_rows.extend(range(start, start + cut))
        first_cu.append(len(first_rows))
    if len(captured) != len(splits):
        raise ValueError("an in-pass capture names a chunk that is not a prefill chunk")
    host = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return InPassCapturePlan(
        splits=tuple(splits),
        first_rows=host(first_rows).to(device),
        first_cu=host(first_cu).to(device),
        first_cu_host=host(first_cu),
        second_rows=host(second_rows).to(device),
        second_cu=host(second_cu).to(device),
        second_cu_host=host(second_cu),
        captured_prefill=host(captured).to(device),
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
    scan,  # ssd_chunk_scan_varlen
    x: torch.Tensor,  # (T, H, P)
    dt: torch.Tensor,  # (T, H) fp32
    A: torch.Tensor,  # (H,)
    B: torch.Tensor,  # (T, G, N)
    C: torch.Tensor,  # (T, G, N)
    D: torch.Tensor | None,
    initial: torch.Tensor,  # (Sp, H, P, N) fp32
    plan: InPassCapturePlan,
    y: torch.Tensor,  # (T, H, P) fp32: the prefill rows are written
    ssm_out: torch.Tensor,  # (Sc, H, P, N): the states at the splits, written
) -> torch.Tensor:
    """The two scan calls; returns every prefill chunk's final state (Sp, H, P, N)."""
    pick = lambda t, rows: t.index_select(0, rows)  # noqa: E731
    rows = plan.first_rows
    y_first, final = scan(pick(x, rows), pick(dt, rows), A, pick(B, rows), pick(C, rows), D,
                          initial, plan.first_cu, plan.first_cu_host)
    y.index_copy_(0, rows, y_first)
    at_split = final.index_select(0, plan.captured_prefill)  # (Sc, H, P, N)
    ssm_out.copy_(at_split)
    rows = plan.second_rows
    y_second, final_second = scan(pick(x, rows), pick(dt, rows), A, pick(B, rows), pick(C, rows), D,
                                  at_split, plan.second_cu, plan.second_cu_host)
    y.index_copy_(0, rows, y_second)
    return final.index_copy(0, plan.captured_prefill, final_second)
