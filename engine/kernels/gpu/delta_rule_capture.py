"""In-pass capture for the gated delta rule: the recurrent state at a position p strictly inside
a prefill chunk, taken during that chunk's one forward pass, by two calls of the chunked rule.

For the captured chunks (chunk c starts at token row s_c, its capture after k_c of its tokens):
- heads call: the rows [s_c, s_c + k_c) of every captured chunk, one sequence each, from its
  slot's state (zeros if it resets); its final states are the states at the captures;
- tails call: every prefill chunk, a captured one from row s_c + k_c on and from its captured
  state, the others whole and from their slots; its final states are the chunks' new states.
Each prefill row goes through exactly one of the two calls; the step's outputs are theirs put
back in row order. The conv state at p is Mamba2's (in_pass_capture.capture_conv_states: the
gated delta-net's conv state is the same K-1 pre-conv inputs).

Why two calls, not Mamba2's front padding (in_pass_capture.py): fla-core 0.6.0's chunked gated
delta rule keeps its chunk-edge states (chunk_gated_delta_rule_fwd_h's h) in k's dtype, bf16 in
a bf16 model, and its public function drops them. Reading them would round the captured fp32
state to bf16 (or take fp32 q, k, v throughout, which changes the uncut chunk's numerics and
doubles its traffic), and means re-assembling its five internal steps (l2norm, cumsum, WY
intra-chunk solve, chunk states, outputs) against 0.6.0's internal signatures. The two calls
use the public function only, with its fp32 initial and final states; the extra cost is one
more set of launches over the heads' rows, not a second pass over any row.

Contract: the two calls are, kernel for kernel, the split path's two steps (the chunk cut at p:
its first step's chunk edges s_c, s_c + 64, ..., its second's p, p + 64, ...), on the same
inputs, so the captured states, the final states and the outputs are the split path's, up to
the kernels' launch shape (fixed-length or varlen, which sequences share the launch); the
outputs and final state of a captured chunk are the uncut chunk's up to the rule's rounding
(tests/gpu/test_delta_rule_in_pass.py measures both).

No host synchronisation: the rows, bounds and fla-core's varlen chunk indices of both calls are
host arrays (split_prefill_arrays) copied with the step's other indices (build_in_pass_plan);
given its chunk_indices, fla-core does not compute them on the device and read their count back.

Shapes: Sp prefill chunks, Sc captures, Th heads rows, Tt tails rows, NC varlen chunks of a call,
HV value heads, K, V head dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.interfaces.host_index import chunk_pairs, concat_ranges, cumulative_bounds, int64_array

RULE_CHUNK = 64  # rows per chunk of fla-core's chunked gated delta rule (its default chunk_size)


@dataclass(frozen=True)
class RuleCall:
    """The rows of one call of the chunked rule over m sequences laid end to end: rows (n,) the
    step's token row of each of its rows; cu (m+1,) the sequences' bounds over them;
    chunk_indices (NC, 2) fla-core's (sequence, chunk of it) pairs for its varlen path, None for
    one sequence (its fixed-length path)."""

    rows: torch.Tensor
    cu: torch.Tensor
    chunk_indices: torch.Tensor | None


@dataclass(frozen=True)
class SplitPrefill:
    """The two calls of a step with in-pass captures: heads (Sc sequences, capture order) and
    tails (Sp sequences, the prefill chunks' order); captured (Sc,) the index among the prefill
    chunks of each captured chunk."""

    heads: RuleCall
    tails: RuleCall
    captured: torch.Tensor


def split_prefill_arrays(
    prefill: list[tuple[int, int, int]],  # (chunk index, first token row, num tokens) of every prefill chunk
    captures: list[tuple[int, int]],  # (chunk index, tokens before the capture), in the prefill chunks' order
) -> list[np.ndarray]:
    """SplitPrefill's arrays, all int64: [heads rows (Th,), heads cu (Sc+1,), heads chunk pairs
    (2 NC,) or empty for one sequence, tails rows (Tt,), tails cu (Sp+1,), tails chunk pairs
    (2 NC,) or empty for one sequence, captured (Sc,)]. ValueError: a capture not strictly
    inside its chunk, or naming a chunk that is not a prefill chunk, or out of order."""
    first_rows = int64_array([first_row for _, first_row, _ in prefill])
    lengths = int64_array([num_tokens for _, _, num_tokens in prefill])
    position = {chunk: j for j, (chunk, _, _) in enumerate(prefill)}
    if any(chunk not in position for chunk, _ in captures):
        raise ValueError("an in-pass capture names a chunk that is not a prefill chunk")
    captured = int64_array([position[chunk] for chunk, _ in captures])
    head_lengths = int64_array([split for _, split in captures])
    if np.any(np.diff(captured) <= 0):
        raise ValueError("in-pass captures out of the prefill chunks' order, or two in one chunk")
    if np.any((head_lengths <= 0) | (head_lengths >= lengths[captured])):
        raise ValueError("an in-pass capture not strictly inside its chunk")
    skipped = np.zeros_like(lengths)
    skipped[captured] = head_lengths
    tail_lengths = lengths - skipped
    return [
        concat_ranges(first_rows[captured], head_lengths),
        cumulative_bounds(head_lengths),
        _varlen_chunks(head_lengths),
        concat_ranges(first_rows + skipped, tail_lengths),
        cumulative_bounds(tail_lengths),
        _varlen_chunks(tail_lengths),
        captured,
    ]


def _varlen_chunks(lengths: np.ndarray) -> np.ndarray:
    """fla-core's chunk_indices of sequences of `lengths`, flattened; empty for one sequence."""
    return chunk_pairs(lengths, RULE_CHUNK) if len(lengths) > 1 else lengths[:0]


def split_prefill(arrays: list[torch.Tensor]) -> SplitPrefill:
    """The SplitPrefill of split_prefill_arrays' arrays, on the device (views of one copy)."""
    h_rows, h_cu, h_pairs, t_rows, t_cu, t_pairs, captured = arrays
    call = lambda rows, cu, pairs: RuleCall(  # noqa: E731
        rows, cu, pairs.view(-1, 2) if cu.shape[0] > 2 else None
    )
    return SplitPrefill(call(h_rows, h_cu, h_pairs), call(t_rows, t_cu, t_pairs), captured)


# rule(q, k, v, g, beta, initial (m, HV, K, V), call) -> (o (n, HV, V), final (m, HV, K, V)):
# the chunked rule over call's m sequences (gated_delta_rule.chunk_rule, or a reference)
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def rule_with_captures(
    rule: Rule,
    q: torch.Tensor,  # (T, ...) the step's rows, as `rule` takes them
    k: torch.Tensor,  # (T, ...)
    v: torch.Tensor,  # (T, HV, V)
    g: torch.Tensor,  # (T, HV) fp32 log decay
    beta: torch.Tensor,  # (T, HV)
    initial: torch.Tensor,  # (Sp, HV, K, V) fp32, the prefill chunks' states before the step
    split: SplitPrefill,
    states_out: torch.Tensor,  # (Sc, HV, K, V) fp32: the states at the captures, written
    out: torch.Tensor,  # (T, HV, V): every prefill row written
) -> torch.Tensor:
    """The prefill chunks through the rule as if uncut, in the two calls of the module doc:
    writes the prefill rows' outputs into `out` and the states at the captures into
    states_out; returns the prefill chunks' final states (Sp, HV, K, V)."""
    def call(part: RuleCall, states: torch.Tensor) -> torch.Tensor:
        rows = part.rows
        o, final = rule(*(t.index_select(0, rows) for t in (q, k, v, g, beta)), states, part)
        out.index_copy_(0, rows, o.to(out.dtype))
        return final

    at_captures = call(split.heads, initial.index_select(0, split.captured))
    states_out.copy_(at_captures)
    return call(split.tails, initial.index_copy(0, split.captured, at_captures))
