"""Norms not yet applied: the inputs of an RMS norm handed to the linear layer that consumes it.

At one row on CUDA the single-row GEMM (engine/kernels/gpu/skinny_gemm.py) computes the norm as
the prologue of its K loop, so the norm costs no launch of its own; elsewhere the consumer runs
the norm kernel first (engine/kernels/gpu/fused_norm.py) and then its linear. These records
only carry tensors and say what the norm is; they compute nothing.

- PendingRmsNorm: add_rms_norm's inputs, x = rms_norm(hidden + delta * multiplier) * weight,
  with the buffer the consumer writes the new residual row into;
- PendingGatedNorm: Mamba2's gated group RMSNorm with its D skip, x = weight *
  norm_g((y + D[h] * skip_x) * silu(gate)), for whole groups on this rank.

Pure torch (no triton import), so layers can build them on any device.
Shapes: T tokens, D hidden, I channels, H heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PendingRmsNorm:
    """The residual update and RMSNorm before a linear layer (norm_reference.add_rms_norm).

    Contract for a consumer: it computes x = rms_norm(hidden + delta * multiplier) * weight in
    hidden's dtype with add_rms_norm's roundings and, when delta is given, writes hidden + delta
    * multiplier (rounded to the dtype) into residual_out exactly once. hidden and delta are
    read only. `new_hidden` is the residual stream after the consumer has run."""

    hidden: torch.Tensor  # (T, D), unit D stride
    delta: torch.Tensor | None  # (T, D), hidden's dtype; None: no residual update
    multiplier: float
    weight: torch.Tensor  # (D,) contiguous, hidden's dtype
    eps: float
    residual_out: torch.Tensor | None  # (T, D) contiguous, no alias of hidden/delta; None iff delta is None

    def __post_init__(self) -> None:
        assert (self.delta is None) == (self.residual_out is None), \
            "residual_out must be given exactly when delta is"

    @classmethod
    def allocate(
        cls, hidden: torch.Tensor, delta: torch.Tensor | None, multiplier: float,
        weight: torch.Tensor, eps: float,
    ) -> PendingRmsNorm:
        """With a fresh residual_out (uninitialised, written by the consumer) when delta is given."""
        residual_out = None if delta is None else torch.empty_like(hidden, memory_format=torch.contiguous_format)
        return cls(hidden, delta, float(multiplier), weight, float(eps), residual_out)

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def new_hidden(self) -> torch.Tensor:
        """hidden + delta * multiplier once the consumer has run: residual_out, or hidden when
        there is no delta."""
        return self.hidden if self.residual_out is None else self.residual_out


@dataclass(frozen=True)
class PendingGatedNorm:
    """Mamba2's gated group RMSNorm with the D skip, before out_proj (fused_norm.gated_rms_norm
    with skip=(skip_x, D)): x = weight * norm_g((y + D[c // (I / H)] * skip_x) * silu(gate)),
    each group of group_size channels normalised by its own rms, all in fp32, rounded to
    out_dtype. Only for channels that are whole groups (GroupParallelGatedRMSNorm.whole_groups);
    a group split across ranks needs an all-reduce of its sums first."""

    y: torch.Tensor  # (T, I) fp32, unit I stride
    gate: torch.Tensor  # (T, I), unit I stride (a column slice of in_proj's output)
    skip_x: torch.Tensor  # (T, I), unit I stride (the conv output's x columns)
    D: torch.Tensor  # (H,) fp32 contiguous
    weight: torch.Tensor  # (I,) contiguous
    group_size: int
    eps: float
    out_dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.y.shape[0]
