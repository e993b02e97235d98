"""Depthwise causal conv1d over one sequence with a carried conv state, in pure PyTorch.

The conv state holds the last K-1 inputs of the sequence so far (zeros for a fresh sequence),
so running a sequence in pieces gives exactly the outputs of running it whole.
Shapes: T tokens, C channels, K kernel width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,  # (T, C)
    conv_state: torch.Tensor,  # (C, K - 1), not modified
    weight: torch.Tensor,  # (C, K)
    bias: torch.Tensor | None,  # (C,)
    apply_silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out (T, C), new_conv_state (C, K - 1)).

    out[t, c] = bias[c] + sum_k weight[c, k] * window[c, t + k], where window is the conv state
    followed by x; new_conv_state is the last K - 1 columns of that window.
    """
    num_tokens, channels = x.shape
    state_len = weight.shape[1] - 1
    window = torch.cat([conv_state.to(x.dtype), x.transpose(0, 1)], dim=1)  # (C, K-1+T)
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=channels)[0]  # (C, T)
    if apply_silu:
        out = F.silu(out)
    new_state = window[:, window.shape[1] - state_len :]  # (C, K-1)
    return out.transpose(0, 1), new_state


def causal_conv1d_step(
    x: torch.Tensor,  # (S, C), one new input per sequence
    conv_state: torch.Tensor,  # (S, C, K - 1), not modified
    weight: torch.Tensor,  # (C, K)
    bias: torch.Tensor | None,  # (C,)
    apply_silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of S sequences (causal_conv1d with T = 1 over a batch): returns
    (out (S, C), new_conv_state (S, C, K - 1) in x's dtype)."""
    new_state = conv_state.to(x.dtype, copy=True)
    return causal_conv1d_step_(x, new_state, weight, bias, apply_silu), new_state


def causal_conv1d_step_(
    x: torch.Tensor,  # (S, C), one new input per sequence
    conv_state: torch.Tensor,  # (S, C, K - 1), advanced by one input in place
    weight: torch.Tensor,  # (C, K)
    bias: torch.Tensor | None,  # (C,)
    apply_silu: bool,
) -> torch.Tensor:
    """causal_conv1d_step writing the new conv states into conv_state (a view of the slots
    or a gathered copy) instead of returning them: returns out (S, C)."""
    state = conv_state if conv_state.dtype == x.dtype else conv_state.to(x.dtype)
    window = torch.cat([state, x[:, :, None]], dim=2)  # (S, C, K)
    out = (window * weight).sum(dim=2)
    if bias is not None:
        out += bias
    if apply_silu:
        out = F.silu(out, inplace=True)
    conv_state.copy_(window[:, :, 1:])
    return out
