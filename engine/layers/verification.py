"""The recurrent mixers' part of verifying drafts: a verification chunk of n = k + 1 tokens
through Mamba2 or the gated delta-net, position by position, the state after each position
left in its own scratch slot and the request's slot only read (docs/design.md section 10).

    mix_verification                 PyTorch: one chunk, token by token through the mixer's
                                     one-token decode step
    mix_verification_gpu             CUDA, Mamba2: every verification chunk of the step at once,
                                     one fused decode launch per position
    mix_delta_rule_verification_gpu  CUDA, gated delta-net: plain decoding's conv and
                                     recurrent kernels, one position at a time
    position_conv_windows            the conv window after each position (data movement only)

The routes that choose these, the scratch slots and the commit of the kept position are
engine/speculative/verify.py (PyTorch) and verify_gpu.py (CUDA); the layers call in here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.interfaces.forward_batch import SequenceChunk
from engine.kernels.gpu.batch_plan import VerificationPlan


def mix_verification(
    decode_step: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    token_inputs: Sequence[torch.Tensor],  # each (n, ...): the chunk's n = k + 1 tokens, pre-conv
    conv_state: torch.Tensor,  # (num_slots, C, K-1): the chunk's scratch slots written
    recurrent_state: torch.Tensor,  # (num_slots, ...) fp32: the chunk's scratch slots written
    chunk: SequenceChunk,  # a verification chunk (position_state_slots, one per token)
) -> torch.Tensor:
    """A verification chunk through one recurrent mixer: token i continues from the state
    after token i - 1 (token 0 from chunk.state_slot, which is only read) with decode_step,
    the mixer's one-token decode step, and leaves its state in position_state_slots[i]; each
    step reads its state back from the slot the step before wrote, as plain decoding does.

    decode_step(*(t[i : i + 1] for t in token_inputs), conv (1, C, K-1), state (1, ...)) ->
    (y (1, ...), new conv, new state), its inputs not modified: Mamba2Mixer.mix_decode over
    (xBC, dt_raw), GatedDeltaNet.mix_decode over (qkv, b, a). Returns the steps' y
    concatenated, (n, ...) fp32 (the mixer's output before its gated norm)."""
    slot = chunk.state_slot
    conv, state = conv_state[slot : slot + 1], recurrent_state[slot : slot + 1]
    outputs = []
    for i, scratch in enumerate(chunk.position_state_slots):
        y, conv_out, state_out = decode_step(*(t[i : i + 1] for t in token_inputs), conv, state)
        conv_state[scratch].copy_(conv_out[0])
        recurrent_state[scratch].copy_(state_out[0])
        conv, state = conv_state[scratch : scratch + 1], recurrent_state[scratch : scratch + 1]
        outputs.append(y)
    return torch.cat(outputs)


def position_conv_windows(
    old: torch.Tensor,  # (V, C, K-1): the conv windows before the chunks' first positions
    inputs: torch.Tensor,  # (V, C, n): the chunks' pre-conv inputs, position by position
) -> torch.Tensor:
    """(n + 1, V, C, K-1): [j] the conv window after the chunks' first j positions, the last
    K-1 columns of [old | inputs[..., :j]] (what causal_conv1d_step leaves after each token);
    exact (data movement only)."""
    taps = old.shape[2]
    return torch.cat([old, inputs], dim=2).unfold(2, taps, 1).permute(2, 0, 1, 3)


def mix_verification_gpu(
    mixer,  # engine.layers.mamba2.Mamba2Mixer
    xBC: torch.Tensor,  # (T, conv_dim) pre-conv, unit channel stride
    dt_raw: torch.Tensor,  # (T, H)
    conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1): rest slots and scratch slots written
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32: rest slots and scratch slots written
    plan: VerificationPlan,
    decode_step: Callable[..., None] | None = None,  # conv_ssd_decode's signature; None: it
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2Mixer.mix_batch_gpu for a step with verification chunks (module docstring): rows
    [0, num_rest_rows) through the mixer's ordinary path over plan.rest, each verification
    chunk's positions through decode_step one position at a time, the state after position i
    left in its scratch slot i, the chunk's own slot only read. Returns (y (T, H, P) fp32
    without the D skip, x (T, I) the conv output's x columns), as mix_batch_gpu."""
    if decode_step is None:
        from engine.kernels.gpu.mamba_decode import conv_ssd_decode as decode_step
    T = xBC.shape[0]
    H, P = mixer.num_heads, mixer.head_dim
    y = xBC.new_empty(T, H, P, dtype=torch.float32)
    x = xBC.new_empty(T, H, P)
    rest_rows = plan.num_rest_rows
    if plan.rest is not None:
        y_rest, x_rest = mixer.mix_batch_gpu(xBC[:rest_rows], dt_raw[:rest_rows], conv_state, ssm_state, plan.rest)
        y[:rest_rows] = y_rest
        x.view(T, H * P)[:rest_rows] = x_rest
    n, num_chunks = plan.rows.shape
    channels, taps = conv_state.shape[1:]
    old = conv_state.index_select(0, plan.source_slots)  # (V, C, K-1), the request slots: read only
    inputs = xBC.index_select(0, plan.rows.reshape(-1)).view(n, num_chunks, channels).permute(1, 2, 0)
    windows = position_conv_windows(old, inputs)  # (n + 1, V, C, K-1)
    weight = mixer.conv1d.weight[:, 0, :]  # (conv_dim, K)
    scratch_slots = plan.scratch_slots.reshape(-1)  # position-major, as windows[j].reshape
    # scratch slot i: the window before position i, which the decode kernel reads (never writes)
    conv_state.index_copy_(0, scratch_slots, windows[:-1].reshape(-1, channels, taps))
    for i, (rows, slots, sources) in enumerate(zip(plan.position_rows, plan.position_slots, plan.position_sources)):
        ssm_state.index_copy_(0, slots, ssm_state.index_select(0, sources))  # the state before position i
        decode_step(
            xBC, dt_raw, conv_state, weight, mixer.conv1d.bias, mixer.dt_bias, mixer.A_log,
            mixer.time_step_limit, ssm_state, x, y, rows, slots, plan.no_reset[: rows.shape[0]],
        )
    # scratch slot i: the window after position i
    conv_state.index_copy_(0, scratch_slots, windows[1:].reshape(-1, channels, taps))
    return y, x.view(T, H * P)


def mix_delta_rule_verification_gpu(
    mixer,  # engine.layers.gated_delta_net.GatedDeltaNet
    qkv: torch.Tensor,  # (T, C) pre-conv, unit channel stride
    b: torch.Tensor,  # (T, Hv)
    a: torch.Tensor,  # (T, Hv)
    conv_state: torch.Tensor,  # (num_slots, C, K-1): rest slots and scratch slots written
    recurrent_state: torch.Tensor,  # (num_slots, Hv, dk, dv) fp32: rest slots and scratch slots written
    plan: VerificationPlan,
    conv_step: Callable[..., torch.Tensor] | None = None,  # causal_conv1d_varlen's signature; None: it
    rule_step: Callable[..., torch.Tensor] | None = None,  # gated_delta_rule_decode's; None: it
    mix_rest: Callable[..., torch.Tensor] | None = None,  # mixer.mix_chunks_gpu's; None: it
) -> torch.Tensor:
    """GatedDeltaNet.mix_chunks_gpu for a step with verification chunks (module docstring):
    rows [0, num_rest_rows) through mix_rest over plan.rest; then for each position i, scratch
    slot i gets the conv window and the recurrent state before position i (index_copy_ from
    position_sources[i]: the request's slot, only read, or scratch slot i - 1), and plain
    decoding's two kernels run over position i of every chunk still that long, as one-token
    chunks on scratch slot i, never reset: conv_step (which leaves the window after position i
    in the slot) and rule_step (the state after position i). Returns y (T, Hv, dv) in qkv's
    dtype, as mix_chunks_gpu; a scratch slot past a chunk's length is not touched."""
    if conv_step is None:
        from engine.kernels.gpu.conv import causal_conv1d_varlen as conv_step
    if rule_step is None:
        from engine.kernels.gpu.gated_delta_rule import gated_delta_rule_decode as rule_step
    if mix_rest is None:
        mix_rest = mixer.mix_chunks_gpu
    T = qkv.shape[0]
    y = qkv.new_zeros(T, mixer.num_value_heads, mixer.value_head_dim)
    rest_rows = plan.num_rest_rows
    if plan.rest is not None:
        y[:rest_rows] = mix_rest(qkv[:rest_rows], b[:rest_rows], a[:rest_rows], conv_state, recurrent_state, plan.rest)
    weight = mixer.conv1d.weight[:, 0, :]  # (C, K)
    for rows, slots, sources in zip(plan.position_rows, plan.position_slots, plan.position_sources):
        active = rows.shape[0]
        bounds, no_reset = plan.chunk_bounds[: active + 1], plan.no_reset[:active]
        # scratch slot i: the states before position i
        conv_state.index_copy_(0, slots, conv_state.index_select(0, sources))
        recurrent_state.index_copy_(0, slots, recurrent_state.index_select(0, sources))
        conv_out = conv_step(qkv.index_select(0, rows), conv_state, weight, None, bounds, slots, no_reset,
                             bounds[:-1], apply_silu=True)  # (active, C)
        q, k, v, g, beta = mixer.kernel_inputs(conv_out, b.index_select(0, rows), a.index_select(0, rows))
        y.index_copy_(0, rows, rule_step(q, k, v, g, beta, mixer.scale, recurrent_state, slots, no_reset))
    return y
