"""Mamba2 SSD on the GPU: the varlen chunked scan (prefill) and the batched single-token state
update (decode).

GPU counterparts of engine/kernels/ssd_reference.py (`ssd_chunk_scan`, `ssd_step`) with D
None, the same recurrence per head h of group g = h // (H / G):

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * outer(x_t, B_t[g])     # (P, N)
    y_t     = state_t @ C_t[g]                                              # (P,)

Neither applies the D skip (y_t + D_h * x_t): the gated RMSNorm that reads y next adds it
(engine/kernels/gpu/fused_norm.py, gated_rms_norm's skip), which saves a pass over the fp32 y.

Prefill: `scan_inputs`, our own kernel, turns the conv output and raw dt into q = C, k = B,
v = x * dt, g = dt * A (fp32, per head) in one launch; fla-core's `chunk_simple_gla` kernels
(pure Triton, docs/design.md section 7: its cumsum, chunk-state and output kernels, called one by
one in `chunk_scan`) scan them with scale 1 in our (H, P, N) state layout (`state_v_first`);
fp32 inputs (Triton multiplies in tf32), so chunk-edge states stay fp32.
Decode: `_decode_kernel`, our own: each program owns (one slot, one head, BLOCK_P rows of P),
reads that state tile once, updates it, writes it back in place and emits y.

Shapes: T tokens, H heads, P head dim, G groups, N state size, S sequences, Bd decode rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.activation import softplus
from engine.kernels.gpu.in_pass_capture import SCAN_CHUNK, InPassCapturePlan, ScanChunks, scan_with_captures
from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous


def chunk_scan(
    q: torch.Tensor,  # (T, H, N) fp32: C of each head's group
    k: torch.Tensor,  # (T, H, N) fp32: B of each head's group
    v: torch.Tensor,  # (T, H, P) fp32: x * dt
    g: torch.Tensor,  # (T, H) fp32: dt * A, the log decay of each step
    initial_state: torch.Tensor,  # (S, H, P, N) fp32, not modified
    cu_seqlens: torch.Tensor,  # (S+1,) int64 on the device
    chunks: ScanChunks | None,  # the chunks of the S sequences; None when S = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked scan of S sequences laid end to end, on the SSD's prepared inputs: per head,
    state_t = exp(g_t) state_{t-1} + outer(v_t, k_t), y_t = state_t @ q_t. Returns (y (T, H, P)
    fp32, final states (S, H, P, N) fp32, the state at the start of every chunk (NS, H, P, N)
    fp32: chunk c of sequence s, in order, each sequence cut into SCAN_CHUNK rows from its start).

    fla-core's chunk_simple_gla forward, step by step (its cumsum, chunk_fwd_h, chunk_fwd_o,
    pinned at fla-core 0.6.0), for the chunk-start states it computes and the public function
    drops. fp32 inputs, which Triton multiplies in tf32, so the states stay fp32. One sequence
    (S = 1) takes the fixed-length path (which a CUDA graph can capture), several the varlen
    path, given the chunks its kernels walk (fla-core's chunk_fwd_h would read their count back
    from the device, and prepare_chunk_indices wait for their copy: once per layer); same
    kernels, same chunk edges."""
    from fla.ops.common.chunk_h import chunk_fwd_h  # carried wheel; only the GPU path needs it
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    assert chunks is not None or initial_state.shape[0] == 1, "several sequences need their chunks"
    cu, indices = (None, None) if chunks is None else (cu_seqlens, chunks.indices)
    q, k, v = q[None], k[None], v[None]
    # log2 decays, cumulated within each chunk (the kernels use exp2)
    g = chunk_local_cumsum(g[None], chunk_size=SCAN_CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=indices)
    if chunks is None:
        h, final_state = chunk_fwd_h(
            k=k, v=v, g=g, h0=initial_state.contiguous(), output_final_state=True, state_v_first=True,
            chunk_size=SCAN_CHUNK,
        )
    else:
        h, final_state = _chunk_states_varlen(k, v, g, initial_state.contiguous(), cu_seqlens, chunks)
    y = chunk_fwd_o(
        q=q, k=k, v=v, h=h, g=g, scale=1.0, state_v_first=True, cu_seqlens=cu, chunk_size=SCAN_CHUNK,
        chunk_indices=indices,
    )
    return y[0].float(), final_state, h[0]


def _chunk_states_varlen(
    k: torch.Tensor,  # (1, T, H, N) fp32
    v: torch.Tensor,  # (1, T, H, P) fp32
    g: torch.Tensor,  # (1, T, H) fp32, log2 decays cumulated within each chunk
    initial_state: torch.Tensor,  # (S, H, P, N) fp32, contiguous
    cu_seqlens: torch.Tensor,  # (S+1,)
    chunks: ScanChunks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core 0.6.0's chunk_fwd_h for several sequences, V-first states, fp32 inputs (the
    states fp32 too), its kernel launched as chunk_fwd_h launches it, with the chunk offsets and
    count taken from `chunks` instead of computed on the device and read back (.item()).
    Returns (h (1, NS, H, P, N): the state at the start of every chunk, final (S, H, P, N))."""
    from fla.ops.common.chunk_h import chunk_fwd_kernel_h

    _, T, H, N = k.shape
    P = v.shape[-1]
    S = cu_seqlens.shape[0] - 1
    h = k.new_empty(1, chunks.count, H, P, N)
    final = k.new_empty(S, H, P, N, dtype=torch.float)
    grid = lambda meta: (triton.cdiv(N, meta["BK"]) * triton.cdiv(P, meta["BV"]) * S * H,)  # noqa: E731
    chunk_fwd_kernel_h[grid](
        k=k, v=v, h=h, g=g, g_gamma=None, gk=None, gv=None, h0=initial_state, ht=final,
        cu_seqlens=cu_seqlens, split_offsets=chunks.offsets, T=T, H=H, K=N, V=P,
        BT=SCAN_CHUNK, BS=SCAN_CHUNK, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
        STATE_V_FIRST=True,
    )
    return h, final


@triton.jit
def _scan_inputs_kernel(
    xbc_ptr, stride_xt,  # (T, conv_dim) post-conv rows [x (H P) | B (G N) | C (G N)], unit stride
    dt_ptr, stride_dtt,  # (T, H) raw dt, unit H stride
    dt_bias_ptr, a_log_ptr, dt_min, dt_max,  # (H,) fp32 x 2 and the clamp
    rows_ptr, valid_ptr,  # (Tp,): row of each output row, -1: zeros (HAS_ROWS); nonzero if real (HAS_VALID)
    q_ptr, k_ptr, v_ptr, g_ptr,  # (Tp, H, N), (Tp, H, N), (Tp, H, P), (Tp, H) fp32, contiguous
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, GN: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_VALID: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row = t
    if HAS_ROWS:
        row = tl.load(rows_ptr + t)
    real = row >= 0  # else a padding row of an in-pass capture: all zeros (identity step)
    row = tl.maximum(row, 0)
    src = xbc_ptr + row * stride_xt
    dt = tl.load(dt_ptr + row * stride_dtt + h).to(tl.float32) + tl.load(dt_bias_ptr + h)
    dt = softplus(dt)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(real, dt, 0.0)
    if HAS_VALID:  # a padding row of a graph: decay 1 and no input, the state passes unchanged
        dt = tl.where(tl.load(valid_ptr + t) != 0, dt, 0.0)
    tl.store(g_ptr + t * H + h, dt * -tl.exp(tl.load(a_log_ptr + h)))
    p = tl.arange(0, BLOCK_P)
    p_mask = (p < P)[None, :]
    x = tl.load(src + h[:, None] * P + p[None, :], mask=p_mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_P)
    tl.store(v_ptr + (t * H + h[:, None]) * P + p[None, :], x * dt[:, None], mask=p_mask)
    n = tl.arange(0, BLOCK_N)
    n_mask = (n < N)[None, :]
    group = (h // HEADS_PER_GROUP)[:, None] * N + n[None, :]  # (BLOCK_H, BLOCK_N) offsets in B and C
    out = (t * H + h[:, None]) * N + n[None, :]
    b = tl.load(src + H * P + group, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(src + H * P + GN + group, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(k_ptr + out, tl.where(real, b, 0.0), mask=n_mask)
    tl.store(q_ptr + out, tl.where(real, c, 0.0), mask=n_mask)


def scan_inputs(
    xBC: torch.Tensor,  # (T, H P + 2 G N) post-conv, unit channel stride
    dt_raw: torch.Tensor,  # (T, H), in_proj's dt columns before bias and softplus
    dt_bias: torch.Tensor,  # (H,) fp32
    A_log: torch.Tensor,  # (H,) fp32
    time_step_limit: tuple[float, float],
    shape: tuple[int, int, int, int],  # (H, P, G, N)
    rows: torch.Tensor | None = None,  # (Tp,) int: the row of each output row, -1: a zero row; None: all T rows
    valid: torch.Tensor | None = None,  # (Tp,) bool: False rows get dt = 0; None: all real
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked scan's inputs for the prefill rows in one launch: (q = C per head (Tp, H, N),
    k = B per head (Tp, H, N), v = x * dt (Tp, H, P), g = dt * A (Tp, H)), all fp32, with
    dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit) and A = -exp(A_log). The PyTorch
    ops it replaces (Mamba2Mixer._scan_inputs, the fp32 casts, the repeats over heads and the
    products) take about fourteen launches and as many passes over the rows. A row -1 in rows
    gives q = k = v = 0 and g = 0 (an identity step of the scan)."""
    H, P, G, N = shape
    num_rows = xBC.shape[0] if rows is None else rows.shape[0]
    assert xBC.stride(1) == 1 and dt_raw.stride(1) == 1 and xBC.shape[1] == H * P + 2 * G * N
    new = lambda *shape: xBC.new_empty(*shape, dtype=torch.float32)  # noqa: E731
    q, k, v, g = new(num_rows, H, N), new(num_rows, H, N), new(num_rows, H, P), new(num_rows, H)
    if num_rows == 0:
        return q, k, v, g
    block_h = min(16, H & -H)  # the largest power of two dividing H (a rank's heads: 48 / 2 = 24, ...)
    _scan_inputs_kernel[(num_rows, H // block_h)](
        xBC, xBC.stride(0), dt_raw, dt_raw.stride(0),
        dt_bias, A_log, float(time_step_limit[0]), float(time_step_limit[1]),
        rows if rows is not None else dt_bias, valid if valid is not None else dt_bias,
        q, k, v, g,
        H=H, P=P, N=N, GN=G * N, HEADS_PER_GROUP=H // G, BLOCK_H=block_h,
        BLOCK_P=triton.next_power_of_2(P), BLOCK_N=triton.next_power_of_2(N),
        HAS_ROWS=rows is not None, HAS_VALID=valid is not None, **launch_options(),
    )
    return q, k, v, g


def ssd_prefill_scan(
    xBC: torch.Tensor,  # (T, H P + 2 G N) post-conv
    dt_raw: torch.Tensor,  # (T, H)
    dt_bias: torch.Tensor,  # (H,) fp32
    A_log: torch.Tensor,  # (H,) fp32
    time_step_limit: tuple[float, float],
    shape: tuple[int, int, int, int],  # (H, P, G, N)
    initial_state: torch.Tensor,  # (S, H, P, N) fp32
    cu_seqlens: torch.Tensor,  # (S+1,) over the prefill rows
    chunks: ScanChunks | None,  # the scan's chunks; None when S = 1
    rows: torch.Tensor | None = None,  # (Tp,) the prefill rows; None: all T rows
    valid: torch.Tensor | None = None,  # (Tp,) bool, see scan_inputs
    in_pass: InPassCapturePlan | None = None,
    in_pass_states: torch.Tensor | None = None,  # (Sc, H, P, N): with in_pass, written
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 prefill scan from the conv output and raw dt: scan_inputs and the chunked
    scan (with in_pass, scan_with_captures, which also writes the states at the captures).
    Returns (y (Tp, H, P) fp32 without the D skip, final states (S, H, P, N) fp32); equal to
    ssd_chunk_scan with D None per sequence within tf32 rounding."""
    limits = (dt_bias, A_log, time_step_limit, shape)
    if in_pass is None:
        q, k, v, g = scan_inputs(xBC, dt_raw, *limits, rows, valid)
        y, final_state, _ = chunk_scan(q, k, v, g, initial_state, cu_seqlens, chunks)
    else:  # the scan's own rows: the prefill rows, padding before each captured chunk
        q, k, v, g = scan_inputs(xBC, dt_raw, *limits, in_pass.scan_rows)
        y, final_state = scan_with_captures(chunk_scan, q, k, v, g, initial_state, in_pass, in_pass_states)
    return y, final_state


@triton.jit
def decode_program(
    rows_ptr, slots_ptr, reset_ptr,  # (Bd,) the step's plan
    heads_per_group, P, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """What program (i, h, pb) of a decode grid (Bd, H, cdiv(P, BLOCK_P)) works on. Returns
    (h, g, p, n, p_mask, n_mask, row, slot, keep_state): head h of group g, its BLOCK_P rows p
    of P and the BLOCK_N columns n of N with their masks, the token row rows[i], the state slot
    slots[i] (int64) and whether that slot's state is read (reset[i] == 0). It loads the plan,
    so under PDL call it where the plan may be read. Shared by _decode_kernel and
    mamba_decode.py's fused kernel."""
    i, h = tl.program_id(0), tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i).to(tl.int64)  # slot * stride passes 2**31 from slot 4,096
    keep_state = tl.load(reset_ptr + i) == 0
    return h, h // heads_per_group, p, n, p < P, n < N, row, slot, keep_state


@triton.jit
def ssd_state_step(
    x, b,  # (BLOCK_P,) the token's x slice of one head, (BLOCK_N,) its group's B; fp32
    dt_raw, dt_bias, a_log,  # the head's raw dt, dt_bias and A_log, fp32 scalars
    dt_min, dt_max,
    state,  # (BLOCK_P, BLOCK_N) fp32, the old state
):
    """The SSD state update of a head's BLOCK_P state rows: dt = clamp(softplus(dt_raw +
    dt_bias)) (F.softplus, threshold 20), A = -exp(A_log), returns exp(dt A) state + dt x B^T
    (fp32). The one definition of the update for the decode kernels and mamba_verify.py."""
    dt = dt_raw + dt_bias
    dt = softplus(dt)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    a = -tl.exp(a_log)
    decay = tl.exp(dt * a)
    return state * decay + (dt * x)[:, None] * b[None, :]


@triton.jit
def ssd_decode_step(
    x, b, c,  # (BLOCK_P,) the token's x slice of one head, (BLOCK_N,) its group's B and C; fp32
    dt_raw, dt_bias, a_log,  # the head's raw dt, dt_bias and A_log, fp32 scalars
    dt_min, dt_max,
    state,  # (BLOCK_P, BLOCK_N) fp32, the old state (zeros for a reset row), loaded by the caller
    tile, tile_mask,  # (BLOCK_P, BLOCK_N) pointers into the head's fp32 state (P rows, N columns)
):
    """One SSD step of a head's BLOCK_P state rows: the state update (ssd_state_step), stored
    to `tile`, and y = state C. Returns y (BLOCK_P,) fp32. The one definition of the step for
    _decode_kernel and mamba_decode.py's fused kernel (which loads the old state before its
    PDL wait, so the load is the caller's)."""
    state = ssd_state_step(x, b, dt_raw, dt_bias, a_log, dt_min, dt_max, state)
    tl.store(tile, state, mask=tile_mask)
    return tl.sum(state * c[None, :], axis=1)


@triton.jit
def _decode_kernel(
    x_ptr, stride_xt, stride_xh,  # (T, H, P), unit P stride
    dt_ptr, stride_dtt,  # (T, H): raw dt (in_proj's columns, before bias and softplus)
    a_log_ptr,  # (H,) fp32
    dt_bias_ptr, dt_min, dt_max,  # (H,) fp32 and the clamp
    b_ptr, stride_bt, stride_bg,  # (T, G, N), unit N stride
    c_ptr, stride_ct, stride_cg,  # (T, G, N)
    state_ptr, stride_ss, stride_sh, stride_sp,  # (slots, H, P, N) fp32, unit N stride
    y_ptr, stride_yt, stride_yh,  # (T, H, P) fp32
    rows_ptr, slots_ptr, reset_ptr,  # (Bd,)
    heads_per_group, P, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    h, g, p, n, p_mask, n_mask, row, slot, keep_state = decode_program(
        rows_ptr, slots_ptr, reset_ptr, heads_per_group, P, N, BLOCK_P, BLOCK_N)

    x = tl.load(x_ptr + row * stride_xt + h * stride_xh + p, mask=p_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bt + g * stride_bg + n, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_ct + g * stride_cg + n, mask=n_mask, other=0.0).to(tl.float32)
    tile = state_ptr + slot * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :]
    tile_mask = p_mask[:, None] & n_mask[None, :]
    y = ssd_decode_step(
        x, b, c, tl.load(dt_ptr + row * stride_dtt + h).to(tl.float32), tl.load(dt_bias_ptr + h),
        tl.load(a_log_ptr + h), dt_min, dt_max, tl.load(tile, mask=tile_mask & keep_state, other=0.0),
        tile, tile_mask,
    )
    tl.store(y_ptr + row * stride_yt + h * stride_yh + p, y, mask=p_mask)


def ssd_decode_update(
    x: torch.Tensor,  # (T, H, P)
    dt_raw: torch.Tensor,  # (T, H), in_proj's dt columns before bias and softplus (any float dtype)
    dt_bias: torch.Tensor,  # (H,) fp32
    A_log: torch.Tensor,  # (H,) fp32
    time_step_limit: tuple[float, float],
    B: torch.Tensor,  # (T, G, N)
    C: torch.Tensor,  # (T, G, N)
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, rows' slots updated in place
    y: torch.Tensor,  # (T, H, P) fp32, rows written
    rows: torch.Tensor,  # (Bd,) int
    slots: torch.Tensor,  # (Bd,) int, distinct
    reset: torch.Tensor,  # (Bd,) int, nonzero = start from a zero state
    block_p: int | None = None,  # rows of P per program; None: decode_block_p()
    num_warps: int = 4,
) -> None:
    """One step of Bd sequences in one launch: for each i, ssd_step with D None (y without the
    D skip) on row rows[i] from state slot slots[i] (zeros if reset[i]), with
    dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit) and A = -exp(A_log) computed
    inside the launch (the PyTorch path spends six kernels on them); writes the new state to
    that slot and y[rows[i]]. Touches no other slot or row."""
    num_decode = rows.shape[0]
    if num_decode == 0:
        return
    _, num_heads, head_dim = x.shape
    state_size = B.shape[2]
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1 and ssm_state.stride(3) == 1
    assert ssm_state.dtype == torch.float32 and y.dtype == torch.float32 and y.stride(2) == 1
    assert dt_raw.stride(1) == 1 and dt_bias.dtype == A_log.dtype == torch.float32
    if block_p is None:
        block_p = decode_block_p(head_dim)
    grid = (num_decode, num_heads, triton.cdiv(head_dim, block_p))
    _decode_kernel[grid](
        x, x.stride(0), x.stride(1),
        dt_raw, dt_raw.stride(0),
        A_log.contiguous(),
        dt_bias.contiguous(), float(time_step_limit[0]), float(time_step_limit[1]),
        B, B.stride(0), B.stride(1),
        C, C.stride(0), C.stride(1),
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        y, y.stride(0), y.stride(1),
        rows, slots, reset,
        num_heads // B.shape[1], head_dim, state_size,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size), num_warps=num_warps,
        **launch_options(),
    )


def decode_block_p(head_dim: int) -> int:
    """Rows of P each program of the SSD decode kernel updates (its state tile is BLOCK_P x N)."""
    return min(16, triton.next_power_of_2(head_dim))
