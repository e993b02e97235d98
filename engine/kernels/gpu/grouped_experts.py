"""Routed experts on the GPU as a grouped GEMM: every (token, expert) pair sorted by expert, one
launch per projection over all experts. GPU counterpart of
engine/kernels/grouped_experts_reference.py (same contract, same roundings).

1. `expert_blocks` (PyTorch ops on the device): the T*K pairs (pair p = token p // K, slot
   p % K) ordered by expert, each expert's run padded up to a multiple of BLOCK_M rows, so
   every block of BLOCK_M rows belongs to one expert. Per block: its expert (E past the last
   used block); per row: its pair (A = T*K for a padding row).
2. `_gate_up_kernel`: per (block, column tile), the block's rows against their expert's
   input_linear and the activation (ExpertActivation, a constexpr GATED): [gate | up] and
   silu(gate) * up, or up and relu(up)^2 (Nemotron-H's non-gated experts), written per
   pair: (A, I).
3. `_down_kernel`: per (block, column tile), the pairs' activations against their expert's
   output_linear, times the routing weight, written per pair: (A, D).
4. The K pairs of each token summed: (T, K, D) -> (T, D).

No host synchronisation, so CUDA graphs capture it (decode and prefill graphs): the number of
blocks is bounded from the shapes alone, B = ceil(A / BLOCK_M) + min(E, A) (each used expert
pads fewer than BLOCK_M rows), and the launches cover all B blocks; the blocks past the used
ones read expert E and return at once. The sort (torch.argsort), the per-expert counts
(scatter_add_, not bincount, whose output size depends on the data) and the block-to-expert
map (searchsorted) are device ops of fixed output size; nothing is read back.

Both kernels take part in programmatic dependent launch (engine/kernels/gpu/pdl.py): they
release first and wait before any load. fp32 operands multiply in IEEE fp32 (no TF32), so
the fp32 path matches the reference to rounding.

Shapes: T tokens, D hidden, E experts, I channels per expert, K experts per token, A = T*K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous
from engine.kernels.grouped_experts_reference import ExpertActivation

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _gate_up_kernel(
    x_ptr, stride_xt,  # (T, D)
    w_ptr, stride_we, stride_wn, stride_wk,  # (E, 2I, D) [gate | up] if GATED, else (E, I, D) up
    pairs_ptr,  # (B * BLOCK_M,) int32: the pair of each row, A for padding
    block_expert_ptr,  # (B,) int32: the expert of each block, E past the used blocks
    act_ptr, stride_at,  # (A, I)
    num_pairs, num_experts, top_k, D, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr, GATED: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    if GATED:  # the up rows follow the gate rows
        up_rows = I + n
    else:
        up_rows = n
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < D
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        w_mask = k_ok[:, None] & n_ok[None, :]
        if GATED:
            w_gate = tl.load(w_base + n[None, :] * stride_wn + k[:, None] * stride_wk,
                             mask=w_mask, other=0.0)  # (BK, BN)
            gate = tl.dot(x, w_gate, gate, input_precision=PRECISION)
        w_up = tl.load(w_base + up_rows[None, :] * stride_wn + k[:, None] * stride_wk,
                       mask=w_mask, other=0.0)
        up = tl.dot(x, w_up, up, input_precision=PRECISION)
    # The reference's roundings: the projections in the dtype; silu(gate) in fp32 rounded to
    # it, times up rounded once; relu(up)^2 in fp32 rounded once.
    dtype = act_ptr.dtype.element_ty
    up = up.to(dtype).to(tl.float32)
    if GATED:
        gate = gate.to(dtype).to(tl.float32)
        activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
    else:
        activated = tl.maximum(up, 0.0) * tl.maximum(up, 0.0)
    out = act_ptr + pairs.to(tl.int64)[:, None] * stride_at + n[None, :]
    tl.store(out, activated.to(dtype), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, stride_at,  # (A, I)
    w_ptr, stride_we, stride_wn, stride_wk,  # (E, D, I)
    pairs_ptr, block_expert_ptr,  # as in _gate_up_kernel
    routing_ptr,  # (A,) the routing weight of each pair, in the dtype
    out_ptr, stride_ot,  # (A, D)
    num_pairs, num_experts, D, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    valid = pairs < num_pairs
    safe_pairs = tl.where(valid, pairs, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(act_ptr + safe_pairs[:, None] * stride_at + k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        w = tl.load(w_base + n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BK, BN)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    routing = tl.load(routing_ptr + safe_pairs, mask=valid, other=0.0).to(tl.float32)
    # The reference's roundings: the down projection in the dtype, times the weight in it.
    weighted = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
    out = out_ptr + safe_pairs[:, None] * stride_ot + n[None, :]
    tl.store(out, weighted, mask=valid[:, None] & n_ok[None, :])


def block_rows(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M: 16 rows (tl.dot's least) unless the experts average over 32 pairs, then 64."""
    return 64 if num_pairs > 32 * num_experts else 16


def expert_blocks(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) expert ids -> (rows (B * block_m,) int32: the pair each row computes, A for a
    padding row; blocks (B,) int32: each block's expert, num_experts past the used ones),
    B = ceil(A / block_m) + min(E, A). Device ops of fixed output sizes only (no sync)."""
    device = expert_ids.device
    flat = expert_ids.reshape(-1)  # (A,)
    num_pairs = flat.numel()
    num_blocks = -(-num_pairs // block_m) + min(num_experts, num_pairs)
    order = torch.argsort(flat, stable=True)  # (A,) pairs by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks_per_expert, 0)  # (E,) first block past each expert's
    pair_start = torch.cumsum(counts, 0) - counts  # (E,) each expert's first position in order
    sorted_experts = flat[order]  # (A,)
    rank_in_expert = torch.arange(num_pairs, device=device) - pair_start[sorted_experts]
    destination = (block_end - blocks_per_expert)[sorted_experts] * block_m + rank_in_expert
    rows = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    rows.scatter_(0, destination, order.to(torch.int32))
    block_index = torch.arange(num_blocks, device=device, dtype=torch.int64)
    blocks = torch.searchsorted(block_end, block_index, right=True).to(torch.int32)  # (B,)
    return rows, blocks


def grouped_experts(
    hidden: torch.Tensor,  # (T, D)
    input_weight: torch.Tensor,  # (E, 2I, D) [gate | up] rows, or (E, I, D) up rows
    down_weight: torch.Tensor,  # (E, D, I)
    expert_ids: torch.Tensor,  # (T, K) int64
    expert_weights: torch.Tensor,  # (T, K) in hidden's dtype
    activation: ExpertActivation = ExpertActivation.SILU_GATED,
) -> torch.Tensor:  # (T, D) in hidden's dtype
    """engine/kernels/grouped_experts_reference.grouped_experts on the GPU (module docstring):
    the same result within fp32-accumulation rounding, no host synchronisation."""
    num_tokens, hidden_size = hidden.shape
    num_experts, input_rows, _ = input_weight.shape
    channels = activation.channels(input_rows)
    top_k = expert_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    assert hidden.stride(1) == 1 and input_weight.shape[2] == hidden_size
    assert down_weight.shape == (num_experts, hidden_size, channels)
    block_m = block_rows(num_pairs, num_experts)
    rows, blocks = expert_blocks(expert_ids, num_experts, block_m)
    num_blocks = blocks.numel()
    precision = "ieee" if hidden.dtype == torch.float32 else None  # None: the dtype's own
    activated = torch.empty(num_pairs, channels, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(channels, BLOCK_N))](
        hidden, hidden.stride(0),
        input_weight, *input_weight.stride(),
        rows, blocks, activated, activated.stride(0),
        num_pairs, num_experts, top_k, hidden_size, channels,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision,
        GATED=activation is ExpertActivation.SILU_GATED, num_warps=4, **launch_options(),
    )
    routing = expert_weights.to(hidden.dtype).reshape(-1).contiguous()  # (A,)
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, BLOCK_N))](
        activated, activated.stride(0),
        down_weight, *down_weight.stride(),
        rows, blocks, routing, per_pair, per_pair.stride(0),
        num_pairs, num_experts, hidden_size, channels,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision,
        num_warps=4, **launch_options(),
    )
    return per_pair.view(num_tokens, top_k, hidden_size).sum(1)
