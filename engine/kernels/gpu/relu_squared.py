"""The MLP's squared ReLU on the GPU in one launch (PyTorch runs two: relu, then square).

GPU counterpart of engine/kernels/relu_squared_reference.py:relu_squared, with its rounding:
the square is computed in fp32 and rounded once to the input dtype.
Shapes: T tokens, I channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous


@triton.jit
def _relu_squared_kernel(
    x_ptr, stride_x,  # (T, I), unit channel stride
    out_ptr, stride_o,  # (T, I)
    I,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < I
    x = tl.load(x_ptr + t * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    x = tl.maximum(x, 0.0)
    tl.store(out_ptr + t * stride_o + i, (x * x).to(out_ptr.dtype.element_ty), mask=mask)


def relu_squared(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(T, I) -> relu(x)^2 (T, I) in x's dtype; out (T, I) is allocated when None."""
    num_tokens, channels = x.shape
    assert x.stride(1) == 1
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(channels))
    _relu_squared_kernel[(num_tokens, triton.cdiv(channels, block))](
        x, x.stride(0), out, out.stride(0), channels, BLOCK=block, num_warps=4, **launch_options(),
    )
    return out
