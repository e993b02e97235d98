"""The decode rows of the GPU roofline: decode tokens/s of `batch` sequences with `context`
tokens of context against the bytes a step must move at the copy rate, through the worker's
CUDA graphs (engine/routes/decode_graphs.py) or eagerly.

A row's time is a step of the engine's default async scheduling (each step submitted before
the one before is collected, its token read on the device). Each row also reports the step
collected before the next is staged (sync) and, with graphs, the replay of its graph alone
(the step's GPU time without the host work around it); batch 1 with graphs also carries a
cProfile of its host side.
"""

from __future__ import annotations

import time

import torch

from engine.execution.worker import Worker
from engine.interfaces.request import PENDING_TOKEN
from engine.interfaces.step_io import SchedulerOutput
from gpu_timing import keep_gpu_busy
from harness import middle
from roofline.floors import decode_bytes, decode_target
from roofline.instruments import profile_step
from roofline.model import BLOCK_SIZE, chunk

# bench_decode's steps: warm-up, timed (the median is reported; with 20 timed steps the batch-1
# row moved by 5% between runs whose steps measured the same elsewhere), then one profiled;
# host_profile and decode_step_anatomy decode on after them
DECODE_WARMUP, DECODE_TIMED = 3, 50
DECODE_STEPS_RUN = 2 * (DECODE_WARMUP + DECODE_TIMED + 1)  # bench_decode's two runs
HOST_PROFILE_STEPS = 10


def decode_row(worker: Worker, mode: str, first_request: int, batch: int, context: int,
               blocks_per_seq: int, copy_bw: float) -> dict:
    """One row: requests first_request .. first_request + batch - 1 prefilled to `context`, then
    decoding; mode "graphs" (the worker's decode graphs attached) or "eager" (detached)."""
    step_s, sync_s, decode_profile = bench_decode(worker, first_request, batch, context, blocks_per_seq)
    replay_s = graph_replay_seconds(worker, batch) if mode == "graphs" else None
    host = (host_profile(worker, first_request, batch, context, blocks_per_seq)
            if batch == 1 and mode == "graphs" else None)
    moved = decode_bytes(worker.model, batch, context, BLOCK_SIZE)
    floor = moved / copy_bw
    label_suffix = "" if mode == "graphs" else " (eager)"
    return {"name": f"decode batch {batch} ctx {context}{label_suffix}", "mode": mode,
            "seconds": step_s, "floor_seconds": floor, "ratio_to_floor": floor / step_s,
            "bytes": moved, "tokens_per_s": batch / step_s,
            "sync_seconds": sync_s, "sync_ratio_to_floor": floor / sync_s,
            **decode_target(batch), "profile": decode_profile,
            **({"graph_replay_seconds": replay_s} if replay_s is not None else {}),
            **({"host_profile": host} if host else {})}


def bench_decode(worker: Worker, first_request: int, batch: int, context: int, blocks_per_seq: int,
                 warmup: int = DECODE_WARMUP, steps: int = DECODE_TIMED) -> tuple[float, float, dict]:
    """Decode step seconds of `batch` sequences prefilled to `context` tokens (8K-token prefill
    steps), two ways, the same requests decoding on:
      async: as the engine runs by default (EngineConfig.async_scheduling): each step is
        submitted before the one before is collected, its tokens PENDING_TOKEN, read on the
        device; wall time of `steps` consecutive steps / steps;
      sync: each step collected before the next is staged, the GPU idle in between (the
        median of `steps` single steps, each from an idle GPU).
    Returns (async seconds, sync seconds, a profile of one more (sync) step)."""
    requests = list(range(first_request, first_request + batch))
    per_step = max(1, 8192 // context)
    for i in range(0, batch, per_step):
        chunks = tuple(
            chunk(r, torch.randint(2, 49152, (context,)).tolist(), 0, blocks_per_seq, True, sample=False)
            for r in requests[i : i + per_step]
        )
        worker.execute(SchedulerOutput(chunks))
    position, last = context, {r: 5 for r in requests}

    def step_at(tokens: dict[int, int]) -> SchedulerOutput:
        return SchedulerOutput(tuple(chunk(r, (tokens[r],), position, blocks_per_seq, False) for r in requests))

    times = []
    for s in range(warmup + steps):
        out = step_at(last)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = worker.execute(out)
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
        last = {r: result.sampled_token_ids[f"r{r}"] for r in requests}
        position += 1
    sync_s = middle(times)

    pending = {r: PENDING_TOKEN for r in requests}
    worker.submit(step_at(last))
    for s in range(warmup + steps):
        if s == warmup:
            t0 = time.perf_counter()
        position += 1
        worker.submit(step_at(pending))
        worker.collect()
    async_s = (time.perf_counter() - t0) / steps
    result = worker.collect()
    last = {r: result.sampled_token_ids[f"r{r}"] for r in requests}
    position += 1
    return async_s, sync_s, profile_step(worker, step_at(last), top=16)


def host_profile(worker: Worker, first_request: int, batch: int, context: int, blocks_per_seq: int,
                 steps: int = HOST_PROFILE_STEPS, top: int = 18) -> list[str]:
    """cProfile of `steps` decode steps of the requests bench_decode left behind (they decode
    on): the top functions by own time, per step, where a step's host time goes (the GPU's
    time shows up as the wait in whatever reads the sampled tokens back)."""
    import cProfile
    import io
    import pstats

    requests = list(range(first_request, first_request + batch))
    position = context + DECODE_STEPS_RUN  # after bench_decode's steps
    profiler = cProfile.Profile()
    for s in range(steps):
        out = SchedulerOutput(tuple(chunk(r, (5,), position + s, blocks_per_seq, False) for r in requests))
        torch.cuda.synchronize()
        profiler.enable()
        worker.execute(out)
        torch.cuda.synchronize()
        profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return [f"per step over {steps} steps (cProfile, seconds are totals):"] + lines[start:]


def graph_replay_seconds(worker: Worker, batch: int, replays: int = 20) -> float | None:
    """Median seconds of one replay of the decode graph for `batch` rows on its own (the last
    staged inputs again, so the requests' states advance once per replay; the rows that use
    them are done): the step's GPU time without the host work around it (staging, sampling,
    the read-back), the replay queued behind a GPU sleep so that the host's submission does
    not show. None without decode graphs."""
    graphs = worker.decode_graphs
    if graphs is None:
        return None
    size = next(s for s in graphs.batch_sizes if s >= batch)
    graph = graphs._graphs[size]  # a benchmark's look inside the runner
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        keep_gpu_busy()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return middle(times)

