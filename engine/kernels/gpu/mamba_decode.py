"""The Mamba2 decode step in one launch: the causal conv1d step (with SiLU) of one token per
sequence and the SSD single-token state update.

On a decode-only step (every chunk one token: what the decode CUDA graphs run) the mixer's
GPU path otherwise runs three launches per Mamba layer before the gated norm: conv.py's
`_conv_kernel` and `_state_kernel`, then ssd.py's `_decode_kernel`. `conv_ssd_decode` takes
the place of the first and the last, so the step runs two: this kernel, then
conv.py:advance_conv_states (`_state_kernel`), which shifts each slot's conv window.

Why this kernel leaves the conv state alone: program (i, h, pb) computes the conv outputs of
the B and C channels of head h's group from the OLD conv state of slot slots[i], and so does
every other program of that row in the group (each head, each P block). Programs run in no
set order, so one that advanced its slot's window would hand a later program of the same slot
a state that already holds the new token. No program here writes conv_state; the next launch
in the stream (advance_conv_states) does, after all of them have finished.

Each program owns (decode row i, head h, BLOCK_P rows of P), like `_decode_kernel`: it convolves
its BLOCK_P x channels and its group's N B and N C channels, updates its (BLOCK_P, N) state
tile in place, writes y, and writes the x channels to x_out (the gated norm reads post-conv x
for the D skip). The B/C conv is recomputed by the H/G * P/BLOCK_P programs of a group (2 N
channels x K taps each, read from L2); the state tile each program streams (BLOCK_P x N fp32,
read and written) is the larger traffic.

Under PDL everything that does not depend on in_proj's output is loaded before the wait: the
plan's row, slot and reset flag, the weights, the old conv window's K-1 taps (summed then)
and the old SSD state tile. pdl.py's contract allows it: within a forward pass only this
layer's decode kernel writes this layer's state of a decode row (advance_conv_states, which
writes the conv window, runs after it), and the pass begins with kernels launched without
PDL (the embedding), so whatever was enqueued before the pass (a restore, the previous step)
has finished. After the wait come only the token's xBC and dt, read from L2 (with the gated
norm folded in, also its gate z; its D and the norm's weight are loaded before the wait).

Numerics, those of the unfused pair: the conv accumulates in fp32 over the taps in
`_conv_kernel`'s order (the K-1 state columns, oldest first, then the new input), adds the
bias, applies SiLU, and rounds the result to x_out's dtype (the model dtype: the unfused conv
writes a tensor of that dtype) before the SSD reads it as fp32; the SSD step is
`_decode_kernel`'s (dt = clamp(softplus(dt_raw + dt_bias)) with libdevice.log1p, A =
-exp(A_log), fp32 state). The two paths agree up to the compiler's choice of fused
multiply-adds (in a low-precision dtype, an occasional last-bit flip of a rounded conv output).

The gated norm folded in (GatedNormOutputs; Mamba2Mixer.mix_row_folded_gpu takes it for a
one-row decode step): the gated RMSNorm after the mixer is a reduction over all of a row's
H P channels, which at one row would run as a single program between this kernel and out_proj.
With gated_norm each program also applies the norm's elementwise part to its channels (the
D skip on the rounded x, then silu(gate), then the norm's weight), writes that instead of y
and x, and writes the sum of squares of its channels; out_proj's single-row GEMM sums those
(in a fixed order: no atomics) and scales its output by the rsqrt (skinny_gemm.RowRms).
benchmarks/gpu_roofline.py's batch-1 decode graph on the H200: 1.118-1.121 ms with the fold
against 1.155-1.163 ms with the norm as its own kernel. The normed values are
rounded to the model dtype before the norm's scale, so the fold is for dtypes with fp32's
range (bf16, fp32): in fp16 an unnormalised product could overflow.

Programmatic dependent launch: the kernel follows engine/kernels/gpu/pdl.py's contract.

Shapes: T tokens, H heads, P head dim, G groups, N state size, K conv width, Bd decode rows,
conv_dim = H P + 2 G N, laid out [x (H P) | B (G N) | C (G N)].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous
from engine.kernels.gpu.ssd import decode_block_p, decode_program, ssd_decode_step


@triton.jit
def _conv_state_taps(
    state_ptr, stride_sc,  # the slot's conv state (conv_dim, K-1), unit last stride
    w_ptr,  # (conv_dim, K) contiguous
    channels, mask, keep_state,  # (BLOCK,) channel indices, their mask; False: a zero state
    K: tl.constexpr, BLOCK: tl.constexpr,
):
    """The conv's first K-1 taps in fp32: sum_k w[c, k] state[c, k] over the old state
    (zeros when not keep_state), oldest first: `_conv_kernel`'s order. Reads only the slot's
    state and the weights, so the fused kernel runs it before its PDL wait."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(K - 1):
        sv = tl.load(state_ptr + channels * stride_sc + k, mask=mask & keep_state, other=0.0)
        w = tl.load(w_ptr + channels * K + k, mask=mask, other=0.0).to(tl.float32)
        acc += sv.to(tl.float32) * w
    return acc


@triton.jit
def _conv_silu_finish(
    acc,  # (BLOCK,) fp32, _conv_state_taps of these channels
    x_row_ptr,  # the token's pre-conv row, unit channel stride
    w_ptr, b_ptr,  # (conv_dim, K) contiguous, (conv_dim,) (HAS_BIAS)
    channels, mask,
    K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """silu(bias + acc + w[c, K-1] x[c]) in fp32, the new input's tap then the bias added in
    `_conv_kernel`'s order: the conv step of a one-token chunk."""
    xv = tl.load(x_row_ptr + channels, mask=mask, other=0.0)
    w = tl.load(w_ptr + channels * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    acc += xv.to(tl.float32) * w
    if HAS_BIAS:
        acc += tl.load(b_ptr + channels, mask=mask, other=0.0).to(tl.float32)
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_ssd_decode_kernel(
    xbc_ptr, stride_xbct,  # (T, conv_dim) pre-conv, unit channel stride
    conv_state_ptr, stride_css, stride_csc,  # (slots, conv_dim, K-1), unit last stride; read only
    conv_w_ptr, conv_b_ptr,  # (conv_dim, K) contiguous, (conv_dim,) (HAS_BIAS)
    dt_ptr, stride_dtt,  # (T, H): raw dt (in_proj's columns, before bias and softplus)
    a_log_ptr,  # (H,) fp32
    dt_bias_ptr, dt_min, dt_max,  # (H,) fp32 and the clamp
    state_ptr, stride_ss, stride_sh, stride_sp,  # (slots, H, P, N) fp32, unit N stride
    x_out_ptr, stride_xot, stride_xoh,  # (T, H, P) post-conv x, unit P stride
    y_ptr, stride_yt, stride_yh,  # (T, H, P) fp32
    rows_ptr, slots_ptr, reset_ptr,  # (Bd,)
    heads_per_group, P, N, x_width, group_width,  # x_width = H P, group_width = G N
    # GATED_NORM only (placeholders otherwise):
    z_ptr, stride_zt,  # (T, H P) the gate, unit channel stride
    d_ptr, norm_w_ptr,  # (H,) fp32 D skip; (H P,) the gated norm's weight
    normed_ptr, stride_nt,  # (T, H P) model dtype: weight * gated, unit channel stride
    sum_sq_ptr, stride_sqt,  # (T, H * cdiv(P, BLOCK_P)) fp32: each program's sum of gated^2
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    GATED_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    # Before the wait (engine/kernels/gpu/pdl.py's contract): the plan's row, slot and reset,
    # the weights, and the slot's old conv and SSD state of this layer, which no kernel of the
    # pass before this one writes. The state tile is the kernel's largest load; issued here it
    # streams while in_proj, the kernel ahead, still runs.
    h, g, p, n, p_mask, n_mask, row, slot, keep_state = decode_program(
        rows_ptr, slots_ptr, reset_ptr, heads_per_group, P, N, BLOCK_P, BLOCK_N)
    conv_slot = conv_state_ptr + slot * stride_css
    x_channels = h * P + p
    b_channels = x_width + g * N + n
    c_channels = b_channels + group_width
    x_taps = _conv_state_taps(conv_slot, stride_csc, conv_w_ptr, x_channels, p_mask, keep_state, K, BLOCK_P)
    b_taps = _conv_state_taps(conv_slot, stride_csc, conv_w_ptr, b_channels, n_mask, keep_state, K, BLOCK_N)
    c_taps = _conv_state_taps(conv_slot, stride_csc, conv_w_ptr, c_channels, n_mask, keep_state, K, BLOCK_N)
    tile = state_ptr + slot * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :]
    tile_mask = p_mask[:, None] & n_mask[None, :]
    old_state = tl.load(tile, mask=tile_mask & keep_state, other=0.0)
    dt_bias, a_log = tl.load(dt_bias_ptr + h), tl.load(a_log_ptr + h)
    if GATED_NORM:  # weights too
        skip_weight = tl.load(d_ptr + h)
        norm_w = tl.load(norm_w_ptr + x_channels, mask=p_mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)

    # the conv step of this program's x channels and its group's B and C channels (the conv
    # state is not written here: see the module docstring), rounded to the model dtype
    xbc_row = xbc_ptr + row * stride_xbct
    model_dtype = x_out_ptr.dtype.element_ty
    x = _conv_silu_finish(x_taps, xbc_row, conv_w_ptr, conv_b_ptr, x_channels, p_mask, K, HAS_BIAS).to(model_dtype)
    b = _conv_silu_finish(b_taps, xbc_row, conv_w_ptr, conv_b_ptr, b_channels, n_mask, K, HAS_BIAS).to(model_dtype)
    c = _conv_silu_finish(c_taps, xbc_row, conv_w_ptr, conv_b_ptr, c_channels, n_mask, K, HAS_BIAS).to(model_dtype)

    # the SSD step, ssd.py's (shared with _decode_kernel)
    y = ssd_decode_step(
        x.to(tl.float32), b.to(tl.float32), c.to(tl.float32),
        tl.load(dt_ptr + row * stride_dtt + h).to(tl.float32), dt_bias, a_log, dt_min, dt_max,
        old_state, tile, tile_mask,
    )
    if GATED_NORM:
        # fused_norm._gated_rms_norm_kernel's operations up to its sum of squares: the D skip
        # on the rounded x, then the gate; the rsqrt goes to the out_proj GEMM (module docstring)
        z = tl.load(z_ptr + row * stride_zt + x_channels, mask=p_mask, other=0.0).to(tl.float32)
        gated = (y + skip_weight * x.to(tl.float32)) * (z * tl.sigmoid(z))
        num_p_blocks = tl.num_programs(2)
        tl.store(sum_sq_ptr + row * stride_sqt + h * num_p_blocks + tl.program_id(2), tl.sum(gated * gated, axis=0))
        tl.store(normed_ptr + row * stride_nt + x_channels, (norm_w * gated).to(model_dtype), mask=p_mask)
    else:
        tl.store(y_ptr + row * stride_yt + h * stride_yh + p, y, mask=p_mask)
        tl.store(x_out_ptr + row * stride_xot + h * stride_xoh + p, x, mask=p_mask)


@dataclass(frozen=True)
class GatedNormOutputs:
    """What conv_ssd_decode computes instead of y and x when it also takes the gated RMSNorm's
    elementwise part (one norm group over all H P channels: Granite-4.0-H's n_groups = 1).
    For each row r: gated = (y + D[h] x) * silu(gate) per channel in fp32 (the skip on the
    rounded x, as fused_norm.gated_rms_norm adds it), normed[r] = weight * gated rounded to
    the model dtype, and sum_squares[r, j] the sum of gated^2 over program j's channels.
    The norm's rsqrt(sum(sum_squares[r]) / (H P) + eps) is left to the consumer: the out_proj
    single-row GEMM scales its output by it (skinny_gemm.RowRms)."""

    gate: torch.Tensor  # (T, H P) the in_proj's z columns, unit channel stride
    D: torch.Tensor  # (H,) fp32
    weight: torch.Tensor  # (H P,) contiguous, the norm's weight
    normed: torch.Tensor  # (T, H P) model dtype, unit channel stride: rows written
    sum_squares: torch.Tensor  # (T, num_sum_squares(H, P)) fp32, unit stride: rows written


def num_sum_squares(num_heads: int, head_dim: int, block_p: int | None = None) -> int:
    """Columns of GatedNormOutputs.sum_squares: one per program of a row (H x P blocks)."""
    return num_heads * triton.cdiv(head_dim, decode_block_p(head_dim) if block_p is None else block_p)


def conv_ssd_decode(
    xBC: torch.Tensor,  # (T, conv_dim) pre-conv, unit channel stride
    dt_raw: torch.Tensor,  # (T, H), in_proj's dt columns before bias and softplus, unit H stride
    conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1), xBC's dtype; read, not modified
    conv_weight: torch.Tensor,  # (conv_dim, K)
    conv_bias: torch.Tensor | None,  # (conv_dim,)
    dt_bias: torch.Tensor,  # (H,) fp32
    A_log: torch.Tensor,  # (H,) fp32
    time_step_limit: tuple[float, float],
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32, rows' slots updated in place
    x_out: torch.Tensor | None,  # (T, H, P) xBC's dtype, unit P stride: rows written
    y: torch.Tensor | None,  # (T, H, P) fp32, unit P stride: rows written
    rows: torch.Tensor,  # (Bd,) int
    slots: torch.Tensor,  # (Bd,) int
    reset: torch.Tensor,  # (Bd,) int, nonzero = start from zero conv and SSD states
    block_p: int | None = None,  # rows of P per program; None: ssd.py's decode_block_p()
    num_warps: int = 4,
    gated_norm: GatedNormOutputs | None = None,  # given: written instead of x_out and y (None)
) -> None:
    """One token of each of Bd sequences in one launch: for each i, on row rows[i], the conv
    step with SiLU (causal_conv1d_step) from conv_state[slots[i]] (zeros if reset[i]), rounded
    to xBC's dtype, its x columns written to x_out[rows[i]]; then ssd_step with D None from
    ssm_state[slots[i]] (zeros if reset[i]) on that x, B and C, dt = clamp(softplus(dt_raw +
    dt_bias), *time_step_limit), A = -exp(A_log), the new state written to the same slot and
    y written to y[rows[i]]. Touches no other row or slot. With gated_norm, y and x go on into
    the gated norm's elementwise part (GatedNormOutputs) and only its outputs are written.

    Does NOT advance the conv state: run conv.py:advance_conv_states over the same rows and
    slots after it (stream order), see the module docstring. Slots are distinct, except that
    rows which reset may share one (the decode graphs' padding rows share a scratch slot);
    such a slot's SSD state is unspecified afterwards."""
    num_decode = rows.shape[0]
    if num_decode == 0:
        return
    num_heads, head_dim, _ = ssm_state.shape[1:]
    conv_dim, kernel_size = conv_weight.shape
    state_size = ssm_state.shape[3]
    group_width = (conv_dim - num_heads * head_dim) // 2
    assert xBC.shape[1] == conv_dim and group_width % state_size == 0
    assert conv_state.shape[1:] == (conv_dim, kernel_size - 1)
    assert xBC.stride(1) == 1 and conv_state.stride(2) == 1 and dt_raw.stride(1) == 1
    assert ssm_state.dtype == torch.float32 and ssm_state.stride(3) == 1
    assert dt_bias.dtype == A_log.dtype == torch.float32
    num_groups = group_width // state_size
    if block_p is None:
        block_p = decode_block_p(head_dim)
    if gated_norm is None:
        assert x_out.shape[1:] == (num_heads, head_dim) and y.shape[1:] == (num_heads, head_dim)
        assert x_out.stride(2) == 1 and y.stride(2) == 1 and y.dtype == torch.float32
        assert x_out.dtype == xBC.dtype, "the conv output is rounded to the model dtype, xBC's"
        norm = (xBC, 0, A_log, A_log, xBC, 0, A_log, 0)  # placeholders, never read or written
    else:
        assert x_out is None and y is None, "with gated_norm, x_out and y are not written"
        g = gated_norm
        width = num_heads * head_dim
        assert g.gate.shape[1] == width and g.gate.stride(1) == 1 and g.weight.shape == (width,)
        assert g.D.dtype == torch.float32 and g.D.shape == (num_heads,) and g.weight.is_contiguous()
        assert g.normed.shape[1] == width and g.normed.stride(1) == 1 and g.normed.dtype == xBC.dtype
        assert g.sum_squares.dtype == torch.float32 and g.sum_squares.stride(1) == 1
        assert g.sum_squares.shape[1] == num_sum_squares(num_heads, head_dim, block_p)
        norm = (g.gate, g.gate.stride(0), g.D.contiguous(), g.weight, g.normed, g.normed.stride(0),
                g.sum_squares, g.sum_squares.stride(0))
        x_out, y = xBC.unsqueeze(1), ssm_state  # placeholders, never written (GATED_NORM)
    conv_weight = conv_weight.contiguous()
    grid = (num_decode, num_heads, triton.cdiv(head_dim, block_p))
    _conv_ssd_decode_kernel[grid](
        xBC, xBC.stride(0),
        conv_state, conv_state.stride(0), conv_state.stride(1),
        conv_weight, conv_bias if conv_bias is not None else conv_weight,
        dt_raw, dt_raw.stride(0),
        A_log.contiguous(),
        dt_bias.contiguous(), float(time_step_limit[0]), float(time_step_limit[1]),
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        x_out, x_out.stride(0), x_out.stride(1),
        y, y.stride(0), y.stride(1),
        rows, slots, reset,
        num_heads // num_groups, head_dim, state_size, num_heads * head_dim, group_width,
        *norm,
        K=kernel_size, HAS_BIAS=conv_bias is not None,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size), GATED_NORM=gated_norm is not None,
        num_warps=num_warps, **launch_options(),
    )
