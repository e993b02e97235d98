"""Mamba2 SSD on the GPU: the varlen chunked scan (prefill) and the batched single-token state
update (decode).

GPU counterparts of engine/kernels/ssd_reference.py (`ssd_chunk_scan`, `ssd_step`), with the
same recurrence per head h of group g = h // (H / G):

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * outer(x_t, B_t[g])     # (P, N)
    y_t     = state_t @ C_t[g] + D_h * x_t                                  # (P,)

Prefill: fla-core's `chunk_simple_gla` (pure Triton, DESIGN.md section 7) with q = C, k = B,
v = x * dt, g = dt * A, scale 1, in our (H, P, N) state layout (`state_v_first`). Inputs go in
fp32 (Triton multiplies in tf32), so chunk-edge states stay fp32.
Decode: `_decode_kernel`, our own: each program owns (one slot, one head, BLOCK_P rows of P),
reads that state tile once, updates it, writes it back in place and emits y.

Shapes: T tokens, H heads, P head dim, G groups, N state size, S sequences, Bd decode rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


def ssd_chunk_scan_varlen(
    x: torch.Tensor,  # (T, H, P)
    dt: torch.Tensor,  # (T, H) fp32, softplus'd and clamped
    A: torch.Tensor,  # (H,) fp32, negative
    B: torch.Tensor,  # (T, G, N)
    C: torch.Tensor,  # (T, G, N)
    D: torch.Tensor | None,  # (H,)
    initial_state: torch.Tensor,  # (S, H, P, N) fp32, not modified
    cu_seqlens: torch.Tensor,  # (S+1,) int64 on the device
    cu_seqlens_host: torch.Tensor | None = None,  # the same on the CPU (avoids a sync)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan of S sequences laid end to end: returns (y (T, H, P) fp32,
    final_state (S, H, P, N) fp32). Equal to ssd_chunk_scan per sequence within tf32 rounding."""
    from fla.ops.simple_gla import chunk_simple_gla  # carried wheel; only the GPU path needs it

    num_heads = x.shape[1]
    heads_per_group = num_heads // B.shape[1]
    x32 = x.float()
    B_h = B.float().repeat_interleave(heads_per_group, dim=1)  # (T, H, N)
    C_h = C.float().repeat_interleave(heads_per_group, dim=1)  # (T, H, N)
    y, final_state = chunk_simple_gla(
        q=C_h[None],
        k=B_h[None],
        v=(x32 * dt[..., None])[None],  # (1, T, H, P)
        g=(dt * A[None, :])[None],  # (1, T, H) log decay of each step
        scale=1.0,
        initial_state=initial_state.contiguous(),
        output_final_state=True,
        state_v_first=True,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_host,
    )
    y = y[0].float()
    if D is not None:
        y = y + D.float()[:, None] * x32
    return y, final_state


@triton.jit
def _decode_kernel(
    x_ptr, stride_xt, stride_xh,  # (T, H, P), unit P stride
    dt_ptr, stride_dtt,  # (T, H): dt fp32, or raw dt (before bias and softplus) if DT_RAW
    a_ptr, d_ptr,  # (H,) fp32: A (negative), or A_log if DT_RAW; D
    dt_bias_ptr, dt_min, dt_max,  # (H,) fp32 and the clamp, read only if DT_RAW
    b_ptr, stride_bt, stride_bg,  # (T, G, N), unit N stride
    c_ptr, stride_ct, stride_cg,  # (T, G, N)
    state_ptr, stride_ss, stride_sh, stride_sp,  # (slots, H, P, N) fp32, unit N stride
    y_ptr, stride_yt, stride_yh,  # (T, H, P) fp32
    rows_ptr, slots_ptr, reset_ptr,  # (Bd,)
    heads_per_group, P, N,
    HAS_D: tl.constexpr, DT_RAW: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i, h = tl.program_id(0), tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < P, n < N
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i)
    keep_state = tl.load(reset_ptr + i) == 0
    g = h // heads_per_group

    x = tl.load(x_ptr + row * stride_xt + h * stride_xh + p, mask=p_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dtt + h).to(tl.float32)
    if DT_RAW:  # dt = clamp(softplus(dt_raw + dt_bias)), A = -exp(A_log), as _scan_inputs
        dt += tl.load(dt_bias_ptr + h)
        dt = tl.where(dt > 20.0, dt, libdevice.log1p(tl.exp(dt)))  # F.softplus, threshold 20
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        a = -tl.exp(tl.load(a_ptr + h))
    else:
        a = tl.load(a_ptr + h)
    decay = tl.exp(dt * a)
    b = tl.load(b_ptr + row * stride_bt + g * stride_bg + n, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_ct + g * stride_cg + n, mask=n_mask, other=0.0).to(tl.float32)
    tile = state_ptr + slot * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :]
    pn_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(tile, mask=pn_mask & keep_state, other=0.0)  # (BLOCK_P, BLOCK_N)
    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(tile, state, mask=pn_mask)
    y = tl.sum(state * c[None, :], axis=1)  # (BLOCK_P,)
    if HAS_D:
        y += tl.load(d_ptr + h) * x
    tl.store(y_ptr + row * stride_yt + h * stride_yh + p, y, mask=p_mask)


def ssd_decode_update(
    x: torch.Tensor,  # (T, H, P)
    dt: torch.Tensor,  # (T, H) fp32, softplus'd and clamped
    A: torch.Tensor,  # (H,) fp32
    B: torch.Tensor,  # (T, G, N)
    C: torch.Tensor,  # (T, G, N)
    D: torch.Tensor | None,  # (H,)
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, rows' slots updated in place
    y: torch.Tensor,  # (T, H, P) fp32, rows written
    rows: torch.Tensor,  # (Bd,) int, token row of each decode sequence
    slots: torch.Tensor,  # (Bd,) int, distinct state slots
    reset: torch.Tensor,  # (Bd,) int, nonzero = start from a zero state
) -> None:
    """One step of Bd sequences in one launch: for each i, ssd_step on row rows[i] from state
    slot slots[i] (zeros if reset[i]); writes the new state to that slot and y[rows[i]].
    Touches no other slot or row."""
    num_decode = rows.shape[0]
    if num_decode == 0:
        return
    _, num_heads, head_dim = x.shape
    state_size = B.shape[2]
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_state.stride(3) == 1
    assert ssm_state.dtype == torch.float32 and y.dtype == torch.float32 and y.stride(2) == 1
    dt = dt.float()
    block_p = min(16, triton.next_power_of_2(head_dim))
    grid = (num_decode, num_heads, triton.cdiv(head_dim, block_p))
    _decode_kernel[grid](
        x, x.stride(0), x.stride(1),
        dt, dt.stride(0),
        A.float().contiguous(), D.float().contiguous() if D is not None else A,
        A, 0.0, 0.0,
        B, B.stride(0), B.stride(1),
        C, C.stride(0), C.stride(1),
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        y, y.stride(0), y.stride(1),
        rows, slots, reset,
        num_heads // B.shape[1], head_dim, state_size,
        HAS_D=D is not None, DT_RAW=False, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size),
    )


def ssd_decode_update_raw_dt(
    x: torch.Tensor,  # (T, H, P)
    dt_raw: torch.Tensor,  # (T, H), in_proj's dt columns before bias and softplus (any float dtype)
    dt_bias: torch.Tensor,  # (H,) fp32
    A_log: torch.Tensor,  # (H,) fp32
    time_step_limit: tuple[float, float],
    B: torch.Tensor,  # (T, G, N)
    C: torch.Tensor,  # (T, G, N)
    D: torch.Tensor | None,  # (H,) fp32
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, rows' slots updated in place
    y: torch.Tensor,  # (T, H, P) fp32, rows written
    rows: torch.Tensor,  # (Bd,) int
    slots: torch.Tensor,  # (Bd,) int, distinct
    reset: torch.Tensor,  # (Bd,) int, nonzero = start from a zero state
) -> None:
    """ssd_decode_update with the discretisation folded in: dt = clamp(softplus(dt_raw +
    dt_bias), *time_step_limit) and A = -exp(A_log) are computed inside the same launch (the
    PyTorch path spends six kernels on them). Same contract otherwise."""
    num_decode = rows.shape[0]
    if num_decode == 0:
        return
    _, num_heads, head_dim = x.shape
    state_size = B.shape[2]
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_state.stride(3) == 1
    assert ssm_state.dtype == torch.float32 and y.dtype == torch.float32 and y.stride(2) == 1
    assert dt_raw.stride(1) == 1 and dt_bias.dtype == A_log.dtype == torch.float32
    block_p = min(16, triton.next_power_of_2(head_dim))
    grid = (num_decode, num_heads, triton.cdiv(head_dim, block_p))
    _decode_kernel[grid](
        x, x.stride(0), x.stride(1),
        dt_raw, dt_raw.stride(0),
        A_log.contiguous(), D.contiguous() if D is not None else A_log,
        dt_bias.contiguous(), float(time_step_limit[0]), float(time_step_limit[1]),
        B, B.stride(0), B.stride(1),
        C, C.stride(0), C.stride(1),
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        y, y.stride(0), y.stride(1),
        rows, slots, reset,
        num_heads // B.shape[1], head_dim, state_size,
        HAS_D=D is not None, DT_RAW=True, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size),
    )
