"""Where the host's time goes in a batch-1 decode step replayed from a CUDA graph.

On the ~1.5B config of benchmarks/roofline/model.py (random bf16 weights), one worker with
decode graphs for batch 1, request 0 decoding on from position 0. Rows (medians over STEPS):

  * step: Worker.execute, synchronised before and after (gpu_roofline's sync_seconds),
    and its parts on the host, from wrappers around the runner's forward and the sampler:
    before the forward, the forward, between it and sampling, sampling (which waits for the
    GPU: argmax and the read-back), after sampling;
  * runner: staging, the staged inputs' host-to-device copy, graph.replay() and a
    synchronisation, and the host time of the first three;
  * GPU alone: the runner's forward queued behind a GPU sleep, timed by events around it;
  * GPU from idle: the same events without the sleep: the GPU's view of a step that starts
    when the host does.

Each step is collected before the next is staged (no async scheduling), so the host's work
shows in the step's wall time; gpu_roofline.py's decode rows time the async step, which hides
it behind the GPU.

    python benchmarks/decode_host_time.py --out benchmarks/results/decode_host_time.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.execution.worker import Worker
from engine.interfaces.step_io import SchedulerOutput
from gpu_timing import keep_gpu_busy
from harness import add_out_argument, middle, write_result
from roofline.model import chunk, sized_config, write_random_checkpoint

STEPS = 40
BLOCKS_PER_SEQ = 1024  # max_model_len 16,384 / 16: the worker refuses a smaller KV budget


class _Steps:
    """Request 0's decode steps, one position further each call."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> list:
        step = [chunk(0, (5,), self.position, BLOCKS_PER_SEQ, reset=self.position == 0)]
        self.position += 1
        return step


def _execute_parts(worker: Worker, steps: _Steps) -> dict[str, float]:
    """Medians of the host intervals inside Worker.execute, timed by wrappers around the decode
    runner's forward and the sampler's sample (instance attributes, removed afterwards)."""
    marks: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            marks[name + " in"] = time.perf_counter()
            result = fn(*args, **kwargs)
            marks[name + " out"] = time.perf_counter()
            return result
        return wrapper

    worker.decode_graphs.forward = timed("forward", worker.decode_graphs.forward)
    worker.sampler.sample = timed("sample", worker.sampler.sample)
    parts: dict[str, list[float]] = {
        "execute: before the forward": [], "execute: runner forward (host)": [],
        "execute: forward to sampling": [], "execute: sampling (waits for the GPU)": [],
        "execute: after sampling": [],
    }
    try:
        for _ in range(STEPS):
            out = SchedulerOutput(tuple(steps.next()))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.execute(out)
            t1 = time.perf_counter()
            bounds = (t0, marks["forward in"], marks["forward out"], marks["sample in"], marks["sample out"], t1)
            for values, start, end in zip(parts.values(), bounds, bounds[1:]):
                values.append(end - start)
    finally:
        del worker.decode_graphs.forward, worker.sampler.sample
    return {name: middle(values) for name, values in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "decode_host_time")
    args = parser.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "granite-hybrid-1p5b-random"
        write_random_checkpoint(model_dir)
        probe = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda")
        config = sized_config(probe, 2, BLOCKS_PER_SEQ)
        worker = Worker(replace(config, max_num_batched_tokens=32))  # no prefill graphs
        runner = worker.decode_graphs
        steps = _Steps()
        rows: dict[str, float] = {}

        wall = []
        for _ in range(STEPS):
            out = SchedulerOutput(tuple(steps.next()))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.execute(out)
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
        rows["step: Worker.execute"] = middle(wall)
        rows.update(_execute_parts(worker, steps))

        graph = runner._graphs[1]
        parts = {"runner: staging + copy + replay + sync": [], "host: staging": [],
                 "host: input copy enqueued": [], "host: graph.replay()": []}
        staging, host = runner._stagings[0], runner._hosts[0]
        used = staging.used_length(1)
        for _ in range(STEPS):
            step = steps.next()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            staging.stage(step, 1)
            t1 = time.perf_counter()
            runner._inputs[:used].copy_(host[:used], non_blocking=True)
            t2 = time.perf_counter()
            graph.replay()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            for name, value in zip(parts, (t4 - t0, t1 - t0, t2 - t1, t3 - t2)):
                parts[name].append(value)
        rows.update({name: middle(values) for name, values in parts.items()})

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name, busy in (("GPU alone (behind a sleep)", True), ("GPU from idle", False)):
            times = []
            for _ in range(STEPS):
                step = steps.next()
                torch.cuda.synchronize()
                if busy:
                    keep_gpu_busy()
                start.record()
                runner.forward(step)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            rows[name] = middle(times)

    report["rows_s"] = rows
    width = max(len(n) for n in rows)
    for name, seconds in rows.items():
        print(f"{name:<{width}}  {seconds * 1e3:8.3f} ms")
    out = write_result(args.out, "decode_host_time", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
