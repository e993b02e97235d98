"""Speculative verification of the recurrent mixers over slot pools, in pure PyTorch: the
references of the one-pass Triton kernels (engine/kernels/gpu/mamba_verify.py and
delta_rule_verify.py), with their contracts and their roundings, position by position.

A verification chunk v is a request's last token and its drafts: rows first_rows[v] ..
first_rows[v] + lengths[v] - 1. Position i continues from the state after position i - 1
(position 0 from the chunk's own slot source_slots[v], which is only read) and leaves the conv
window and the recurrent state after it in scratch_slots[i, v]. Nothing else is written.

Roundings, as the kernels (and plain decoding's kernels) round: the conv runs in fp32 and its
output is rounded to the model dtype (the inputs' dtype) before the recurrence reads it; the
recurrent states are fp32.

Shapes: T tokens, V chunks, n positions (scratch_slots (n, V)), K conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.conv_reference import causal_conv1d_step
from engine.kernels.gated_delta_rule_reference import gated_delta_rule_step, l2_normalize
from engine.kernels.ssd_reference import ssd_step_batched


def _chunk_positions(first_rows, lengths, source_slots, scratch_slots):
    """(source slot, [(row, scratch slot) for each position]) for each chunk, on the host."""
    firsts, counts, sources = first_rows.tolist(), lengths.tolist(), source_slots.tolist()
    table = scratch_slots.tolist()
    return [(sources[v], [(firsts[v] + i, table[i][v]) for i in range(counts[v])]) for v in range(len(firsts))]


def _conv(x_row: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The conv step with SiLU of one row (1, C) from window (1, C, K-1), in fp32, rounded to
    x_row's dtype; returns (out (1, C), the window after it in x_row's dtype)."""
    out, after = causal_conv1d_step(x_row.float(), window.float(), weight.float(),
                                    None if bias is None else bias.float(), apply_silu=True)
    return out.to(x_row.dtype), after.to(x_row.dtype)


def mamba_verify_reference(
    xBC: torch.Tensor,  # (T, conv_dim) pre-conv
    dt_raw: torch.Tensor,  # (T, H)
    conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1): scratch slots written
    conv_weight: torch.Tensor,  # (conv_dim, K)
    conv_bias: torch.Tensor | None,  # (conv_dim,)
    dt_bias: torch.Tensor,  # (H,) fp32
    A_log: torch.Tensor,  # (H,) fp32
    time_step_limit: tuple[float, float],
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32: scratch slots written
    x_out: torch.Tensor,  # (T, H, P): the chunks' rows written
    y: torch.Tensor,  # (T, H, P) fp32: the chunks' rows written
    first_rows: torch.Tensor,  # (V,)
    lengths: torch.Tensor,  # (V,)
    source_slots: torch.Tensor,  # (V,)
    scratch_slots: torch.Tensor,  # (n, V)
) -> None:
    """mamba_verify's contract (engine/kernels/gpu/mamba_verify.py): each position's conv step
    (its x columns to x_out) then the SSD step without the D skip (y), dt =
    clamp(softplus(dt_raw + dt_bias), *time_step_limit), A = -exp(A_log)."""
    H, P, N = ssm_state.shape[1:]
    G = (xBC.shape[1] - H * P) // (2 * N)
    A = -torch.exp(A_log.float())
    for source, positions in _chunk_positions(first_rows, lengths, source_slots, scratch_slots):
        window = conv_state[source : source + 1].clone()
        state = ssm_state[source : source + 1].clone()
        for row, slot in positions:
            post, window = _conv(xBC[row : row + 1], window, conv_weight, conv_bias)
            x, B, C = post.split([H * P, G * N, G * N], dim=-1)
            dt = F.softplus(dt_raw[row : row + 1].float() + dt_bias.float()).clamp(*time_step_limit)
            y_row, state = ssd_step_batched(x.view(1, H, P), dt, A, B.view(1, G, N), C.view(1, G, N), None, state)
            x_out[row] = x.view(H, P)
            y[row] = y_row[0]
            conv_state[slot] = window[0].to(conv_state.dtype)
            ssm_state[slot] = state[0]


def delta_rule_verify_reference(
    qkv: torch.Tensor,  # (T, C) pre-conv, C = 2 Hk dk + Hv dv as [q | k | v]
    b: torch.Tensor,  # (T, Hv) raw beta (before the sigmoid)
    a: torch.Tensor,  # (T, Hv) raw decay input
    conv_state: torch.Tensor,  # (num_slots, C, K-1): scratch slots written
    conv_weight: torch.Tensor,  # (C, K), no bias
    A_log: torch.Tensor,  # (Hv,) fp32
    dt_bias: torch.Tensor,  # (Hv,) fp32
    scale: float,
    recurrent_state: torch.Tensor,  # (num_slots, Hv, dk, dv) fp32: scratch slots written
    y: torch.Tensor,  # (T, Hv, dv) qkv's dtype: the chunks' rows written
    first_rows: torch.Tensor,  # (V,)
    lengths: torch.Tensor,  # (V,)
    source_slots: torch.Tensor,  # (V,)
    scratch_slots: torch.Tensor,  # (n, V)
    num_key_heads: int,
) -> None:
    """delta_rule_verify's contract (engine/kernels/gpu/delta_rule_verify.py): each position's
    conv step with SiLU, then the gated delta rule step (gated_delta_rule_reference's
    recurrence) with q and k L2-normalised and expanded to the value heads, g = -exp(A_log)
    softplus(a + dt_bias), beta = sigmoid(b); y[row] = scale S^T q, rounded to qkv's dtype."""
    Hv, dk, dv = recurrent_state.shape[1:]
    key_dim = num_key_heads * dk
    expand = lambda t: l2_normalize(t.view(1, num_key_heads, dk)).repeat_interleave(Hv // num_key_heads, dim=1)  # noqa: E731
    for source, positions in _chunk_positions(first_rows, lengths, source_slots, scratch_slots):
        window = conv_state[source : source + 1].clone()
        state = recurrent_state[source : source + 1].clone()
        for row, slot in positions:
            post, window = _conv(qkv[row : row + 1], window, conv_weight, None)
            q, k, v = post.split([key_dim, key_dim, Hv * dv], dim=-1)
            g = -torch.exp(A_log.float()) * F.softplus(a[row : row + 1].float() + dt_bias.float())
            beta = b[row : row + 1].float().sigmoid()
            o, state = gated_delta_rule_step(expand(q), expand(k), v.view(1, Hv, dv), g, beta, state, scale)
            y[row] = o[0].to(y.dtype)
            conv_state[slot] = window[0].to(conv_state.dtype)
            recurrent_state[slot] = state[0]
