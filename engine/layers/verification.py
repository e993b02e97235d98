"""The recurrent mixers' part of verifying drafts: a verification chunk of n = k + 1 tokens
through Mamba2 or the gated delta-net, position by position, the state after each position
left in its own scratch slot and the request's slot only read (docs/design.md section 10).

    mix_verification                 PyTorch: one chunk, token by token through the mixer's
                                     one-token decode step
    mix_verification_gpu             CUDA, Mamba2: every verification chunk of the step in one
                                     launch (engine/kernels/gpu/mamba_verify.py)
    mix_delta_rule_verification_gpu  CUDA, gated delta-net: likewise
                                     (engine/kernels/gpu/delta_rule_verify.py)

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


def mix_verification_gpu(
    mixer,  # engine.layers.mamba2.Mamba2Mixer
    xBC: torch.Tensor,  # (T, conv_dim) pre-conv, unit channel stride
    dt_raw: torch.Tensor,  # (T, H)
    conv_state: torch.Tensor,  # (num_slots, conv_dim, K-1): rest slots and scratch slots written
    ssm_state: torch.Tensor,  # (num_slots, H, P, N) fp32: rest slots and scratch slots written
    plan: VerificationPlan,
    verify: Callable[..., None] | None = None,  # mamba_verify's signature; None: it
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2Mixer.mix_batch_gpu for a step with verification chunks (module docstring): rows
    [0, num_rest_rows) through the mixer's ordinary path over plan.rest, every verification
    chunk in one launch of the one-pass kernel (engine/kernels/gpu/mamba_verify.py), the state
    after position i left in its scratch slot i, the chunk's own slot only read. Returns
    (y (T, H, P) fp32 without the D skip, x (T, I) the conv output's x columns), as
    mix_batch_gpu."""
    if verify is None:
        from engine.kernels.gpu.mamba_verify import mamba_verify as verify
    T = xBC.shape[0]
    H, P = mixer.num_heads, mixer.head_dim
    y = xBC.new_empty(T, H, P, dtype=torch.float32)
    x = xBC.new_empty(T, H, P)
    rest_rows = plan.num_rest_rows
    if plan.rest is not None:
        y_rest, x_rest = mixer.mix_batch_gpu(xBC[:rest_rows], dt_raw[:rest_rows], conv_state, ssm_state, plan.rest)
        y[:rest_rows] = y_rest
        x.view(T, H * P)[:rest_rows] = x_rest
    verify(
        xBC, dt_raw, conv_state, mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias, mixer.dt_bias, mixer.A_log,
        mixer.time_step_limit, ssm_state, x, y, plan.first_rows, plan.lengths, plan.source_slots, plan.scratch_slots,
    )
    return y, x.view(T, H * P)


def mix_delta_rule_verification_gpu(
    mixer,  # engine.layers.gated_delta_net.GatedDeltaNet
    qkv: torch.Tensor,  # (T, C) pre-conv, unit channel stride
    b: torch.Tensor,  # (T, Hv)
    a: torch.Tensor,  # (T, Hv)
    conv_state: torch.Tensor,  # (num_slots, C, K-1): rest slots and scratch slots written
    recurrent_state: torch.Tensor,  # (num_slots, Hv, dk, dv) fp32: rest slots and scratch slots written
    plan: VerificationPlan,
    verify: Callable[..., None] | None = None,  # delta_rule_verify's signature; None: it
    mix_rest: Callable[..., torch.Tensor] | None = None,  # mixer.mix_chunks_gpu's; None: it
) -> torch.Tensor:
    """GatedDeltaNet.mix_chunks_gpu for a step with verification chunks (module docstring):
    rows [0, num_rest_rows) through mix_rest over plan.rest, every verification chunk in one
    launch of the one-pass kernel (engine/kernels/gpu/delta_rule_verify.py), the states after
    position i left in its scratch slot i, the chunk's own slot only read. Returns y (T, Hv,
    dv) in qkv's dtype, as mix_chunks_gpu."""
    if verify is None:
        from engine.kernels.gpu.delta_rule_verify import delta_rule_verify as verify
    if mix_rest is None:
        mix_rest = mixer.mix_chunks_gpu
    T = qkv.shape[0]
    y = qkv.new_zeros(T, mixer.num_value_heads, mixer.value_head_dim)
    rest_rows = plan.num_rest_rows
    if plan.rest is not None:
        y[:rest_rows] = mix_rest(qkv[:rest_rows], b[:rest_rows], a[:rest_rows], conv_state, recurrent_state, plan.rest)
    verify(
        qkv, b, a, conv_state, mixer.conv1d.weight[:, 0, :], mixer.A_log, mixer.dt_bias, mixer.scale,
        recurrent_state, y, plan.first_rows, plan.lengths, plan.source_slots, plan.scratch_slots,
        num_key_heads=mixer.num_key_heads,
    )
    return y
