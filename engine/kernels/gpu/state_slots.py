"""Copies between the pool of SSM state slots and the dense per-sequence states of the scan.

fla-core's chunked scan takes its initial states and returns its final states as dense
(S, H, P, N) tensors, one row per sequence, while the cache keeps them in slots of a
(num_slots, H, P, N) pool; in a CUDA graph the slots are device tensors, so the rows cannot be
views of the pool. `gather_states` and `scatter_states` move them in one launch each,
the gather reading a reset slot as zeros. PyTorch needs three launches for the same
(index_select, where, index_copy_), none of which can take part in programmatic dependent
launch (engine/kernels/gpu/pdl.py); at 20 Mamba layers they cost about 0.17 ms of the 4 ms
restore + 256-token prefill step of benchmarks/gpu_roofline.py on the H200.

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
def _slot_copy_kernel(
    pool_ptr, stride_pool,  # (num_slots, E) contiguous rows
    dense_ptr,  # (S, E) contiguous
    slots_ptr, reset_ptr,  # (S,); reset read only when GATHER
    E,
    GATHER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (s, eb) copies BLOCK elements of one state between pool[slots[s]] and dense[s]:
    GATHER: into dense (zeros where reset[s] != 0, the slot unread), else into the pool."""
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    s = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    slot = tl.load(slots_ptr + s).to(tl.int64)
    pool_row = pool_ptr + slot * stride_pool + e
    dense_row = dense_ptr + s.to(tl.int64) * E + e
    if GATHER:
        keep = tl.load(reset_ptr + s) == 0
        tl.store(dense_row, tl.load(pool_row, mask=mask & keep, other=0.0), mask=mask)
    else:
        tl.store(pool_row, tl.load(dense_row, mask=mask), mask=mask)


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
    _slot_copy_kernel[(num, triton.cdiv(per_slot, _BLOCK))](
        pool, stride, out, slots, reset, per_slot, GATHER=True, BLOCK=_BLOCK, **launch_options(),
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
    _slot_copy_kernel[(num, triton.cdiv(per_slot, _BLOCK))](
        pool, stride, states, slots, slots, per_slot, GATHER=False, BLOCK=_BLOCK, **launch_options(),
    )
