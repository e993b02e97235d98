"""The squared-ReLU kernel (engine/kernels/gpu/relu_squared.py) against its PyTorch reference
(engine/kernels/relu_squared_reference.py, what the CPU path runs), with the output poisoned
(NaN) before the run; and Nemotron-H's MLP GPU path (SquaredReluMLP.forward_gpu) against its
PyTorch path."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.relu_squared_reference import relu_squared as relu_squared_reference
from engine.layers.mlp import SquaredReluMLP
from engine.parallel.tensor_parallel import TensorParallel
from tests.gpu.conftest import INTERPRETED, needs_device, relative_error

pytestmark = [pytest.mark.gpu, needs_device]


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="the interpreter rounds fp32 to bf16 differently from torch (checked on the GPU)")),
])
@pytest.mark.parametrize("num_tokens", [1, 3, 200])
def test_relu_squared_equals_reference(device, dtype, num_tokens):
    from engine.kernels.gpu.relu_squared import relu_squared

    torch.manual_seed(40 + num_tokens)
    I = 3000  # not a power of two: the last block is masked
    wide = torch.randn(num_tokens, I + 100, device=device, dtype=dtype) * 3
    x = wide[:, 50 : 50 + I]  # a strided row view
    out = torch.full((num_tokens, I), float("nan"), dtype=dtype, device=device)
    got = relu_squared(x, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = relu_squared_reference(x)
    assert torch.equal(got, want), f"max |diff| {float((got.float() - want.float()).abs().max())}"
    assert relative_error(got, want) == 0.0


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_squared_relu_mlp_gpu_path_equals_pytorch_path(device, num_tokens):
    torch.manual_seed(50 + num_tokens)
    D, I = 64, 160
    mlp = SquaredReluMLP(D, I, (0, I), TensorParallel.single(), torch.float32).to(device)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    x = torch.randn(num_tokens, D, device=device)
    with torch.no_grad():
        assert relative_error(mlp.forward_gpu(x), mlp(x)) < 1e-5
