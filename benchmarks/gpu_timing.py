"""GPU timing with CUDA events, shared by the roofline and the kernel sweeps (CUDA only)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of `repeats` back-to-back calls of fn, timed by CUDA events (the device
    synchronised before and after)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def graph_seconds(fn: Callable[[int], object], calls: int = 20, repeats: int = 15) -> float:
    """Median seconds of one call, from CUDA-graph replays of `calls` back-to-back calls
    fn(0), fn(1), ..., fn(calls - 1): launch gaps as in the engine's decode graphs. fn(0) and
    fn(1) run eagerly first (Triton compiles and tunes outside the capture)."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def keep_gpu_busy(seconds: float = 2e-3) -> None:
    """Queue about `seconds` of GPU sleep (at a 2 GHz clock), so that work queued right after
    it is all submitted before the GPU reaches it: events around that work then time the GPU
    alone, not the host's submission."""
    torch.cuda._sleep(int(seconds * 2e9))
