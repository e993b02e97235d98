"""The gated delta rule on CUDA over the engine's state slots: fla-core's kernels (pinned at
0.6.0, the project's `gpu` extra) between a gather of the chunks' states from their slots and
a scatter of the new states back (engine/kernels/gpu/state_slots.py).

Same function as engine/kernels/gated_delta_rule_reference.py (tests/gpu/test_gated_delta_rule.py
checks them against each other), with two differences of interface: q and k come per key head,
not yet L2-normalised (the kernels normalise them, x / sqrt(sum(x^2) + 1e-6) as
l2_normalize, and each key head serves HV / HK consecutive value heads), and the states are
read from and written to a slot pool.

- gated_delta_rule_decode: one token of each of S sequences, fla's fused recurrent kernel
  (fixed length 1, no host synchronisation: CUDA graphs capture it);
- gated_delta_rule_prefill: chunks of several tokens, fla's chunked kernel (chunk_rule: its
  fixed-length path for one sequence, graph-capturable; its varlen path for several, which
  reads the chunk boundaries back to the host unless given the plan's chunk indices);
- gated_delta_rule_prefill_with_captures: the same with in-pass captures, in two calls of the
  chunked kernel (engine/kernels/gpu/delta_rule_capture.py).

fp32: fla's kernels leave tl.dot's operand precision to Triton's default, which is TF32 for
fp32 operands on NVIDIA GPUs (about 1e-3 relative). An fp32 engine would then give different
logits from a checkpoint and from scratch (their chunk edges differ) by more than fp32 rounding
(1.7e-4 relative was seen on the H200). So every fla call with fp32 operands runs inside
ieee_fp32_dots, which makes Triton compile fp32 dots in IEEE fp32 (triton.knobs.language.
fp32_default, read when a kernel is compiled: on its first call, which is inside the context,
as every call of fla's kernels in the engine goes through this module). bf16 operands are
unaffected.

Shapes: T tokens, HK key heads, HV value heads, K, V head dims, S sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine.kernels.gpu.delta_rule_capture import SplitPrefill, rule_with_captures
from engine.kernels.gpu.state_slots import gather_states, scatter_states


def gated_delta_rule_decode(
    q: torch.Tensor,  # (S, HK, K), raw (normalised in the kernel)
    k: torch.Tensor,  # (S, HK, K)
    v: torch.Tensor,  # (S, HV, V)
    g: torch.Tensor,  # (S, HV) fp32 log decay
    beta: torch.Tensor,  # (S, HV)
    scale: float,
    state_pool: torch.Tensor,  # (num_slots, HV, K, V) fp32; slots[s] overwritten
    slots: torch.Tensor,  # (S,) int, distinct
    reset: torch.Tensor,  # (S,) int, nonzero: start from zeros (the slot is not read)
) -> torch.Tensor:
    """o (S, HV, V) in v's dtype; state_pool[slots[s]] <- the state after sequence s's token."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # the GPU extra

    initial = gather_states(state_pool, slots, reset)  # (S, HV, K, V)
    with ieee_fp32_dots(q.dtype):
        o, final = fused_recurrent_gated_delta_rule(
            q[:, None].contiguous(), k[:, None].contiguous(), v[:, None].contiguous(),
            g=g[:, None].contiguous(), beta=beta[:, None].contiguous(), scale=scale,
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
    scatter_states(final.contiguous(), state_pool, slots)
    return o[:, 0]


def gated_delta_rule_prefill(
    q: torch.Tensor,  # (T, HK, K), raw, the chunks' rows one after another
    k: torch.Tensor,  # (T, HK, K)
    v: torch.Tensor,  # (T, HV, V)
    g: torch.Tensor,  # (T, HV) fp32 log decay
    beta: torch.Tensor,  # (T, HV)
    scale: float,
    state_pool: torch.Tensor,  # (num_slots, HV, K, V) fp32; slots[s] overwritten
    slots: torch.Tensor,  # (S,) int, distinct
    reset: torch.Tensor,  # (S,) int, nonzero: start from zeros (the slot is not read)
    cu_seqlens: torch.Tensor,  # (S+1,) int64 chunk boundaries over the T rows
    valid: torch.Tensor | None = None,  # (T,) bool; False rows (graph padding) leave the state as is
    chunk_indices: torch.Tensor | None = None,  # (NC, 2) fla's varlen chunks (ScanChunks.indices), S > 1
) -> torch.Tensor:
    """o (T, HV, V) in v's dtype; state_pool[slots[s]] <- the state after chunk s. A row that
    is not valid gets g = 0 and beta = 0: the state passes it unchanged (its output is junk)."""
    if valid is not None:
        g = torch.where(valid[:, None], g, 0.0)
        beta = torch.where(valid[:, None], beta, 0.0)
    initial = gather_states(state_pool, slots, reset)  # (S, HV, K, V)
    o, final = chunk_rule(q, k, v, g, beta, scale, initial, cu_seqlens, chunk_indices)
    scatter_states(final.contiguous(), state_pool, slots)
    return o


def gated_delta_rule_prefill_with_captures(
    q: torch.Tensor,  # (T, HK, K), raw, the step's rows (decode rows too: not read)
    k: torch.Tensor,  # (T, HK, K)
    v: torch.Tensor,  # (T, HV, V)
    g: torch.Tensor,  # (T, HV) fp32 log decay
    beta: torch.Tensor,  # (T, HV)
    scale: float,
    state_pool: torch.Tensor,  # (num_slots, HV, K, V) fp32; slots[s] overwritten
    slots: torch.Tensor,  # (Sp,) int, distinct: the prefill chunks' slots
    reset: torch.Tensor,  # (Sp,) int, nonzero: start from zeros (the slot is not read)
    split: SplitPrefill,  # the in-pass plan's two calls (InPassCapturePlan.split)
    states_out: torch.Tensor,  # (Sc, HV, K, V) fp32: the states at the captures, written
    out: torch.Tensor,  # (T, HV, V) in v's dtype: every prefill row written
) -> None:
    """gated_delta_rule_prefill over the prefill chunks as if uncut, with the states at the
    in-pass captures written into states_out (delta_rule_capture.rule_with_captures: two calls
    of chunk_rule, no host synchronisation); state_pool[slots[s]] <- the state after chunk s."""
    rule = lambda q, k, v, g, beta, initial, call: chunk_rule(  # noqa: E731
        q, k, v, g, beta, scale, initial, call.cu, call.chunk_indices
    )
    initial = gather_states(state_pool, slots, reset)  # (Sp, HV, K, V)
    final = rule_with_captures(rule, q, k, v, g, beta, initial, split, states_out, out)
    scatter_states(final.contiguous(), state_pool, slots)


@contextlib.contextmanager
def ieee_fp32_dots(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, Triton compiles dots of fp32 operands in IEEE fp32 when dtype is fp32
    (module doc); for any other dtype the block runs as it is."""
    if dtype != torch.float32:
        yield
        return
    import triton

    language = triton.knobs.language
    previous, language.fp32_default = language.fp32_default, "ieee"
    try:
        yield
    finally:
        language.fp32_default = previous


def chunk_rule(
    q: torch.Tensor,  # (T, HK, K), raw, S sequences' rows one after another
    k: torch.Tensor,  # (T, HK, K)
    v: torch.Tensor,  # (T, HV, V)
    g: torch.Tensor,  # (T, HV) fp32 log decay
    beta: torch.Tensor,  # (T, HV)
    scale: float,
    initial: torch.Tensor,  # (S, HV, K, V) fp32, not modified
    cu_seqlens: torch.Tensor,  # (S+1,) int64 bounds over the T rows
    chunk_indices: torch.Tensor | None,  # (NC, 2) fla's varlen chunks; None: fla computes them (S > 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked gated delta rule over S sequences: (o (T, HV, V) in v's dtype, final
    states (S, HV, K, V) fp32). One sequence takes its fixed-length path (no bounds read);
    several its varlen path, which reads nothing back from the device when chunk_indices is
    given (else it builds them there and waits for their count)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # the GPU extra

    several = initial.shape[0] > 1
    with ieee_fp32_dots(q.dtype):
        o, final = chunk_gated_delta_rule(
            q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None].contiguous(),
            beta[None].contiguous(), scale=scale, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens if several else None,
            chunk_indices=chunk_indices if several else None,
        )
    return o[0], final
