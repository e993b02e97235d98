"""The MLP's silu(gate) * up on the GPU in one launch (PyTorch runs two, plus the chunk views),
and `softplus`, the elementwise helper the Mamba2 and gated delta-net kernels share.

GPU counterpart of engine/kernels/norm_reference.py:silu_and_mul, with its roundings: silu is
computed in fp32 and rounded to the input dtype before the product, which is rounded again.
Shapes: T tokens, I channels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous

# Triton's interpreter (TRITON_INTERPRET=1, the CPU checks of tests/gpu) does not emulate
# libdevice; there softplus takes log(1 + e^x), which differs from log1p only in rounding.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def softplus(x):
    """F.softplus (threshold 20) of an fp32 tensor: x above 20, else log1p(exp(x))."""
    if _INTERPRETED:
        smooth = tl.log(1.0 + tl.exp(x))
    else:
        smooth = libdevice.log1p(tl.exp(x))
    return tl.where(x > 20.0, x, smooth)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, stride_x,  # (T, 2I) = [gate | up], unit channel stride
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
    gate = tl.load(x_ptr + t * stride_x + i, mask=mask, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + i, mask=mask, other=0.0).to(tl.float32)
    activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(T, 2I) -> (T, I) in x's dtype; out (T, I) is allocated when None."""
    num_tokens, width = x.shape
    assert x.stride(1) == 1 and width % 2 == 0
    channels = width // 2
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(channels))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(channels, block))](
        x, x.stride(0), out, out.stride(0), channels, BLOCK=block, num_warps=4, **launch_options(),
    )
    return out
