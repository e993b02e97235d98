"""The norm layers' PyTorch paths against the reference kernels."""

from __future__ import annotations

import torch

import pytest

from engine.kernels.norm_reference import gated_rms_norm, rms_norm
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


def _rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, written out op by op in fp32 (what the references
    computed before they called F.rms_norm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(1, 128), (16, 128), (7, 4096), (3, 5, 64), (200, 256)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_fp32_norms_equal_the_written_out_formula_bitwise(shape, scale):
    """rms_norm and gated_rms_norm take torch's F.rms_norm for fp32 operands: their results
    must be bitwise those of the formula written out (fp32: the same products in the same
    order), whole groups and split into groups."""
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x = scale * torch.randn(*shape, generator=g)
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    assert torch.equal(rms_norm(x, weight, 1e-5), weight * _rms_normalised(x, 1e-5))
    width = shape[-1]
    y, gate = x.reshape(-1, width), torch.randn(x.numel() // width, width, generator=g)
    gated = y * torch.nn.functional.silu(gate)
    for group_size in (width, width // 4):
        grouped = gated.view(-1, width // group_size, group_size)
        want = weight * _rms_normalised(grouped, 1e-5).view_as(gated)
        assert torch.equal(gated_rms_norm(y, gate, weight, group_size, 1e-5, torch.float32), want)
