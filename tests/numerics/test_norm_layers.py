"""The norm layers' PyTorch paths against the reference kernels."""

from __future__ import annotations

import torch

from engine.kernels.norm_reference import gated_rms_norm
from engine.layers.norm import GroupParallelGatedRMSNorm
from engine.parallel.tensor_parallel import TensorParallel


def test_split_group_path_adds_the_D_skip_first():
    """forward_gpu's path for a group split across ranks (PyTorch, so it runs here) normalises
    y + D[h] * x: at world size 1 its all-reduce is the identity, so on a whole group it must
    equal the reference norm of y + D * x computed here."""
    g = torch.Generator().manual_seed(0)
    T, H, P, G, N = 5, 6, 8, 2, 4
    I = H * P
    norm = GroupParallelGatedRMSNorm(I, group_size=I, channels=(0, I), eps=1e-5, tp=TensorParallel.single())
    norm.whole_groups = False  # the split-group path
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(I, generator=g))
    y, gate = torch.randn(T, I, generator=g), torch.randn(T, I, generator=g)
    x = torch.randn(T, I + 2 * G * N, generator=g).to(torch.bfloat16)[:, :I]  # [x | B | C]
    D = 2 * torch.randn(H, generator=g)

    got = norm.forward_gpu(y, gate, torch.float32, skip=(x, D))
    y_with_skip = (y.view(T, H, P) + D[:, None] * x.float().reshape(T, H, P)).view(T, I)
    torch.testing.assert_close(got, gated_rms_norm(y_with_skip, gate, norm.weight, I, 1e-5, torch.float32))
