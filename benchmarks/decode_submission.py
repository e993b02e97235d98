"""Where the host's time goes in a batch-1 decode step replayed from a CUDA graph, and does the
GPU wait for the whole graph's submission before it starts?

On the ~1.5B config of benchmarks/gpu_roofline.py (random bf16 weights), one worker with
decode graphs for batch 1, request 0 decoding on from position 0. Rows (medians over STEPS):

  * step: Worker.execute, synchronised before and after (what gpu_roofline's decode row times);
  * runner: DecodeGraphRunner.forward then a synchronisation, and its parts on the host:
    staging, the input copy's enqueue, graph.replay()'s own host time;
  * GPU alone: the same forward queued behind a GPU sleep, timed by events around it;
  * GPU from idle: the same events without the sleep. If the GPU waits for the whole graph's
    submission, this exceeds "GPU alone" by about replay()'s host time;
  * split graphs: the same forward captured as several graphs cut between decoder layers
    (the first pieces small, so the GPU starts while the host still submits the rest), each
    replayed in order; wall time of staging + copy + replays + synchronisation.

    python benchmarks/decode_submission.py --out benchmarks/results/decode_submission.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.step_io import SchedulerOutput
from engine.worker import Worker

from gpu_roofline import _keep_gpu_busy, _sized, chunk, write_random_checkpoint  # noqa: E402

STEPS = 40
BLOCKS_PER_SEQ = 1024  # max_model_len 16,384 / 16: the worker refuses a smaller KV budget


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


class _Steps:
    """Request 0's decode steps, one position further each call."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> list:
        step = [chunk(0, (5,), self.position, BLOCKS_PER_SEQ, reset=self.position == 0)]
        self.position += 1
        return step


def _split_graphs(worker: Worker, cuts: tuple[int, ...]):
    """The batch-1 decode forward captured as len(cuts) + 1 graphs, cut before each decoder
    layer in `cuts`: a benchmark's reach into the runner and the model (layer.forward_gpu is
    wrapped for the capture only). Returns (graphs, runner) with the runner's static inputs."""
    from engine.cuda_graphs import DecodeGraphRunner

    runner = DecodeGraphRunner(
        worker.model, worker.caches, (1,), worker.decode_graphs.max_blocks,
        scratch_slot=worker.capacity.num_state_slots, scratch_block=worker.capacity.num_blocks,
    )
    runner._staging.fill_padding(0, 1)
    runner._inputs.copy_(runner._host)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = [torch.cuda.CUDAGraph() for _ in range(len(cuts) + 1)]
    layers = worker.model.layers
    originals = {i: layers[i].forward_gpu for i in cuts}
    piece = [0]

    def cut_before(i):
        def forward_gpu(*args, **kwargs):
            graphs[piece[0]].capture_end()
            piece[0] += 1
            graphs[piece[0]].capture_begin(pool=pool)
            return originals[i](*args, **kwargs)
        return forward_gpu

    with torch.inference_mode():
        runner._forward(1)  # warm-up
        torch.cuda.synchronize()
        for i in cuts:
            layers[i].forward_gpu = cut_before(i)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                graphs[0].capture_begin(pool=pool)
                outputs = runner._forward(1)
                graphs[-1].capture_end()
        finally:
            for i in cuts:
                del layers[i].forward_gpu  # back to the class's method
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    return graphs, runner, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/decode_submission.json")
    args = parser.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "granite-hybrid-1p5b-random"
        write_random_checkpoint(model_dir)
        probe = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda")
        config = _sized(probe, 2, BLOCKS_PER_SEQ)
        from dataclasses import replace
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
        rows["step: Worker.execute"] = _median(wall)

        graph = runner._graphs[1]
        parts = {"runner: forward + sync": [], "host: staging": [], "host: input copy enqueue": [],
                 "host: graph.replay()": []}
        for _ in range(STEPS):
            step = steps.next()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner._staging.stage(step, 1)
            t1 = time.perf_counter()
            used = runner._staging.used_length(1)
            runner._inputs[:used].copy_(runner._host[:used], non_blocking=True)
            t2 = time.perf_counter()
            graph.replay()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            for name, value in zip(parts, (t4 - t0, t1 - t0, t2 - t1, t3 - t2)):
                parts[name].append(value)
        rows.update({name: _median(values) for name, values in parts.items()})

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name, busy in (("GPU alone (behind a sleep)", True), ("GPU from idle", False)):
            times = []
            for _ in range(STEPS):
                step = steps.next()
                torch.cuda.synchronize()
                if busy:
                    _keep_gpu_busy()
                start.record()
                runner.forward(step)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            rows[name] = _median(times)

        for cuts in ((1,), (1, 5), (1, 4, 12), (2, 8)):
            graphs, split, _ = _split_graphs(worker, cuts)
            times, gpu = [], []
            for _ in range(STEPS):
                step = steps.next()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                split._staging.stage(step, 1)
                used = split._staging.used_length(1)
                split._inputs[:used].copy_(split._host[:used], non_blocking=True)
                for g in graphs:
                    g.replay()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            for _ in range(STEPS):
                step = steps.next()
                split._staging.stage(step, 1)
                torch.cuda.synchronize()
                _keep_gpu_busy()
                start.record()
                split._inputs[:used].copy_(split._host[:used], non_blocking=True)
                for g in graphs:
                    g.replay()
                end.record()
                torch.cuda.synchronize()
                gpu.append(start.elapsed_time(end) / 1e3)
            rows[f"split before layers {cuts}: wall"] = _median(times)
            rows[f"split before layers {cuts}: GPU alone"] = _median(gpu)
            del graphs, split

    report["rows_s"] = rows
    width = max(len(n) for n in rows)
    for name, seconds in rows.items():
        print(f"{name:<{width}}  {seconds * 1e3:8.3f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
