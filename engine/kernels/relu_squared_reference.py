"""The squared ReLU of Nemotron-H's MLP ("relu2"), in pure PyTorch: the CPU path runs it and the
Triton kernel (engine/kernels/gpu/relu_squared.py) is tested against it.

relu(x)^2 in x's dtype, as transformers' ReLUSquaredActivation: the square of a value is
rounded once (PyTorch squares half-precision values in fp32 and rounds the result).
Shapes: T tokens, I channels.
"""

from __future__ import annotations

import torch


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """(T, I) -> (T, I) in x's dtype."""
    return torch.square(torch.relu(x))
