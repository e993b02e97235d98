"""A Triton kernel for tests/gpu/test_pdl_contract.py: a PDL kernel that writes its output late.

Imported only by device tests (it needs triton, which the CPU-only suite does not install).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import launch_options, release_next, spin_for, wait_for_previous


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, numel, spin_ns, USE_PDL: tl.constexpr, BLOCK: tl.constexpr):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    spin_for(spin_ns)
    for first in range(0, numel, BLOCK):
        offsets = first + tl.arange(0, BLOCK)
        mask = offsets < numel
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def copy_late(src: torch.Tensor, dst: torch.Tensor, spin_us: float) -> None:
    """dst <- src (contiguous, same shape and dtype) by one PDL kernel that first spins for
    spin_us microseconds, so a PDL kernel launched right after it runs its pre-wait part while
    dst still holds its old values."""
    assert src.is_contiguous() and dst.is_contiguous() and src.shape == dst.shape and src.dtype == dst.dtype
    _late_copy_kernel[(1,)](src, dst, src.numel(), int(spin_us * 1000), BLOCK=1024, **launch_options())
