"""Instruments the roofline reads a step with: one step under torch.profiler (what dominates:
kernel time against wall time, the critical path, the host's side), where the host waits for
the device during a step, when the host and the GPU pass the points of a restore + prefill
step, and a cProfile of a step's submit."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.execution.worker import Worker
from engine.interfaces.step_io import SchedulerOutput

STEP_LABEL = "roofline step"  # the record_function range around a profiled step


def profile_step(worker: Worker, step: SchedulerOutput, top: int = 8) -> dict:
    """One step under torch.profiler: wall time, summed GPU kernel time, the top kernels, the
    critical path, and the host's side (_host_side).

    gpu/wall near 1 means the GPU is the bottleneck; far below 1, host time and launches are."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        with record_function(STEP_LABEL):
            worker.execute(step)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [
        (e.key, getattr(e, "self_device_time_total", 0) / 1e6, e.count)
        for e in prof.key_averages()
        if str(getattr(e, "device_type", "")).endswith("CUDA") and getattr(e, "self_device_time_total", 0) > 0
        and e.key != STEP_LABEL
    ]
    kernels.sort(key=lambda k: -k[1])
    gpu = sum(k[1] for k in kernels)
    launches = sum(k[2] for k in kernels)
    events = list(prof.events())
    on_gpu = gpu_events(events)
    return {"wall_s": wall, "gpu_kernel_s": gpu, "gpu_share": gpu / wall, "kernel_launches": launches,
            "gpu_span_s": kernel_span(on_gpu),
            "top": [{"kernel": k[0][:90], "seconds": k[1], "count": k[2]} for k in kernels[:top]],
            "critical_path": critical_path(on_gpu)[:top], **_host_side(events, on_gpu, top)}


def gpu_events(events: list) -> list:
    """The timed GPU events of a trace (kernels, copies, memsets), without the GPU-side copy of
    the step's record_function range."""
    return [e for e in events
            if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start
            and e.name != STEP_LABEL]


def _host_side(events: list, on_gpu: list, top: int) -> dict:
    """Where the host's share of a profiled step goes: the time from the step's start (its
    record_function range) to the first GPU event's start (host_lead_s: what the host does
    before the GPU has work) and from the last one's end to the step's end (host_tail_s: the
    token's way back), and the CUDA runtime calls by summed host time (cudaGraphLaunch,
    cudaLaunchKernel, cudaMemcpyAsync, the synchronisations), largest first."""
    steps = [e.time_range for e in events
             if e.name == STEP_LABEL and not str(getattr(e, "device_type", "")).endswith("CUDA")]
    if not steps or not on_gpu:
        return {}
    step = steps[0]
    calls: dict[str, list] = {}
    for e in events:
        if e.name.startswith("cuda") and step.start <= e.time_range.start <= step.end:
            entry = calls.setdefault(e.name, [0.0, 0])
            entry[0] += (e.time_range.end - e.time_range.start) / 1e6
            entry[1] += 1
    ranked = sorted(calls.items(), key=lambda item: -item[1][0])[:top]
    return {"host_lead_s": (min(e.time_range.start for e in on_gpu) - step.start) / 1e6,
            "host_tail_s": (step.end - max(e.time_range.end for e in on_gpu)) / 1e6,
            "runtime_calls": [{"call": name, "seconds": seconds, "count": count}
                              for name, (seconds, count) in ranked]}


def critical_path(on_gpu: list) -> list[dict]:
    """What each kernel adds to the GPU timeline, summed by kernel name, largest first: kernels
    in order of their end, each charged the time from the previous kernel's end to its own
    (the first its whole duration). The charges add up to the first-to-last span. Unlike
    kernel durations this stays meaningful under PDL, where a kernel starts early and its
    duration includes the wait for its predecessor."""
    kernels = sorted((e.time_range.end, e.time_range.start, e.name) for e in on_gpu)
    charged: dict[str, list] = {}
    previous_end = None
    for end, start, name in kernels:
        seconds = (end - (start if previous_end is None else previous_end)) / 1e6
        entry = charged.setdefault(name[:90], [0.0, 0])
        entry[0] += max(seconds, 0.0)
        entry[1] += 1
        previous_end = end
    ranked = sorted(charged.items(), key=lambda item: -item[1][0])
    return [{"kernel": name, "seconds": seconds, "count": count} for name, (seconds, count) in ranked]


def kernel_span(on_gpu: list) -> float | None:
    """Seconds from the first kernel's start to the last kernel's end on the GPU timeline: the
    kernels plus the gaps between them, without the host time before and after (None if the
    trace has no timed kernels). span - kernel sum = gaps; wall - span = host at the ends."""
    if not on_gpu:
        return None
    return (max(e.time_range.end for e in on_gpu) - min(e.time_range.start for e in on_gpu)) / 1e6



def host_synchronisations(worker: Worker, step: SchedulerOutput) -> dict[str, int]:
    """Where the host waits for the device while the worker runs `step` once (CUDA): torch's
    sync debug mode warns at every synchronising call (a blocking copy, a copy from pageable
    memory, an .item(), a stream synchronise); returns "file:line: message" -> count. The
    read-back of the sampled token at the end of the step is one of them by design."""
    import warnings

    synchronize(worker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            worker.execute(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts: dict[str, int] = {}
    for w in caught:
        if str(w.message).startswith("Synchronization debug mode is a prototype"):
            continue  # the mode's notice about itself, not a synchronisation
        key = f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def step_timeline(worker: Worker, step: SchedulerOutput, repeats: int = 5) -> dict[str, dict[str, float]]:
    """When the host reaches each point of a restore + prefill-graph step, and when the GPU
    passes it, in ms from the step's start (CUDA; the median of `repeats` runs of `step`).

    The points: the restore called and returned, the prefill graph's replay called and
    returned, submit returned, collect returned (host only). At each the host's clock is read
    and a CUDA event recorded; the GPU starts idle, so an event's time is when the GPU had
    finished everything launched before it: where it equals the host's, the GPU was waiting for
    the host. The worker's restore and graph forward are wrapped for the duration (this
    benchmark's instrument; the worker's code is unchanged)."""
    import statistics

    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(point: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((point, time.perf_counter(), event))

    def wrapped(owner, name: str):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            mark(f"{name} called")
            result = original(*args, **kwargs)
            mark(f"{name} returned")
            return result
        return original, call

    store, graphs = worker.checkpoints, worker.prefill_graphs
    restore, timed_restore = wrapped(store, "restore")
    forward, timed_forward = wrapped(graphs, "forward")
    store.restore, graphs.forward = timed_restore, timed_forward
    runs: list[dict[str, tuple[float, float | None]]] = []
    try:
        for _ in range(repeats):
            marks.clear()
            synchronize(worker)
            mark("start")
            worker.submit(step)
            mark("submit returned")
            worker.collect()
            collected = time.perf_counter()
            torch.cuda.synchronize()
            _, host0, event0 = marks[0]
            run = {point: ((host - host0) * 1e3, event0.elapsed_time(event)) for point, host, event in marks}
            run["collect returned"] = ((collected - host0) * 1e3, None)
            runs.append(run)
    finally:
        del store.restore, graphs.forward  # the instance attributes: back to the methods
    assert store.restore == restore and graphs.forward == forward
    return {
        point: {"host_ms": statistics.median(r[point][0] for r in runs),
                **({} if runs[0][point][1] is None else {"gpu_ms": statistics.median(r[point][1] for r in runs)})}
        for point in runs[0]
    }


def submit_profile(worker: Worker, step: SchedulerOutput, repeats: int = 5, top: int = 25) -> list[str]:
    """cProfile of the worker's submit of `step` (not its collect) over `repeats` runs: the
    functions by cumulative host time, in microseconds a run, which shows what the host does
    before and after it launches the step's GPU work."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(repeats):
        synchronize(worker)
        profiler.enable()
        worker.submit(step)
        profiler.disable()
        worker.collect()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, ncalls, own, cumulative, callers)
    ranked = sorted(stats.items(), key=lambda item: -item[1][3])[:top]
    lines = [f"submit only, per run of {repeats} (cProfile):",
             f"{'cumulative us':>14}{'own us':>9}{'calls':>7}  function"]
    for (file, line, function), (_, calls, own, cumulative, _) in ranked:
        where = f"{Path(file).name}:{line}({function})" if line else function
        lines.append(f"{cumulative / repeats * 1e6:>14.1f}{own / repeats * 1e6:>9.1f}{calls / repeats:>7.0f}  {where}")
    return lines


def synchronize(worker: Worker) -> None:
    """Wait for the worker's device (a no-op on CPU)."""
    if worker.device.type == "cuda":
        torch.cuda.synchronize()

