"""RMS norms: the plain one around every block, and the gated, grouped one inside Mamba2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.norm_reference import gated_rms_norm, rms_norm, rms_norm_zero_centered
from engine.parallel.tensor_parallel import IndexRange, ShardedModule, TensorParallel, TensorShard


class RMSNorm(nn.Module):
    """weight * x / rms(x), the normalisation computed in fp32 and cast back to x's dtype.

    zero_centered: the stored weight is centred on zero (Qwen3-Next): the scale is
    (1 + weight), and the whole product is computed in fp32 before the cast
    (norm_reference.rms_norm_zero_centered). Normalises the last dimension, so it also takes
    (T, H, D) per-head inputs (attention's q/k norms)."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32,
        zero_centered: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, D) -> (T, D)
        if self.zero_centered:
            return rms_norm_zero_centered(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class GroupParallelGatedRMSNorm(ShardedModule):
    """weight * norm_g(y * silu(gate)): the gate is applied first, then each group of group_size
    consecutive channels is normalised by its own rms. All in fp32; returns `out_dtype`.

    Tensor parallel: this rank holds channels [start, end) of the full_size channels. Either
    they are whole groups (normalised locally, no collective) or they are part of one group
    shared with other ranks: then each rank's sum of squares is all-reduced, written in its
    group's column of a (T, num_groups) tensor so ranks of different groups do not mix.

    norm_first: the other order, weight * norm_g(y) * silu(gate) (Falcon-H1's
    mamba_norm_before_gate), in PyTorch on CUDA too.
    """

    def __init__(
        self, full_size: int, group_size: int, channels: IndexRange, eps: float,
        tp: TensorParallel, dtype: torch.dtype = torch.float32, norm_first: bool = False,
    ) -> None:
        super().__init__()
        if full_size % group_size != 0:
            raise ValueError(f"group_size {group_size} does not divide hidden_size {full_size}")
        start, end = channels
        self.whole_groups = start % group_size == 0 and (end - start) % group_size == 0
        if not self.whole_groups and start // group_size != (end - 1) // group_size:
            raise ValueError(f"channels {channels} straddle groups of {group_size}")
        self.weight = nn.Parameter(torch.ones(end - start, dtype=dtype))
        self.checkpoint_shards["weight"] = TensorShard((full_size,), 0, (channels,))
        self.group_size = group_size
        self.num_groups = full_size // group_size
        self.group = start // group_size  # the group this rank's channels belong to
        self.eps = eps
        self.tp = tp
        self.norm_first = norm_first

    def forward(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y, gate: (T, I_local) -> (T, I_local)."""
        if self.norm_first:
            return self._norm_then_gate(y, gate, out_dtype)
        if self.whole_groups:
            return gated_rms_norm(y, gate, self.weight, self.group_size, self.eps, out_dtype)
        gated = y.float() * F.silu(gate.float())
        sum_squares = gated.new_zeros(gated.shape[0], self.num_groups)  # (T, G)
        sum_squares[:, self.group] = gated.pow(2).sum(-1)
        sum_squares = self.tp.all_reduce(sum_squares)[:, self.group : self.group + 1]  # (T, 1)
        normed = gated * torch.rsqrt(sum_squares / self.group_size + self.eps)
        return (self.weight.float() * normed).to(out_dtype)

    def forward_gpu(
        self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype,
        skip: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """forward on CUDA tensors, with Mamba2's D skip when given: skip = (x (T, I_local),
        D (H_local,) fp32) normalises y + D[h] * x instead of y, h = channel // (I_local /
        H_local), in fp32. Whole groups (always so at world_size 1) take the fused Triton
        kernel, one launch, the skip added as it reads y; a group split across ranks keeps the
        all-reduced path, the skip added first in PyTorch. norm_first runs forward (PyTorch)."""
        if not self.whole_groups or self.norm_first:
            return self.forward(y if skip is None else with_head_skip(y, *skip), gate, out_dtype)
        from engine.kernels.gpu.fused_norm import gated_rms_norm as gated_rms_norm_gpu

        return gated_rms_norm_gpu(y, gate, self.weight, self.group_size, self.eps, out_dtype, skip=skip)

    def _norm_then_gate(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """norm_first's forward, all in fp32: y, gate (T, I_local) -> (T, I_local) out_dtype."""
        num_tokens, width = y.shape
        y32 = y.float()
        if self.whole_groups:
            grouped = y32.view(num_tokens, width // self.group_size, self.group_size)
            normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
            normed = normed.view(num_tokens, width)
        else:
            sum_squares = y32.new_zeros(num_tokens, self.num_groups)  # (T, G)
            sum_squares[:, self.group] = y32.pow(2).sum(-1)
            sum_squares = self.tp.all_reduce(sum_squares)[:, self.group : self.group + 1]  # (T, 1)
            normed = y32 * torch.rsqrt(sum_squares / self.group_size + self.eps)
        return (self.weight.float() * normed * F.silu(gate.float())).to(out_dtype)


def with_head_skip(
    y: torch.Tensor,  # (T, I) fp32
    x: torch.Tensor,  # (T, I), any float dtype
    D: torch.Tensor,  # (H,) fp32
) -> torch.Tensor:
    """y + D[h] * x per channel of head h (I / H consecutive channels each), in fp32: (T, I)."""
    num_tokens, channels = y.shape
    heads = D.shape[0]
    per_head = lambda t: t.float().reshape(num_tokens, heads, channels // heads)  # noqa: E731
    return (per_head(y) + D.float()[:, None] * per_head(x)).view(num_tokens, channels)
