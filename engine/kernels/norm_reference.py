"""The elementwise pieces around every block, in pure PyTorch: the CPU path runs exactly these,
and the fused GPU kernels (engine/kernels/gpu/fused_norm.py, activation.py) are tested against
them.

- rms_norm: weight * (x / rms(x)), the normalisation in fp32, rounded to x's dtype before the
  weight multiplies (as transformers' GraniteMoeHybridRMSNorm);
- add_rms_norm: the residual update `hidden + delta * r` (in the model dtype, as the decoder
  layer writes it) followed by rms_norm (or rms_norm_zero_centered) of the result; returns
  both;
- gated_rms_norm: Mamba2's weight * norm_g(y * silu(gate)), each group of group_size
  consecutive channels normalised by its own rms, all in fp32;
- silu_and_mul: silu(gate) * up of the MLP, where the input is [gate | up];
- rms_norm_zero_centered: (1 + weight) * (x / rms(x)), all in fp32, rounded to x's dtype at
  the end (Qwen3-Next's norms, whose stored weights are centred on zero);
- rms_norm_then_gate: the gated delta-net's weight * norm(y) * silu(gate) over each head's
  channels (normalised first, then gated: the other order from gated_rms_norm).

Shapes: T tokens, D hidden, I channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, D) -> (T, D) in x's dtype. fp32 x and weight: torch's F.rms_norm, one call that
    computes the same products in the same order (bitwise equal: tests/numerics/
    test_norm_layers.py)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    hidden: torch.Tensor,  # (T, D)
    delta: torch.Tensor | None,  # (T, D); None: no residual update
    residual_multiplier: float,
    weight: torch.Tensor,  # (D,)
    eps: float,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (new_hidden = hidden + delta * r, rms_norm(new_hidden)); with delta None,
    (hidden, rms_norm(hidden)). zero_centered: rms_norm_zero_centered instead of rms_norm."""
    if delta is not None:
        hidden = hidden + delta * residual_multiplier
    norm = rms_norm_zero_centered if zero_centered else rms_norm
    return hidden, norm(hidden, weight, eps)


def gated_rms_norm(
    y: torch.Tensor,  # (T, I)
    gate: torch.Tensor,  # (T, I)
    weight: torch.Tensor,  # (I,)
    group_size: int,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(T, I) -> (T, I) in out_dtype; I must be whole groups of group_size. The normalisation
    of each group is F.rms_norm's, the same products in the same order in fp32 as
    `grouped * rsqrt(mean(grouped^2) + eps)` (bitwise equal: tests/numerics/test_norm_layers.py);
    then the weight, then the cast."""
    gated = _fp32(y) * F.silu(_fp32(gate))
    weight32 = _fp32(weight)
    if group_size == gated.shape[-1]:
        normed = F.rms_norm(gated, (group_size,), weight32, eps)
    else:
        grouped = gated.view(*gated.shape[:-1], -1, group_size)  # (T, I / group_size, group_size)
        normed = weight32 * F.rms_norm(grouped, (group_size,), None, eps).view_as(gated)
    return normed if out_dtype == torch.float32 else normed.to(out_dtype)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """t in fp32 (t itself when it is: no call through the dispatcher)."""
    return t if t.dtype == torch.float32 else t.float()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> silu(gate) * up (T, I), in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., D) -> (..., D) in x's dtype: (1 + weight) * x / rms(x), all in fp32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rms_norm_then_gate(
    y: torch.Tensor,  # (..., P), P the channels one norm covers (a head)
    gate: torch.Tensor,  # (..., P)
    weight: torch.Tensor,  # (P,)
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """weight * (y / rms(y)) * silu(gate): the normalisation in fp32 rounded to y's dtype
    before the weight, the gate in fp32; returns out_dtype."""
    y32 = y.float()
    normed = (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)).to(y.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(out_dtype)
