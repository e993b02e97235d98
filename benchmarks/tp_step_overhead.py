"""Per-step overhead and decode speed at tensor_parallel_size 1, 2, 4.

    .venv/bin/python benchmarks/tp_step_overhead.py                       # CPU, tiny model
    python3 benchmarks/tp_step_overhead.py --device cuda --dtype bfloat16 \\
        --tp 1 --executors inprocess processes                           # the GPU machine (no Ray)

One LLMEngine per (executor, tp), run one after the other. Executors:

  inprocess  the Worker in this process (tp 1 only): no transport at all;
  processes  MultiprocessExecutor: one spawned process per rank, a pipe to rank 0;
  ray        WorkerGroup + RayWorkerExecutor: one Ray actor per rank in a placement group, one
             actor call to rank 0 per step (what the Serve app runs).

Workload: `--batch` requests of the same prompt decoding greedily with ignore_eos, checkpoints
off. Only steps where every request decodes one token are measured (median over them):

  step ms        engine.step() wall time
  model ms       rank 0's time inside Worker.execute (forward with its collectives, sampling)
  transport ms   executor.submit() + collect() wall minus model: Ray call or pipe, step broadcast, gathers
  engine ms      step wall minus submit() + collect(): scheduling, updating, detokenizing
  overhead ms    step - model: everything a step costs outside the model
  decode tok/s   batch / step

Every rank runs --threads-per-rank torch threads (OMP_NUM_THREADS, set before torch loads and
inherited by rank processes and Ray workers), so tp=N asks for N times the cores of tp=1; on a
machine with fewer cores than ranks the model time of tp=N includes waiting for a core.
Prints a table and writes JSON (--out, default benchmarks/results/tp_step_overhead.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

from harness import add_out_argument, markdown_table, write_result


@dataclass(frozen=True)
class Row:
    executor: str
    tp: int
    batch: int
    steps: int
    step_ms: float
    model_ms: float
    transport_ms: float
    engine_ms: float

    @property
    def overhead_ms(self) -> float:
        return self.step_ms - self.model_ms

    @property
    def decode_tok_s(self) -> float:
        return self.batch / (self.step_ms / 1000)


class TimedExecutor:
    """Wraps an executor and records the wall time of each step's submit() + collect() (the
    engine runs without async_scheduling here, so collect() follows its own submit())."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last_execute_s = 0.0
        self._submitted = 0.0

    def cache_capacity(self):
        return self.inner.cache_capacity()

    def submit(self, scheduler_output) -> None:
        self._submitted = time.perf_counter()
        self.inner.submit(scheduler_output)

    def collect(self):
        output = self.inner.collect()
        self.last_execute_s = time.perf_counter() - self._submitted
        return output

    def shutdown(self) -> None:
        self.inner.shutdown()


def make_executor(kind: str, config):
    if kind == "inprocess":
        from engine.execution.worker import Worker

        return Worker(config), None
    if kind == "processes":
        from engine.execution.multiprocess_executor import MultiprocessExecutor

        return MultiprocessExecutor(config), None
    from deployments.worker_group import RayWorkerExecutor, WorkerGroup

    group = asyncio.run(WorkerGroup.start(config, num_cpus_per_rank=0.5))
    return RayWorkerExecutor(group.ranks), group


def measure(kind: str, config, batch: int, prompt_ids: list[int], max_tokens: int) -> Row:
    from engine.interfaces.generation_request import GenerationRequest
    from engine.core.llm_engine import LLMEngine
    from engine.interfaces.sampling_params import SamplingParams

    inner, group = make_executor(kind, config)
    executor = TimedExecutor(inner)
    engine = LLMEngine(config, executor=executor)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(GenerationRequest(f"r{i}", prompt_ids, params))
        steps, models, executes = [], [], []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - started
            trace = engine.last_step
            chunks = trace.scheduler_output.chunks
            if len(chunks) == batch and all(len(c.token_ids) == 1 for c in chunks):
                steps.append(wall)
                models.append(trace.runner_output.worker_seconds)
                executes.append(executor.last_execute_s)
    finally:
        engine.shutdown()
        if group is not None:
            group.shutdown()
    steps, models, executes = steps[2:], models[2:], executes[2:]  # warm-up
    median = statistics.median
    return Row(
        executor=kind, tp=config.tensor_parallel_size, batch=batch, steps=len(steps),
        step_ms=1000 * median(steps), model_ms=1000 * median(models),
        transport_ms=1000 * median(e - m for e, m in zip(executes, models)),
        engine_ms=1000 * median(s - e for s, e in zip(steps, executes)),
    )


def table(rows: list[Row]) -> str:
    return markdown_table(
        ["executor", "tp", "batch", "step ms", "model ms", "transport ms", "engine ms", "overhead ms",
         "overhead share", "decode tok/s"],
        [[r.executor, f"{r.tp}", f"{r.batch}", f"{r.step_ms:.2f}", f"{r.model_ms:.2f}", f"{r.transport_ms:.2f}",
          f"{r.engine_ms:.2f}", f"{r.overhead_ms:.2f}", f"{r.overhead_ms / r.step_ms:.2f}", f"{r.decode_tok_s:.0f}"]
         for r in rows])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--executors", nargs="+", default=["inprocess", "processes", "ray"],
                   choices=["inprocess", "processes", "ray"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs given to ray.init")
    add_out_argument(p, "tp_step_overhead")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_rank)
    import torch

    torch.set_num_threads(args.threads_per_rank)
    from engine.engine_config import EngineConfig

    # async_scheduling off: the columns split one step's wall time, which overlapping the
    # next step's submission with this one's would blur
    config = EngineConfig(max_model_len=512, max_num_seqs=max(args.batch), checkpoint_slots=(),
                          async_scheduling=False,
                          device=args.device, dtype=args.dtype,
                          **({"model_dir": args.model_dir} if args.model_dir else {}))
    prompt_ids = [(7 * i) % 200 + 3 for i in range(args.prompt_tokens)]
    if "ray" in args.executors:
        import ray

        ray.init(address="local", num_cpus=args.ray_cpus, object_store_memory=256 * 1024 * 1024,
                 include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for kind in args.executors:
            for tp in args.tp:
                if kind == "inprocess" and tp != 1:
                    continue
                for batch in args.batch:
                    row = measure(kind, replace(config, tensor_parallel_size=tp), batch, prompt_ids,
                                  args.max_tokens)
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
    finally:
        if "ray" in args.executors:
            import ray

            ray.shutdown()
    report = table(rows)
    print(f"\nmodel {config.model_dir}, device {args.device} {args.dtype}, prompt "
          f"{args.prompt_tokens} tokens, {args.max_tokens} output tokens\n")
    print(report)
    out = write_result(args.out, "tp_step_overhead", {
        "args": vars(args),
        "rows": [{**asdict(r), "overhead_ms": r.overhead_ms, "decode_tok_s": r.decode_tok_s}
                 for r in rows],
        "table": report,
    })
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
