"""Programmatic dependent launch (PDL) for our Triton kernels.

In a CUDA graph a kernel still starts only after the previous one has drained and its launch
has been processed: about a microsecond per kernel on the H200, which at decode batch 1 (about
280 small kernels a step) is a fifth of the step. With PDL (Hopper and later) a kernel launched
with the programmatic-serialization attribute may start while its predecessor is still
running; it must then wait (`griddepcontrol.wait`) before it touches memory, and the wait
returns once the predecessor has finished and its writes are visible. The launch and the
block scheduling overlap the predecessor instead of following it.

Contract for every kernel that takes part (each @triton.jit kernel of engine/kernels/gpu that
the forward pass launches):
- it has a `USE_PDL: tl.constexpr` parameter and first calls `release_next(USE_PDL)`, which lets
  the next kernel's programs be scheduled as soon as every program of this one has started,
  then `wait_for_previous(USE_PDL)` before its first load or store of anything an earlier
  kernel may have written;
- between the two it may load only what no kernel of the pass writes (the weights): the
  single-row GEMM loads its first weight tile there, so its weight stream starts while the
  kernel ahead of it still runs;
- its launch passes `**launch_options()`: USE_PDL and Triton's `launch_pdl` option together.
Every participant waits before it reads or writes a cache or an activation, and a kernel's
wait returns only once its predecessor has finished (which waited for its own predecessor),
so the order of memory effects is exactly the stream order; PDL only overlaps launches,
scheduling and first weight loads with the kernels before. No deadlock: a kernel is launched
only after every program of its predecessor has started, so the programs that wait never hold
back one they wait for. Kernels that do not take part (cuBLAS, fla-core, PyTorch) are
serialised as usual on both sides.

`enabled()` decides once per process: on for CUDA devices of compute capability 9.0 or
later, off under Triton's interpreter and when HYBRID_SERVE_PDL=0 (set it to compare). On the
H200 the batch-1 decode step of benchmarks/gpu_roofline.py took 1.79 ms in the run before PDL
and 1.63 ms in the run with it (two machines, so the gain is approximate; see
benchmarks/gpu_roofline_notes.md, fourth session).
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl


@functools.cache
def enabled() -> bool:
    """Whether launches use PDL in this process (see the module docstring)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("HYBRID_SERVE_PDL") == "0":
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def launch_options() -> dict:
    """Keyword arguments for a participating kernel's launch."""
    on = enabled()
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible
    (a no-op without PDL). Call before the kernel's first memory access."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(USE_PDL: tl.constexpr):
    """Let the next PDL kernel's programs be scheduled once every program of this kernel has
    called this or exited (a no-op without PDL). Call first, before wait_for_previous."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

