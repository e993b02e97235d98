"""Gated delta-net speculative verification in one launch: every position of every
verification chunk of a step, one program per (chunk, value head, BLOCK_V columns of the
value head dim) (docs/design.md section 10).

As mamba_verify.py for Mamba2: the request's own state slot is only read, and the conv window
and the recurrent state after position i go to the chunk's scratch slot i. Program (v, h, vb)
loads its (d_k, BLOCK_V) tile of chunk v's recurrent state once and keeps it in registers
while it runs the chunk's positions one after another, storing it after each position into
that position's scratch slot. Each position: the causal conv with SiLU of the head's q and k
channels (its key head's, all d_k of them) and of its BLOCK_V v channels from the window
before the position (columns of [old window | the chunk's pre-conv inputs], read, never
written back; mamba_verify.window_column), rounded to the model dtype as the varlen conv
kernel rounds; then the gated delta rule step of fla-core's one-token recurrent kernel (the
route plain decoding takes, engine/kernels/gpu/gated_delta_rule.py): q and k L2-normalised
(x / sqrt(sum x^2 + 1e-6)), q scaled, g = -exp(A_log) softplus(a + dt_bias), beta =
sigmoid(b), S <- exp(g) S, S <- S + k (beta (v - S^T k))^T, o = S^T q, rounded to the model
dtype. The window after position i is stored into scratch slot i: the v channels by each
program, the q and k channels of a key head by its first value head's first V block.

Against the route it replaces (per position: two state copies, the varlen conv and fla's
recurrent kernel between a gather and a scatter of the slots): one launch per layer instead
of about six per position.

Padding and programmatic dependent launch as in mamba_verify.py. Reference:
engine/kernels/verification_reference.py delta_rule_verify_reference; device tests:
tests/gpu/test_verify_kernels.py (on the CPU under Triton's interpreter too).

Shapes: T tokens, Hk key heads, Hv value heads (r = Hv / Hk per key head), dk, dv head dims,
C = 2 Hk dk + Hv dv conv channels laid out [q | k | v], K conv width, V chunks, n positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.activation import softplus
from engine.kernels.gpu.mamba_verify import conv_at_position, store_window
from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous


@triton.jit
def _delta_rule_verify_kernel(
    qkv_ptr, stride_qkvt,  # (T, C) pre-conv, unit channel stride
    b_ptr, stride_bt, a_ptr, stride_at,  # (T, Hv) each, unit head stride
    conv_state_ptr, stride_css, stride_csc,  # (slots, C, K-1), unit last stride
    conv_w_ptr,  # (C, K) contiguous
    a_log_ptr, dt_bias_ptr,  # (Hv,) fp32 each
    scale,
    state_ptr, stride_ss, stride_sh, stride_sk,  # (slots, Hv, dk, dv) fp32, unit dv stride
    y_ptr, stride_yt, stride_yh,  # (T, Hv, dv), unit dv stride
    first_rows_ptr, lengths_ptr, source_slots_ptr,  # (V,) each
    scratch_ptr, stride_scratch,  # (n, V)
    heads_per_key, DK, DV, key_dim,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    v, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // heads_per_key
    kk = tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = kk < DK, vv < DV
    first_row = tl.load(first_rows_ptr + v)
    length = tl.load(lengths_ptr + v)
    source = tl.load(source_slots_ptr + v).to(tl.int64)
    tile_offsets = h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    tile_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(state_ptr + source * stride_ss + tile_offsets, mask=tile_mask, other=0.0)
    decay_rate = -tl.exp(tl.load(a_log_ptr + h))
    dt_bias = tl.load(dt_bias_ptr + h)
    wait_for_previous(USE_PDL)

    q_channels = hk * DK + kk
    k_channels = key_dim + q_channels
    v_channels = 2 * key_dim + h * DV + vv
    writes_key = (h % heads_per_key == 0) & (vb == 0)  # this program stores q's and k's windows
    conv_src = conv_state_ptr + source * stride_css
    model_dtype = y_ptr.dtype.element_ty
    for i in range(0, length):
        row = first_row + i
        slot = tl.load(scratch_ptr + i * stride_scratch + v).to(tl.int64)
        q = conv_at_position(conv_src, stride_csc, qkv_ptr, stride_qkvt, first_row, i, conv_w_ptr, conv_w_ptr,
                             q_channels, k_mask, K, False, True).to(model_dtype).to(tl.float32)
        k = conv_at_position(conv_src, stride_csc, qkv_ptr, stride_qkvt, first_row, i, conv_w_ptr, conv_w_ptr,
                             k_channels, k_mask, K, False, True).to(model_dtype).to(tl.float32)
        value = conv_at_position(conv_src, stride_csc, qkv_ptr, stride_qkvt, first_row, i, conv_w_ptr, conv_w_ptr,
                                 v_channels, v_mask, K, False, True).to(model_dtype).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        g = decay_rate * softplus(tl.load(a_ptr + row * stride_at + h).to(tl.float32) + dt_bias)
        beta = tl.sigmoid(tl.load(b_ptr + row * stride_bt + h).to(tl.float32))
        state = state * tl.exp(g)
        delta = (value - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(state_ptr + slot * stride_ss + tile_offsets, state, mask=tile_mask)
        tl.store(y_ptr + row * stride_yt + h * stride_yh + vv, out.to(model_dtype), mask=v_mask)
        conv_dst = conv_state_ptr + slot * stride_css
        store_window(conv_src, stride_csc, qkv_ptr, stride_qkvt, first_row, i, conv_dst, stride_csc,
                     v_channels, v_mask, K)
        store_window(conv_src, stride_csc, qkv_ptr, stride_qkvt, first_row, i, conv_dst, stride_csc,
                     q_channels, k_mask & writes_key, K)
        store_window(conv_src, stride_csc, qkv_ptr, stride_qkvt, first_row, i, conv_dst, stride_csc,
                     k_channels, k_mask & writes_key, K)


def block_v(value_head_dim: int) -> int:
    """Columns of the value head dim each program owns (its state tile is d_k x BLOCK_V)."""
    return min(32, triton.next_power_of_2(value_head_dim))


def delta_rule_verify(
    qkv: torch.Tensor,  # (T, C) pre-conv, unit channel stride
    b: torch.Tensor,  # (T, Hv) raw beta, unit head stride
    a: torch.Tensor,  # (T, Hv) raw decay input, unit head stride
    conv_state: torch.Tensor,  # (num_slots, C, K-1), qkv's dtype: scratch slots written
    conv_weight: torch.Tensor,  # (C, K), no bias
    A_log: torch.Tensor,  # (Hv,) fp32
    dt_bias: torch.Tensor,  # (Hv,) fp32
    scale: float,
    recurrent_state: torch.Tensor,  # (num_slots, Hv, dk, dv) fp32: scratch slots written
    y: torch.Tensor,  # (T, Hv, dv) qkv's dtype, unit dv stride: the chunks' rows written
    first_rows: torch.Tensor,  # (V,) int64
    lengths: torch.Tensor,  # (V,) int64, each 1..n
    source_slots: torch.Tensor,  # (V,) int64, only read
    scratch_slots: torch.Tensor,  # (n, V) int64, unit V stride
    num_key_heads: int,
    num_warps: int = 4,  # compiled for sm_90 (d_k 128, BLOCK_V 32): no spills at 4, spills at 8
) -> None:
    """Each verification chunk's positions, chained, in one launch (module docstring): for
    chunk v and i < lengths[v], row first_rows[v] + i through the conv step and the gated
    delta rule step from the state before it (source_slots[v]'s, then position i - 1's); y at
    the row written, the conv window and recurrent state after it written to
    scratch_slots[i, v]. Nothing else is written."""
    num_chunks = first_rows.shape[0]
    if num_chunks == 0:
        return
    num_value_heads, key_head_dim, value_head_dim = recurrent_state.shape[1:]
    channels, kernel_size = conv_weight.shape
    key_dim = num_key_heads * key_head_dim
    assert qkv.shape[1] == channels == 2 * key_dim + num_value_heads * value_head_dim
    assert conv_state.shape[1:] == (channels, kernel_size - 1) and conv_state.stride(2) == 1
    assert qkv.stride(1) == 1 and b.stride(1) == 1 and a.stride(1) == 1
    assert recurrent_state.dtype == torch.float32 and recurrent_state.stride(3) == 1
    assert A_log.dtype == dt_bias.dtype == torch.float32
    assert y.shape[1:] == (num_value_heads, value_head_dim) and y.stride(2) == 1 and y.dtype == qkv.dtype
    assert scratch_slots.shape[1] == num_chunks and scratch_slots.stride(1) == 1
    assert lengths.shape == source_slots.shape == (num_chunks,)
    assert num_value_heads % num_key_heads == 0
    columns = block_v(value_head_dim)
    grid = (num_chunks, num_value_heads, triton.cdiv(value_head_dim, columns))
    _delta_rule_verify_kernel[grid](
        qkv, qkv.stride(0), b, b.stride(0), a, a.stride(0),
        conv_state, conv_state.stride(0), conv_state.stride(1),
        conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(), float(scale),
        recurrent_state, recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        y, y.stride(0), y.stride(1),
        first_rows, lengths, source_slots, scratch_slots, scratch_slots.stride(0),
        num_value_heads // num_key_heads, key_head_dim, value_head_dim, key_dim,
        K=kernel_size, BLOCK_K=triton.next_power_of_2(key_head_dim), BLOCK_V=columns,
        num_warps=num_warps, **launch_options(),
    )
