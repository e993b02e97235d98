"""engine/kernels/gpu/pdl.py's contract, checked in the PTX the compiler emitted for every
kernel a model's forward pass compiled: with PDL, a kernel first releases its successor
(griddepcontrol.launch_dependents), then touches no global or shared memory until it waits
for its predecessor (griddepcontrol.wait). A load or store hoisted above the wait would read
what the previous kernel has not yet written: a race that numeric tests catch only by luck.

The exceptions, by design: the single-row GEMM loads its first weight tile before the wait,
and the two norms their weights (weights are never written by the pass). PTX does not say
which tensor a load reads, so for these the check is narrower: loads only, no store, atomic
or asynchronous copy before the wait.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest
import torch

from engine.config import DEFAULT_MODEL_DIR
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.step_io import ScheduledChunk
from engine.worker import build_forward_batch
from tests.gpu.conftest import INTERPRETED

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device")

# a (predicated) load, store, atomic or asynchronous copy of any state space
MEMORY_ACCESS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red|cp\.async|cp\.reduce)\.")


# kernels that load weights before their wait (the module docstring says why)
LOADS_WEIGHTS_BEFORE_WAIT = {
    "skinny_gemm._row_kernel", "skinny_gemm._tuned_row_kernel",
    "fused_norm._add_rms_norm_kernel", "fused_norm._gated_rms_norm_kernel",
}


def _accesses_before_wait(ptx: str, loads_allowed: bool = False) -> list[str]:
    """The memory instructions of a kernel's PTX ahead of its griddepcontrol.wait (parameter
    loads are not memory accesses here; with loads_allowed, global loads are not either)."""
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    return [
        line.strip() for line in lines[:wait]
        if MEMORY_ACCESS.search(line) and "ld.param" not in line
        and not (loads_allowed and "ld.global" in line)
    ]


def _compiled_pdl_kernels() -> dict[str, list[str]]:
    """Kernel name -> the PTX of each compiled variant that uses PDL, over every Triton kernel
    defined in engine.kernels.gpu."""
    import triton

    import engine.kernels.gpu as package

    found: dict[str, list[str]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            fn = obj.fn if isinstance(obj, triton.runtime.Autotuner) else obj
            if not isinstance(fn, triton.runtime.JITFunction) or fn.__module__ != module.__name__:
                continue
            for kernel_cache, *_ in fn.device_caches.values():
                for compiled in kernel_cache.values():
                    ptx = compiled.asm["ptx"]
                    if "griddepcontrol" in ptx:
                        found.setdefault(f"{info.name}.{name}", []).append(ptx)
    return found


def _run_model_steps() -> None:
    """A bf16 prefill of three sequences, then decode steps of one and of three sequences, on
    the GPU path: compiles the forward pass's kernels, the single-row GEMM among them."""
    model, config = load_model(DEFAULT_MODEL_DIR, dtype=torch.bfloat16, device=torch.device("cuda"))
    caches = model.allocate_caches(num_blocks=12, block_size=16, num_state_slots=3)

    def chunk(r: int, tokens: list[int], start: int) -> ScheduledChunk:
        return ScheduledChunk(
            request_id=f"r{r}", token_ids=tuple(tokens), start_position=start,
            block_table=tuple(range(4 * r, 4 * r + 4)), state_slot=r, reset_state=start == 0,
            sample=True, sampling=SamplingParams(),
        )

    with torch.inference_mode():
        for step in (
            [chunk(r, list(range(2, 40 + r)), 0) for r in range(3)],
            [chunk(0, [5], 38)],
            [chunk(r, [5], 39 + r) for r in range(3)],
        ):
            model(build_forward_batch(step, 16, torch.device("cuda")), caches)
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_every_pdl_kernel_releases_then_waits_before_touching_memory():
    from engine.kernels.gpu import pdl

    if not pdl.enabled():
        pytest.skip("PDL is off on this device (compute capability below 9.0 or HYBRID_SERVE_PDL=0)")
    _run_model_steps()
    kernels = _compiled_pdl_kernels()
    # norms, conv, SSD, paged attention, KV write, the single-row GEMM at the least
    assert len(kernels) >= 8, sorted(kernels)
    assert any("skinny" in name for name in kernels), sorted(kernels)
    for name, variants in kernels.items():
        for ptx in variants:
            release = ptx.find("griddepcontrol.launch_dependents")
            wait = ptx.find("griddepcontrol.wait")
            assert 0 <= release < wait, f"{name}: launch_dependents must come before the wait"
            allowed = name in LOADS_WEIGHTS_BEFORE_WAIT
            assert _accesses_before_wait(ptx, allowed) == [], f"{name} touches memory before its wait"


def test_the_checker_sees_a_load_before_the_wait():
    """The PTX check itself: a global load ahead of the wait is reported unless loads are
    allowed, a store always, a parameter load or anything after the wait never."""
    load = "@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd2 + 0 ];"
    store = "st.global.b16 [ %rd3 + 0 ], { %rs1 };"
    ptx = "\n".join([
        "griddepcontrol.launch_dependents;", "ld.param.u64 %rd1, [k_param_0];", load, store,
        "griddepcontrol.wait;", store,
    ])
    assert _accesses_before_wait(ptx) == [load, store]
    assert _accesses_before_wait(ptx, loads_allowed=True) == [store]
