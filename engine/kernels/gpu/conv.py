"""Depthwise causal conv1d with carried conv state over a varlen batch, in Triton.

GPU counterpart of engine/kernels/conv_reference.py:causal_conv1d, for every chunk of a batch
at once (prefill chunks and 1-token decode chunks alike). The conv state of a chunk's slot
holds the last K-1 inputs before the chunk (ignored, read as zeros, when the chunk resets).

Two launches, stream-ordered: `_conv_kernel` writes the outputs from the old states, then
`_state_kernel` (launched by `advance_conv_states`) overwrites each chunk's slot with the last
K-1 inputs of its window. The fused decode kernel (engine/kernels/gpu/mamba_decode.py) takes
the place of `_conv_kernel` on decode-only steps and is followed by the same
`advance_conv_states`.
Shapes: T tokens, C channels, K kernel width, S chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous


@triton.jit(do_not_specialize=["T"])
def _conv_kernel(
    x_ptr, stride_xt,  # (T, C), unit channel stride
    w_ptr, b_ptr,  # (C, K) contiguous, (C,)
    state_ptr, stride_ss, stride_sc,  # (slots, C, K-1), unit last stride
    out_ptr, stride_ot,  # (T, C)
    token_chunk_ptr, cu_ptr, slot_ptr, reset_ptr,  # (T,), (S+1,), (S,), (S,)
    T, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask, c_mask = t < T, c < C
    chunk = tl.load(token_chunk_ptr + t, mask=t_mask, other=0)
    start = tl.load(cu_ptr + chunk, mask=t_mask, other=0)
    slot = tl.load(slot_ptr + chunk, mask=t_mask, other=0)
    keep_state = tl.load(reset_ptr + chunk, mask=t_mask, other=1) == 0
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(K):
        src = t - (K - 1) + k  # (BLOCK_T,) flat row of the input this tap reads
        in_x = src >= start
        tc_mask = t_mask[:, None] & c_mask[None, :]
        xv = tl.load(
            x_ptr + src[:, None] * stride_xt + c[None, :], mask=tc_mask & in_x[:, None], other=0.0
        )
        state_col = (K - 1) + src - start  # in [0, K-2] where the tap reads the carried state
        sv = tl.load(
            state_ptr + slot[:, None] * stride_ss + c[None, :] * stride_sc + state_col[:, None],
            mask=tc_mask & ((~in_x) & keep_state)[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + c * K + k, mask=c_mask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + t[:, None] * stride_ot + c[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=t_mask[:, None] & c_mask[None, :],
    )


@triton.jit
def _state_kernel(
    x_ptr, stride_xt,
    state_ptr, stride_ss, stride_sc,
    cu_ptr, slot_ptr, reset_ptr,
    C,
    KM1: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    # Before the wait (pdl.py's contract): the plan and the slot's old window, which no kernel
    # of the pass before this one writes; the chunk's inputs (in_proj's output) after it.
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_J)
    start = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - start
    slot = tl.load(slot_ptr + s)
    keep_state = tl.load(reset_ptr + s) == 0
    pos = n - KM1 + j  # window column j of the new state, relative to the chunk's first input
    mask = (c < C)[:, None] & (j < KM1)[None, :]
    base = state_ptr + slot * stride_ss + c[:, None] * stride_sc
    from_state = tl.load(base + (KM1 + pos)[None, :], mask=mask & (pos < 0)[None, :] & keep_state, other=0.0)
    wait_for_previous(USE_PDL)
    from_x = tl.load(
        x_ptr + (start + pos)[None, :] * stride_xt + c[:, None], mask=mask & (pos >= 0)[None, :], other=0.0
    )
    new_state = from_x.to(tl.float32) + from_state.to(tl.float32)
    tl.debug_barrier()  # every read of the old state lands before any write to the slot
    tl.store(base + j[None, :], new_state.to(state_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_varlen(
    x: torch.Tensor,  # (T, C), unit stride over channels
    conv_state: torch.Tensor,  # (num_slots, C, K-1), chunk slots overwritten in place
    weight: torch.Tensor,  # (C, K)
    bias: torch.Tensor | None,  # (C,)
    cu_seqlens: torch.Tensor,  # (S+1,) int
    chunk_slot: torch.Tensor,  # (S,) int
    chunk_reset: torch.Tensor,  # (S,) int, nonzero = start from a zero state
    token_chunk: torch.Tensor,  # (T,) int
    apply_silu: bool,
    out: torch.Tensor | None = None,  # (T, C), x's dtype; allocated when None
) -> torch.Tensor:
    """Returns out (T, C) in x's dtype; mutates conv_state[chunk_slot[s]] for every chunk s.

    Chunk s covers rows cu_seqlens[s]:cu_seqlens[s+1]; chunks must use distinct slots.
    Equal to causal_conv1d per chunk up to fp32-accumulation rounding.
    """
    num_tokens, channels = x.shape
    kernel_size = weight.shape[1]
    assert x.stride(1) == 1 and conv_state.stride(2) == 1
    weight = weight.contiguous()
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_t, block_c = 16, 128
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))
    _conv_kernel[grid](
        x, x.stride(0), weight, bias if bias is not None else weight,
        conv_state, conv_state.stride(0), conv_state.stride(1),
        out, out.stride(0),
        token_chunk, cu_seqlens, chunk_slot, chunk_reset,
        num_tokens, channels,
        K=kernel_size, HAS_BIAS=bias is not None, SILU=apply_silu,
        BLOCK_T=block_t, BLOCK_C=block_c, **launch_options(),
    )
    advance_conv_states(x, conv_state, cu_seqlens, chunk_slot, chunk_reset)
    return out


def advance_conv_states(
    x: torch.Tensor,  # (T, C) the conv's input (pre-conv rows), unit stride over channels
    conv_state: torch.Tensor,  # (num_slots, C, K-1), chunk slots overwritten in place
    cu_seqlens: torch.Tensor,  # (S+1,) int
    chunk_slot: torch.Tensor,  # (S,) int, distinct
    chunk_reset: torch.Tensor,  # (S,) int, nonzero = the old state is read as zeros
) -> None:
    """Mutates conv_state[chunk_slot[s]] for every chunk s (rows cu_seqlens[s]:cu_seqlens[s+1]
    of x) into the last K-1 columns of the window [old state (zeros if it resets) | the chunk's
    inputs]: the state after the chunk. Touches no other slot. One launch.

    Must run after every kernel that reads the old states of these slots (the conv outputs are
    computed from them): stream order is the only synchronisation."""
    channels, kernel_size = conv_state.shape[1], conv_state.shape[2] + 1
    num_chunks = chunk_slot.shape[0]
    assert x.stride(1) == 1 and conv_state.stride(2) == 1 and x.shape[1] == channels
    if num_chunks == 0:
        return
    block_c = 128
    _state_kernel[(num_chunks, triton.cdiv(channels, block_c))](
        x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1),
        cu_seqlens, chunk_slot, chunk_reset, channels,
        KM1=kernel_size - 1, BLOCK_J=triton.next_power_of_2(kernel_size - 1), BLOCK_C=block_c,
        **launch_options(),
    )
