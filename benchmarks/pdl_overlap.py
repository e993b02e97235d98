"""Does programmatic dependent launch (engine/kernels/gpu/pdl.py) overlap kernels on this
device, eagerly and inside a CUDA graph, and what does a kernel boundary cost?

Two measurements, each with PDL on and off, in a CUDA graph and on a plain stream:

  * overlap: a one-program kernel that spins for SPIN_US microseconds, then a probe kernel
    that reads the GPU's global timer before and after its griddepcontrol.wait. With PDL in
    effect the probe starts (its first timer read) before the spinner ends; without it, after;
  * chain: CHAIN trivial one-program kernels back to back, each loading what the previous one
    stored (the dependency a model's small kernels have): microseconds per kernel.

    python benchmarks/pdl_overlap.py --out benchmarks/results/pdl_overlap.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.pdl import global_timer, release_next, spin_for, wait_for_previous
from harness import add_out_argument, middle, write_result

SPIN_US = 20
CHAIN = 200


@triton.jit
def _spin_kernel(times_ptr, spin_ns, USE_PDL: tl.constexpr):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    start, end = spin_for(spin_ns)
    tl.store(times_ptr, start)
    tl.store(times_ptr + 1, end)


@triton.jit
def _probe_kernel(times_ptr, USE_PDL: tl.constexpr):
    release_next(USE_PDL)
    before = global_timer()
    wait_for_previous(USE_PDL)
    after = global_timer()
    tl.store(times_ptr + 2, before)
    tl.store(times_ptr + 3, after)


@triton.jit
def _step_kernel(src_ptr, dst_ptr, USE_PDL: tl.constexpr):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    offsets = tl.arange(0, 256)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets) + 1.0)


def _compiled(run, graphed: bool):
    """`run` after one call (Triton compiles), or the replay of a CUDA graph of it."""
    run()
    torch.cuda.synchronize()
    if not graphed:
        return run
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def overlap(use_pdl: bool, graphed: bool) -> dict:
    """The probe's first timer read and its wait's return, relative to the spinner's end
    (negative: before it), in the middle of five runs."""
    times = torch.zeros(4, dtype=torch.int64, device="cuda")

    def launch() -> None:
        _spin_kernel[(1,)](times, SPIN_US * 1000, USE_PDL=use_pdl, launch_pdl=use_pdl)
        _probe_kernel[(1,)](times, USE_PDL=use_pdl, launch_pdl=use_pdl)

    run = _compiled(launch, graphed)
    samples = []
    for _ in range(5):
        run()
        torch.cuda.synchronize()
        spin_start, spin_end, probe_start, probe_after_wait = times.tolist()
        samples.append({"probe_start_minus_spin_end_us": (probe_start - spin_end) / 1e3,
                        "wait_return_minus_spin_end_us": (probe_after_wait - spin_end) / 1e3})
    return sorted(samples, key=lambda s: s["probe_start_minus_spin_end_us"])[len(samples) // 2]


def chain(use_pdl: bool, graphed: bool) -> float:
    """Microseconds per kernel of CHAIN dependent one-program kernels."""
    a, b = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda")

    def launch() -> None:
        for i in range(CHAIN):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            _step_kernel[(1,)](src, dst, USE_PDL=use_pdl, launch_pdl=use_pdl)

    run = _compiled(launch, graphed)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    results = []
    for _ in range(5):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        results.append(start.elapsed_time(end) * 1e3 / CHAIN)
    return middle(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "pdl_overlap")
    args = parser.parse_args()
    rows = []
    for graphed in (True, False):
        for use_pdl in (True, False):
            rows.append({"graph": graphed, "pdl": use_pdl, **overlap(use_pdl, graphed),
                         "chain_us_per_kernel": chain(use_pdl, graphed)})
    print(f"{'graph':>6}{'pdl':>6}{'probe start - spin end us':>28}{'wait return - spin end us':>28}"
          f"{'chain us/kernel':>18}")
    for r in rows:
        print(f"{r['graph']!s:>6}{r['pdl']!s:>6}{r['probe_start_minus_spin_end_us']:>28.2f}"
              f"{r['wait_return_minus_spin_end_us']:>28.2f}{r['chain_us_per_kernel']:>18.2f}")
    out = write_result(args.out, "pdl_overlap", {"device": torch.cuda.get_device_name(), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
