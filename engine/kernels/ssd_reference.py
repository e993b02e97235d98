"""Mamba2's state-space dual (SSD) scan in pure PyTorch: the CPU path and the reference that
GPU kernels are tested against.

One sequence at a time. Per head h, with a_t = dt_t * A_h (a log decay, <= 0) and the head's
group g = h // (H / G), the recurrence is

    state_t = exp(a_t) * state_{t-1} + dt_t * outer(x_t, B_t[g])     # (P, N)
    y_t     = state_t @ C_t[g] + D_h * x_t                           # (P,)

`ssd_step` runs it for one token, `ssd_recurrent` token by token, and `ssd_chunk_scan` computes
the same thing chunk-parallel (quadratic inside a chunk, recurrent across chunks). All math is
fp32; dt must already hold softplus(dt_raw + dt_bias) clamped to the time-step limit.

Shapes: T tokens, H heads, P head dim, G groups, N state size.
"""

from __future__ import annotations

import torch


def ssd_step(
    x: torch.Tensor,  # (H, P)
    dt: torch.Tensor,  # (H,)
    A: torch.Tensor,  # (H,) negative
    B: torch.Tensor,  # (G, N)
    C: torch.Tensor,  # (G, N)
    D: torch.Tensor | None,  # (H,)
    state: torch.Tensor,  # (H, P, N) fp32, not modified
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: returns (y (H, P) fp32, new_state (H, P, N) fp32)."""
    y, new_state = ssd_step_batched(x[None], dt[None], A, B[None], C[None], D, state[None])
    return y[0], new_state[0]


def ssd_step_batched(
    x: torch.Tensor,  # (S, H, P)
    dt: torch.Tensor,  # (S, H)
    A: torch.Tensor,  # (H,) negative
    B: torch.Tensor,  # (S, G, N)
    C: torch.Tensor,  # (S, G, N)
    D: torch.Tensor | None,  # (H,)
    state: torch.Tensor,  # (S, H, P, N) fp32, not modified
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences (ssd_step over a batch): returns
    (y (S, H, P) fp32, new_state (S, H, P, N) fp32)."""
    new_state = state.to(torch.float32, copy=True)
    return ssd_step_(x, dt, A, B, C, D, new_state), new_state


def ssd_step_(
    x: torch.Tensor,  # (S, H, P)
    dt: torch.Tensor,  # (S, H)
    A: torch.Tensor,  # (H,) negative
    B: torch.Tensor,  # (S, G, N)
    C: torch.Tensor,  # (S, G, N)
    D: torch.Tensor | None,  # (H,)
    state: torch.Tensor,  # (S, H, P, N) fp32 contiguous, updated in place
) -> torch.Tensor:
    """ssd_step_batched updating `state` in place (a view of the state slots or a gathered
    copy): returns y (S, H, P) fp32. The group of each head is broadcast, never copied per
    head, and y is a multiply and a sum over N rather than S * H matrix-vector products (which
    cost several times more on the CPU at these sizes)."""
    num_seqs, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    grouped = (num_seqs, num_groups, num_heads // num_groups, head_dim)
    x, dt, A, B, C = (t if t.dtype == torch.float32 else t.float() for t in (x, dt, A, B, C))
    state.mul_(torch.exp(dt * A)[:, :, None, None])
    by_group = state.view(*grouped, state_size)  # (S, G, H/G, P, N)
    by_group += (dt[:, :, None] * x).view(*grouped, 1) * B[:, :, None, None, :]
    y = (by_group * C[:, :, None, None, :]).sum(-1).view(num_seqs, num_heads, head_dim)
    if D is not None:
        y += (D if D.dtype == torch.float32 else D.float())[None, :, None] * x
    return y


def ssd_recurrent(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (arguments shaped as ssd_chunk_scan's): returns
    (y (T, H, P) fp32, final_state (H, P, N) fp32)."""
    state = initial_state.float()
    outputs = []
    for t in range(x.shape[0]):
        y_t, state = ssd_step(x[t], dt[t], A, B[t], C[t], D, state)
        outputs.append(y_t)
    return torch.stack(outputs), state


def ssd_chunk_scan(
    x: torch.Tensor,  # (T, H, P)
    dt: torch.Tensor,  # (T, H)
    A: torch.Tensor,  # (H,)
    B: torch.Tensor,  # (T, G, N)
    C: torch.Tensor,  # (T, G, N)
    D: torch.Tensor | None,  # (H,)
    initial_state: torch.Tensor,  # (H, P, N) fp32
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD over one sequence: returns (y (T, H, P) fp32, final_state (H, P, N) fp32).

    The sequence is zero-padded to whole chunks; padded steps have dt = 0, so they neither
    decay nor feed the state, and the final state is the state after the last real token.
    A sequence shorter than chunk_size is one chunk of its own length (no padding: the
    (L, L) intra-chunk terms are the cost that matters for short prefill chunks).
    """
    T, H, P = x.shape
    heads_per_group = H // B.shape[1]
    L = min(chunk_size, T)
    num_chunks = max(1, -(-T // L))
    pad = num_chunks * L - T

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (T, ...) -> (c, L, ...), zero padded
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return t.reshape(num_chunks, L, *t.shape[1:])

    x32, dt32 = x.float(), dt.float()
    x_dt = chunked(x32 * dt32[..., None])  # (c, L, H, P)
    a = chunked(dt32 * A.float())  # (c, L, H) log decay of each step
    B_h = chunked(B.float().repeat_interleave(heads_per_group, dim=1))  # (c, L, H, N)
    C_h = chunked(C.float().repeat_interleave(heads_per_group, dim=1))  # (c, L, H, N)

    a = a.permute(0, 2, 1)  # (c, H, L)
    a_cumsum = torch.cumsum(a, dim=-1)  # (c, H, L) log decay from chunk start to l (inclusive)

    # Inside each chunk: y[l] += sum_{s<=l} (C[l].B[s]) * exp(sum_{s<k<=l} a_k) * x_dt[s].
    decay_ls = torch.exp(_segment_sum(a))  # (c, H, L, L), zero above the diagonal
    scores = torch.einsum("clhn,cshn->chls", C_h, B_h) * decay_ls  # (c, H, L, L)
    y_diag = torch.einsum("chls,cshp->clhp", scores, x_dt)  # (c, L, H, P)

    # What each chunk adds to the state by its end: sum_s exp(a_cum[last] - a_cum[s]) B[s] x_dt[s].
    decay_to_end = torch.exp(a_cumsum[..., -1:] - a_cumsum)  # (c, H, L)
    chunk_states = torch.einsum("chl,clhn,clhp->chpn", decay_to_end, B_h, x_dt)  # (c, H, P, N)

    # Across chunks, an explicit recurrence: state entering chunk c+1.
    chunk_decay = torch.exp(a_cumsum[..., -1])  # (c, H)
    state = initial_state.float()  # (H, P, N)
    states_in = []
    for c in range(num_chunks):
        states_in.append(state)
        state = state * chunk_decay[c][:, None, None] + chunk_states[c]
    states_in = torch.stack(states_in)  # (c, H, P, N)

    # The entering state's contribution, decayed to each position l.
    decay_from_start = torch.exp(a_cumsum).permute(0, 2, 1)  # (c, L, H)
    y_off = torch.einsum("clhn,chpn->clhp", C_h, states_in) * decay_from_start[..., None]

    y = (y_diag + y_off).reshape(num_chunks * L, H, P)[:T]
    if D is not None:
        y = y + D.float()[:, None] * x32
    return y, state


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L) with [l, s] = sum_{s<k<=l} a_k for s <= l, -inf above the diagonal.

    Summing masked copies (rather than subtracting cumulative sums) keeps it exact for long chunks.
    """
    L = a.shape[-1]
    strictly_lower = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    expanded = a[..., None, :].expand(*a.shape[:-1], L, L)  # [l, k] = a_k
    # [l, s] = sum_{k: s<k<=l} a_k, via a cumsum over rows of the mask "k > s".
    summed = torch.cumsum(expanded.transpose(-1, -2).masked_fill(~strictly_lower, 0.0), dim=-2)
    lower = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device))
    return summed.masked_fill(~lower, float("-inf"))
