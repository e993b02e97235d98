"""The gated delta rule (Qwen3-Next's linear attention) over one sequence with a carried state,
in pure PyTorch: the CPU path runs these, and the CUDA path (fla-core's kernels,
engine/kernels/gpu/gated_delta_rule.py) is tested against them.

Per value head, with a d_k x d_v state S (zeros for a fresh sequence), each token t does

    S <- exp(g_t) * S                          (decay, g_t <= 0)
    u_t = beta_t * (v_t - S^T k_t)             (the delta: what S does not yet predict)
    S <- S + k_t u_t^T
    o_t = scale * S^T q_t

Running a sequence in pieces, each continuing from the state the previous one left, gives the
outputs of running it whole (up to fp32 rounding), whatever the pieces and the chunk size.
q and k come in already expanded to the value heads (and L2-normalised, l2_normalize, when the
model asks for it). All arithmetic is fp32.

Shapes: T tokens, H value heads, K key head dim, V value head dim, S sequences, L chunk length.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, in fp32 (as fla-core's kernels)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,  # (T, H, K)
    k: torch.Tensor,  # (T, H, K)
    v: torch.Tensor,  # (T, H, V)
    g: torch.Tensor,  # (T, H) log decay, <= 0
    beta: torch.Tensor,  # (T, H)
    state: torch.Tensor,  # (H, K, V) fp32, not modified
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens in chunks of chunk_size: returns (o (T, H, V) fp32, new state
    (H, K, V) fp32).

    Within a chunk, with G_t the cumulative log decay from the chunk's start and S0 the state
    before it, the deltas solve the unit lower-triangular system
        u_t + beta_t * sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - exp(G_t) S0^T k_t),
    and then o_t = scale * (exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s) and
    S_end = exp(G_L) S0 + sum_s exp(G_L - G_s) k_s u_s^T."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    num_tokens = q.shape[0]
    outputs = []
    state = state.float()
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        o, state = _chunk(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
            g[start:end].transpose(0, 1), beta[start:end].transpose(0, 1), state, scale,
        )
        outputs.append(o.transpose(0, 1))
    if not outputs:
        return v.new_zeros(0, *v.shape[1:]), state.clone()
    return torch.cat(outputs), state


def _chunk(
    q: torch.Tensor,  # (H, L, K)
    k: torch.Tensor,  # (H, L, K)
    v: torch.Tensor,  # (H, L, V)
    g: torch.Tensor,  # (H, L)
    beta: torch.Tensor,  # (H, L)
    state: torch.Tensor,  # (H, K, V)
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of every head: (o (H, L, V), state after it (H, K, V))."""
    length = q.shape[1]
    cumulative = g.cumsum(dim=1)  # (H, L): G_t
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(-1)
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    log_decay = cumulative[:, :, None] - cumulative[:, None, :]  # (H, L, L): G_t - G_s
    # exp only where s <= t (elsewhere the difference is positive and may overflow)
    decay = torch.where(lower, log_decay, torch.full_like(log_decay, float("-inf"))).exp()
    kk = k @ k.transpose(1, 2)  # (H, L, L)
    system = torch.where(strictly_lower, beta[:, :, None] * kk * decay, 0.0)
    system = system + torch.eye(length, dtype=q.dtype, device=q.device)  # unit lower triangular
    start_decay = cumulative.exp()[:, :, None]  # (H, L, 1): exp(G_t)
    right = beta[:, :, None] * (v - start_decay * (k @ state))  # (H, L, V)
    deltas = torch.linalg.solve_triangular(system, right, upper=False, unitriangular=True)  # (H, L, V)
    qk = torch.where(lower, (q @ k.transpose(1, 2)) * decay, 0.0)  # (H, L, L)
    o = scale * (start_decay * (q @ state) + qk @ deltas)  # (H, L, V)
    total = cumulative[:, -1:]  # (H, 1): G_L
    to_end = (total - cumulative).exp()[:, :, None]  # (H, L, 1): exp(G_L - G_s)
    new_state = total.exp()[:, :, None] * state + (k * to_end).transpose(1, 2) @ deltas
    return o, new_state


def gated_delta_rule_step(
    q: torch.Tensor,  # (S, H, K), one token of each sequence
    k: torch.Tensor,  # (S, H, K)
    v: torch.Tensor,  # (S, H, V)
    g: torch.Tensor,  # (S, H)
    beta: torch.Tensor,  # (S, H)
    state: torch.Tensor,  # (S, H, K, V) fp32, not modified
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences (the recurrence of the module doc, once): returns
    (o (S, H, V) fp32, new states (S, H, K, V) fp32)."""
    new_state = state.to(torch.float32, copy=True)
    return gated_delta_rule_step_(q, k, v, g, beta, new_state, scale), new_state


def gated_delta_rule_step_(
    q: torch.Tensor,  # (S, H, K), one token of each sequence
    k: torch.Tensor,  # (S, H, K)
    v: torch.Tensor,  # (S, H, V)
    g: torch.Tensor,  # (S, H)
    beta: torch.Tensor,  # (S, H)
    state: torch.Tensor,  # (S, H, K, V) fp32, updated in place
    scale: float,
) -> torch.Tensor:
    """gated_delta_rule_step updating `state` in place (a view of the state slots or a
    gathered copy): returns o (S, H, V) fp32. The products over K are a multiply and a sum
    rather than S * H matrix-vector products (several times cheaper on the CPU at these
    sizes)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state.mul_(g.exp()[:, :, None, None])  # decayed
    predicted = (state * k[:, :, :, None]).sum(2)  # (S, H, V): S^T k
    delta = beta[:, :, None] * (v - predicted)  # (S, H, V)
    state += k[:, :, :, None] * delta[:, :, None, :]
    return scale * (state * q[:, :, :, None]).sum(2)
