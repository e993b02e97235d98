"""Copies between the pool of SSM state slots and the dense per-sequence states of the scan.

fla-core's chunked scan takes its initial states and returns its final states as dense
(S, H, P, N) tensors, one row per sequence, while the cache keeps them in slots of a
(num_slots, H, P, N) pool; in a CUDA graph the slots are device tensors, so the rows cannot be
views of the pool. `gather_states` and `scatter_states` move them in one launch each,
the gather reading a reset slot as zeros. PyTorch needs three launches for the same
(index_select, where, index_copy_), none of which can take part in programmatic dependent
launch (engine/kernels/gpu/pdl.py); at 20 Mamba layers that was about 0.17 ms of the 4 ms
restore + 256-token prefill step on the H200.

Bit-exact copies; the reference is the PyTorch expression each docstring gives.
Shapes: S sequences, E = H * P * N elements of one state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous

_BLOCK = 4096  # elements per program: 16 KiB of fp32


@triton.jit
def _gather_kernel(
    pool_ptr, stride_pool,  # (num_slots, E) contiguous rows
    out_ptr,  # (S, E) contiguous
    slots_ptr, reset_ptr,  # (S,)
    E,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    s = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    slot = tl.load(slots_ptr + s).to(tl.int64)
    keep = tl.load(reset_ptr + s) == 0
    values = tl.load(pool_ptr + slot * stride_pool + e, mask=mask & keep, other=0.0)
    tl.store(out_ptr + s.to(tl.int64) * E + e, values, mask=mask)


@triton.jit
def _scatter_kernel(
    states_ptr,  # (S, E) contiguous
    pool_ptr, stride_pool,  # (num_slots, E) contiguous rows
    slots_ptr,  # (S,)
    E,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    s = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    slot = tl.load(slots_ptr + s).to(tl.int64)
    values = tl.load(states_ptr + s.to(tl.int64) * E + e, mask=mask)
    tl.store(pool_ptr + slot * stride_pool + e, values, mask=mask)


def _rows(pool: torch.Tensor) -> tuple[int, int]:
    """(elements per slot, stride between slots) of a pool whose slots are contiguous."""
    per_slot = pool[0].numel()
    assert pool[0].is_contiguous() and pool.stride(0) >= per_slot, "each slot must be contiguous"
    return per_slot, pool.stride(0)


def gather_states(
    pool: torch.Tensor,  # (num_slots, ...) each slot contiguous
    slots: torch.Tensor,  # (S,) int, on pool's device
    reset: torch.Tensor,  # (S,) int, nonzero: read as zeros (the slot may hold anything, NaN too)
) -> torch.Tensor:
    """A fresh (S, ...) tensor: row s = zeros if reset[s] else pool[slots[s]], i.e.
    torch.where(reset == 0, pool.index_select(0, slots), 0) broadcast over a slot. One launch;
    reads nothing of a reset slot."""
    per_slot, stride = _rows(pool)
    num = slots.shape[0]
    out = pool.new_empty(num, *pool.shape[1:])
    if num == 0:
        return out
    _gather_kernel[(num, triton.cdiv(per_slot, _BLOCK))](
        pool, stride, out, slots, reset, per_slot, BLOCK=_BLOCK, **launch_options(),
    )
    return out


def scatter_states(
    states: torch.Tensor,  # (S, ...) contiguous, pool's slot shape and dtype
    pool: torch.Tensor,  # (num_slots, ...) each slot contiguous; slots[s] overwritten
    slots: torch.Tensor,  # (S,) int, distinct
) -> None:
    """pool.index_copy_(0, slots, states) in one launch."""
    per_slot, stride = _rows(pool)
    num = slots.shape[0]
    assert states.shape == (num, *pool.shape[1:]) and states.is_contiguous() and states.dtype == pool.dtype
    if num == 0:
        return
    _scatter_kernel[(num, triton.cdiv(per_slot, _BLOCK))](
        states, pool, stride, slots, per_slot, BLOCK=_BLOCK, **launch_options(),
    )
