"""Mamba2 speculative verification in one launch: every position of every verification chunk
of a step, one program per (chunk, head, BLOCK_P rows of P) (docs/design.md section 10).

A verification chunk is a request's last token and its k drafts, n = k + 1 positions. The
request's own state slot is only read; the state after position i (the conv window and the
SSD state) goes to the chunk's scratch slot i, so that the commit of the kept position can
copy it back later (engine/speculative/verify.py). Program (v, h, pb) loads its SSD state
tile of chunk v's slot once, keeps it in registers while it runs the chunk's positions one
after another (each position: the conv step with SiLU from the window before it, rounded to
the model dtype, then the SSD step, mamba_decode.py's numerics), and stores the tile after
each position into that position's scratch slot. The window before position i is read from
[old window | the chunk's pre-conv inputs] (position i's K-1 taps are columns i .. i+K-2 of
that concatenation; data movement, never written back), so no program depends on another's
writes. The window after position i is stored into scratch slot i: the x channels of
(h, pb) by that program, the B and C channels of a group by the group's first head's first
P block.

Against the route it replaces (mamba_decode.py's fused decode kernel launched once per
position with a state copy before each launch): one launch per layer instead of about three
per position, and each state tile read once and written n times instead of read and written
twice per position.

Padding (the verification CUDA graphs, engine/speculative/verify_graphs.py): a chunk whose
scratch slots include its own slot (a padding chunk on the graph scratch slot) reads what
other programs write; what it leaves there is junk nobody reads, as for the decode graphs.

Programmatic dependent launch: engine/kernels/gpu/pdl.py's contract. Before the wait the
program loads the plan (copied before the pass), the weights and its tile of the chunk's own
SSD state (only read within the pass); everything else after.

Reference: engine/kernels/verification_reference.py mamba_verify_reference; device tests:
tests/gpu/test_verify_kernels.py (on the CPU under Triton's interpreter too).

Shapes: T tokens, H heads, P head dim, G groups, N state size, K conv width, V chunks,
n positions (the longest chunk), conv_dim = H P + 2 G N laid out [x (H P) | B (G N) | C (G N)].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous
from engine.kernels.gpu.ssd import decode_block_p, ssd_state_step


@triton.jit
def window_column(
    conv_src_ptr, stride_csc,  # the chunk's own slot's conv window (C, K-1), unit last stride
    x_ptr, stride_xt,  # (T, C) pre-conv inputs, unit channel stride
    first_row, j,  # column j of [old window (K-1 columns) | inputs of rows first_row, ...]
    channels, mask,
    K: tl.constexpr,
):
    """Column j of the chunk's [old window | pre-conv inputs] at `channels`, in the inputs'
    dtype: the old window's column j for j < K-1, else the input row first_row + j - (K-1)."""
    old = tl.load(conv_src_ptr + channels * stride_csc + j, mask=mask & (j < K - 1), other=0.0)
    row = first_row + tl.maximum(j - (K - 1), 0)
    new = tl.load(x_ptr + row * stride_xt + channels, mask=mask & (j >= K - 1), other=0.0)
    return tl.where(j < K - 1, old.to(new.dtype), new)


@triton.jit
def conv_at_position(
    conv_src_ptr, stride_csc, x_ptr, stride_xt, first_row, i,
    w_ptr, b_ptr,  # (C, K) contiguous, (C,) (HAS_BIAS)
    channels, mask,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """The causal conv at position i of the chunk, fp32: the K taps over columns i .. i+K-1 of
    [old window | inputs], oldest first, then the bias, then SiLU if asked (conv.py's order)."""
    acc = tl.zeros(channels.shape, dtype=tl.float32)
    for k in tl.static_range(K):
        value = window_column(conv_src_ptr, stride_csc, x_ptr, stride_xt, first_row, i + k, channels, mask, K)
        w = tl.load(w_ptr + channels * K + k, mask=mask, other=0.0).to(tl.float32)
        acc += value.to(tl.float32) * w
    if HAS_BIAS:
        acc += tl.load(b_ptr + channels, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit
def store_window(
    conv_src_ptr, stride_csc, x_ptr, stride_xt, first_row, i,
    conv_dst_ptr, stride_cdc,  # the scratch slot's conv window (C, K-1), unit last stride
    channels, mask,
    K: tl.constexpr,
):
    """The window after position i (columns i+1 .. i+K-1 of [old window | inputs]) into the
    scratch slot's window at `channels`."""
    for t in tl.static_range(K - 1):
        value = window_column(conv_src_ptr, stride_csc, x_ptr, stride_xt, first_row, i + 1 + t, channels, mask, K)
        tl.store(conv_dst_ptr + channels * stride_cdc + t, value.to(conv_dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mamba_verify_kernel(
    xbc_ptr, stride_xbct,  # (T, conv_dim) pre-conv, unit channel stride
    conv_state_ptr, stride_css, stride_csc,  # (slots, conv_dim, K-1), unit last stride
    conv_w_ptr, conv_b_ptr,  # (conv_dim, K) contiguous, (conv_dim,) (HAS_BIAS)
    dt_ptr, stride_dtt,  # (T, H): raw dt
    a_log_ptr, dt_bias_ptr, dt_min, dt_max,  # (H,) fp32 each, the clamp
    state_ptr, stride_ss, stride_sh, stride_sp,  # (slots, H, P, N) fp32, unit N stride
    x_out_ptr, stride_xot, stride_xoh,  # (T, H, P) post-conv x, unit P stride
    y_ptr, stride_yt, stride_yh,  # (T, H, P) fp32
    first_rows_ptr, lengths_ptr, source_slots_ptr,  # (V,) each
    scratch_ptr, stride_scratch,  # (n, V): scratch slot of position i of chunk v at i * stride + v
    heads_per_group, P, N, x_width, group_width,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    v, h, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // heads_per_group
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < P, n < N
    first_row = tl.load(first_rows_ptr + v)
    length = tl.load(lengths_ptr + v)
    source = tl.load(source_slots_ptr + v).to(tl.int64)  # slot * stride passes 2**31 from slot 4,096
    tile_offsets = h * stride_sh + p[:, None] * stride_sp + n[None, :]
    tile_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(state_ptr + source * stride_ss + tile_offsets, mask=tile_mask, other=0.0)
    dt_bias, a_log = tl.load(dt_bias_ptr + h), tl.load(a_log_ptr + h)
    wait_for_previous(USE_PDL)

    x_channels = h * P + p
    b_channels = x_width + g * N + n
    c_channels = b_channels + group_width
    writes_group = (h % heads_per_group == 0) & (pb == 0)  # this program stores B's and C's windows
    conv_src = conv_state_ptr + source * stride_css
    model_dtype = x_out_ptr.dtype.element_ty
    for i in range(0, length):
        row = first_row + i
        slot = tl.load(scratch_ptr + i * stride_scratch + v).to(tl.int64)
        x = conv_at_position(conv_src, stride_csc, xbc_ptr, stride_xbct, first_row, i, conv_w_ptr, conv_b_ptr,
                             x_channels, p_mask, K, HAS_BIAS, True).to(model_dtype)
        b = conv_at_position(conv_src, stride_csc, xbc_ptr, stride_xbct, first_row, i, conv_w_ptr, conv_b_ptr,
                             b_channels, n_mask, K, HAS_BIAS, True).to(model_dtype)
        c = conv_at_position(conv_src, stride_csc, xbc_ptr, stride_xbct, first_row, i, conv_w_ptr, conv_b_ptr,
                             c_channels, n_mask, K, HAS_BIAS, True).to(model_dtype)
        dt_raw = tl.load(dt_ptr + row * stride_dtt + h).to(tl.float32)
        # the SSD step (ssd.py's update, shared with plain decoding); the state stays in registers
        state = ssd_state_step(x.to(tl.float32), b.to(tl.float32), dt_raw, dt_bias, a_log, dt_min, dt_max, state)
        tl.store(state_ptr + slot * stride_ss + tile_offsets, state, mask=tile_mask)
        y = tl.sum(state * c.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + row * stride_yt + h * stride_yh + p, y, mask=p_mask)
        tl.store(x_out_ptr + row * stride_xot + h * stride_xoh + p, x, mask=p_mask)
    # the windows after each position, in a loop of their own (fewer live registers above)
    for i in range(0, length):
        slot = tl.load(scratch_ptr + i * stride_scratch + v).to(tl.int64)
        conv_dst = conv_state_ptr + slot * stride_css
        store_window(conv_src, stride_csc, xbc_ptr, stride_xbct, first_row, i, conv_dst, stride_csc,
                     x_channels, p_mask, K)
        store_window(conv_src, stride_csc, xbc_ptr, stride_xbct, first_row, i, conv_dst, stride_csc,
                     b_channels, n_mask & writes_group, K)
        store_window(conv_src, stride_csc, xbc_ptr, stride_xbct, first_row, i, conv_dst, stride_csc,
                     c_channels, n_mask & writes_group, K)


def mamba_verify(
    xBC: torch.Tensor,  # (T, conv_dim) pre-conv, unit channel stride
    dt_raw: torch.Tensor,  # (T, H), in_proj's dt columns before bias and softplus, unit H stride
    conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1), xBC's dtype: scratch slots written
    conv_weight: torch.Tensor,  # (conv_dim, K)
    conv_bias: torch.Tensor | None,  # (conv_dim,)
    dt_bias: torch.Tensor,  # (H,) fp32
    A_log: torch.Tensor,  # (H,) fp32
    time_step_limit: tuple[float, float],
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32: scratch slots written
    x_out: torch.Tensor,  # (T, H, P) xBC's dtype, unit P stride: the chunks' rows written
    y: torch.Tensor,  # (T, H, P) fp32, unit P stride: the chunks' rows written
    first_rows: torch.Tensor,  # (V,) int64: chunk v's rows first_rows[v] .. + lengths[v] - 1
    lengths: torch.Tensor,  # (V,) int64, each 1..n
    source_slots: torch.Tensor,  # (V,) int64: the chunks' own state slots, only read
    scratch_slots: torch.Tensor,  # (n, V) int64, unit V stride: scratch slot of position i of chunk v
    block_p: int | None = None,  # rows of P per program; None: ssd.py's decode_block_p()
    num_warps: int = 8,  # compiled for sm_90 (BLOCK_P 16, N 128): no spills at 8, spills at 4
) -> None:
    """Each verification chunk's positions, chained, in one launch (module docstring): for
    chunk v and i < lengths[v], row r = first_rows[v] + i goes through the conv step with SiLU
    from the window before it (source_slots[v]'s window then the chunk's inputs), rounded to
    xBC's dtype (its x columns written to x_out[r]), and the SSD step without D from the state
    before it (source_slots[v]'s, then position i - 1's), dt = clamp(softplus(dt_raw + dt_bias),
    *time_step_limit), A = -exp(A_log); y[r] written, the conv window and SSD state after the
    position written to scratch_slots[i, v]. Nothing else is written: not the source slots,
    not the scratch slots of positions past a chunk's length."""
    num_chunks = first_rows.shape[0]
    if num_chunks == 0:
        return
    num_heads, head_dim, state_size = ssm_state.shape[1:]
    conv_dim, kernel_size = conv_weight.shape
    group_width = (conv_dim - num_heads * head_dim) // 2
    assert xBC.shape[1] == conv_dim and group_width % state_size == 0
    assert conv_state.shape[1:] == (conv_dim, kernel_size - 1) and conv_state.stride(2) == 1
    assert xBC.stride(1) == 1 and dt_raw.stride(1) == 1
    assert ssm_state.dtype == torch.float32 and ssm_state.stride(3) == 1
    assert dt_bias.dtype == A_log.dtype == torch.float32
    assert x_out.shape[1:] == (num_heads, head_dim) and y.shape[1:] == (num_heads, head_dim)
    assert x_out.stride(2) == 1 and y.stride(2) == 1 and y.dtype == torch.float32
    assert x_out.dtype == xBC.dtype, "the conv output is rounded to the model dtype, xBC's"
    assert scratch_slots.shape[1] == num_chunks and scratch_slots.stride(1) == 1
    assert lengths.shape == source_slots.shape == (num_chunks,)
    num_groups = group_width // state_size
    if block_p is None:
        block_p = decode_block_p(head_dim)
    conv_weight = conv_weight.contiguous()
    grid = (num_chunks, num_heads, triton.cdiv(head_dim, block_p))
    _mamba_verify_kernel[grid](
        xBC, xBC.stride(0),
        conv_state, conv_state.stride(0), conv_state.stride(1),
        conv_weight, conv_bias if conv_bias is not None else conv_weight,
        dt_raw, dt_raw.stride(0),
        A_log.contiguous(), dt_bias.contiguous(), float(time_step_limit[0]), float(time_step_limit[1]),
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        x_out, x_out.stride(0), x_out.stride(1),
        y, y.stride(0), y.stride(1),
        first_rows, lengths, source_slots, scratch_slots, scratch_slots.stride(0),
        num_heads // num_groups, head_dim, state_size, num_heads * head_dim, group_width,
        K=kernel_size, HAS_BIAS=conv_bias is not None,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size),
        num_warps=num_warps, **launch_options(),
    )
