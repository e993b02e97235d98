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
- gated_delta_rule_prefill: chunks of several tokens, fla's chunked kernel (its fixed-length
  path for one sequence, graph-capturable; its varlen path for several, which reads the
  chunk boundaries back to the host).

Shapes: T tokens, HK key heads, HV value heads, K, V head dims, S sequences.
"""

from __future__ import annotations

import torch

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
) -> torch.Tensor:
    """o (T, HV, V) in v's dtype; state_pool[slots[s]] <- the state after chunk s. A row that
    is not valid gets g = 0 and beta = 0: the state passes it unchanged (its output is junk)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # the GPU extra

    if valid is not None:
        g = torch.where(valid[:, None], g, 0.0)
        beta = torch.where(valid[:, None], beta, 0.0)
    num_sequences = slots.shape[0]
    initial = gather_states(state_pool, slots, reset)  # (S, HV, K, V)
    o, final = chunk_gated_delta_rule(
        q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None].contiguous(),
        beta[None].contiguous(), scale=scale, initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens if num_sequences > 1 else None,
    )
    scatter_states(final.contiguous(), state_pool, slots)
    return o[0]
