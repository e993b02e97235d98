"""Programmatic dependent launch (PDL) for our Triton kernels.

In a CUDA graph a kernel still starts only after the previous one has drained and its launch
has been processed. With PDL (Hopper and later) a kernel launched with the
programmatic-serialization attribute may start while its predecessor is still running; it must
then wait (`griddepcontrol.wait`) before it touches memory the predecessor may write, and the
wait returns once the predecessor has finished and its writes are visible. The launch, the
block scheduling and loads of weights overlap the predecessor instead of following it. On the
H200 a chain of dependent one-program kernels in a graph costs 0.54 us a kernel with PDL and
0.97 us without (benchmarks/pdl_overlap.py).

Contract for every kernel that takes part (each @triton.jit kernel of engine/kernels/gpu that
the forward pass launches):
- it has a `USE_PDL: tl.constexpr` parameter and first calls `release_next(USE_PDL)`, which lets
  the next kernel's programs be scheduled as soon as every program of this one has started,
  then `wait_for_previous(USE_PDL)` before its first load or store of anything a kernel
  ahead of it may have written;
- between the two it may load only what no kernel of the pass before it writes, because with
  every kernel releasing first, any kernel ahead of it in the chain may still be running there.
  That is the weights: the single-row GEMM loads its first weight tiles there, so its weight
  stream starts while the kernel ahead of it still runs, and the norms load their weights.
  It is also what was settled before the pass began: a forward pass starts with kernels
  launched without PDL (the embedding, PyTorch's), which start only once everything enqueued
  before them has finished, and every kernel of the pass starts after them. So the fused
  Mamba decode kernel (mamba_decode.py) loads there the step's plan (rows, slots, resets,
  copied in before the pass) and its own layer's conv and SSD state of its rows, which only
  it and the conv-window shift after it write within the pass; and that shift (conv.py's
  `_state_kernel`) loads the plan and the old window it shifts. A caller outside a forward
  pass must keep that true: two of these launches on the same state with no kernel without
  PDL between them would race (benchmarks/decode_kernels.py gives each call its own state);
- its launch passes `**launch_options()`: USE_PDL and Triton's `launch_pdl` option together.
Every participant waits before it reads or writes a cache or an activation, and a kernel's
wait returns only once its predecessor has finished (which waited for its own predecessor),
so the order of memory effects is exactly the stream order; PDL only overlaps launches,
scheduling and first weight loads with the kernels before. No deadlock: a kernel is launched
only after every program of its predecessor has started, so the programs that wait never hold
back one they wait for. Kernels that do not take part (cuBLAS, fla-core, PyTorch) are
serialised as usual on both sides.

`enabled()` decides once per process: on for CUDA devices of compute capability 9.0 or
later, off under Triton's interpreter and when HYBRID_SERVE_PDL=0 (set it to compare).
benchmarks/gpu_roofline.py captures the batch-1 decode graph both ways: on the H200, timed on
the GPU alone, 1.190 ms with PDL and 1.350 ms without; with PDL but every load after the wait,
1.276 ms.
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
    (a no-op without PDL). Call after release_next and before the kernel's first access to
    anything but weights (the module docstring's contract)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(USE_PDL: tl.constexpr):
    """Let the next PDL kernel's programs be scheduled once every program of this kernel has
    called this or exited (a no-op without PDL). Call first, before wait_for_previous."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def global_timer():
    """The GPU's global nanosecond timer (%globaltimer; coarse, but shared by all SMs). For
    diagnostics: benchmarks/pdl_overlap.py and tests/gpu/test_pdl_contract.py time and hold
    back kernels with it."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def spin_for(duration_ns):
    """Busy-wait about duration_ns nanoseconds; returns (start, end) global timer readings.
    For diagnostics, as global_timer."""
    start = global_timer()
    now = start
    while now - start < duration_ns:
        now = global_timer()
    return start, now
