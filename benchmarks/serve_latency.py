"""Serving latency: time to first token and decode speed, in process vs through Ray Serve + HTTP.

    .venv/bin/python benchmarks/serve_latency.py                 # default model, CPU
    .venv/bin/python benchmarks/serve_latency.py --max-tokens 32 --concurrency 1 4

For each concurrency level the same workload runs three ways in one process, one path after the
other (never two at once, so they do not compete for cores):

  in-process  AsyncLLMEngine(LLMEngine(config)) on this event loop: the engine's own cost.
  actor       the same engine stepping a Ray rank actor through RayWorkerExecutor (one actor
              call per step), as the LLM server replica does: the cost of that hop alone.
  http        the Serve application (HTTP proxy -> ingress -> renderer, then LLM server replica
              with the step loop -> worker actor), driven over HTTP with streamed
              /v1/completions.

Every request sends the same prompt token ids, decodes greedily with ignore_eos, and produces
exactly --max-tokens tokens. TTFT: request start to first token (first SSE chunk on HTTP).
Decode tok/s per request: (tokens - 1) / (last token time - first token time). Throughput: all
tokens of a level / its wall time. Overhead, for actor and http: path / in-process for TTFT,
in-process / path for decode speed and throughput; 1.0 means Ray and HTTP cost nothing.

The worker actor runs torch with as many threads as its Ray CPUs (Ray sets OMP_NUM_THREADS);
the in-process path is given the same thread count so the comparison is like for like.
For every level it also records where the host's CPU went: CPU milliseconds per output token
of each process role (the Ray worker processes by actor class, raylet, the benchmark's own
python process, which is the engine on the in-process and actor paths and the HTTP client on
the http path). On a 2-core machine that is the cost the serving path adds to every token.
Prints a table and writes JSON (--out, default benchmarks/results/serve_latency.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, replace

from harness import add_out_argument, cpu_seconds_between, process_cpu_seconds, write_result

MIN_CPU_MS_SHOWN = 0.05
PROMPT = "The quick brown fox jumps over the lazy dog while hybrid models keep a recurrent state. "


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    last_token_s: float
    num_tokens: int

    @property
    def decode_tok_s(self) -> float:
        span = self.last_token_s - self.ttft_s
        return (self.num_tokens - 1) / span if self.num_tokens > 1 and span > 0 else float("nan")


@dataclass(frozen=True)
class LevelResult:
    path: str
    concurrency: int
    num_requests: int
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_max: float
    decode_tok_s_mean: float
    throughput_tok_s: float
    # CPU milliseconds each process role spent per output token during the level (harness.
    # process_cpu_seconds: every process of the host, the benchmark's own included)
    cpu_ms_per_token: dict[str, float]


def summarize(path: str, concurrency: int, timings: list[RequestTiming], wall_s: float,
              cpu_s: dict[str, float]) -> LevelResult:
    ttfts = [t.ttft_s * 1000 for t in timings]
    num_tokens = sum(t.num_tokens for t in timings)
    return LevelResult(
        path=path,
        concurrency=concurrency,
        num_requests=len(timings),
        ttft_ms_mean=statistics.fmean(ttfts),
        ttft_ms_p50=statistics.median(ttfts),
        ttft_ms_max=max(ttfts),
        decode_tok_s_mean=statistics.fmean(t.decode_tok_s for t in timings),
        throughput_tok_s=num_tokens / wall_s,
        cpu_ms_per_token={role: 1000 * seconds / num_tokens for role, seconds in cpu_s.items()},
    )


# ----- the two paths: each returns one RequestTiming per request


async def time_in_process(engine, prompt_ids: list[int], max_tokens: int) -> RequestTiming:
    from engine.generation_request import GenerationRequest
    from engine.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    async for out in engine.generate(GenerationRequest(uuid.uuid4().hex, prompt_ids, sampling)):
        now = time.perf_counter() - start
        first = now if first is None else first
        last = now
        num_tokens = out.num_output_tokens
    return RequestTiming(first, last, num_tokens)


async def time_http(client, model: str, prompt_ids: list[int], max_tokens: int) -> RequestTiming:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"]:
                now = time.perf_counter() - start
                first = now if first is None else first
                last = now
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    return RequestTiming(first, last, num_tokens)


async def run_level(path: str, one_request, concurrency: int, rounds: int) -> LevelResult:
    """`rounds` waves of `concurrency` simultaneous requests, timed, with the CPU every process
    spent meanwhile."""
    timings: list[RequestTiming] = []
    cpu_before = process_cpu_seconds()
    start = time.perf_counter()
    for _ in range(rounds):
        timings += await asyncio.gather(*(one_request() for _ in range(concurrency)))
    wall_s = time.perf_counter() - start
    cpu_s = cpu_seconds_between(cpu_before, process_cpu_seconds())
    return summarize(path, concurrency, timings, wall_s, cpu_s)


def bench_engine(label: str, engine, prompt_ids, args) -> list[LevelResult]:
    """Drive an AsyncLLMEngine on this event loop at every concurrency level; shut it down."""

    async def main() -> list[LevelResult]:
        results = []
        await time_in_process(engine, prompt_ids, 4)  # warm-up
        for c in args.concurrency:
            results.append(await run_level(
                label, lambda: time_in_process(engine, prompt_ids, args.max_tokens), c, args.rounds))
        return results

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def bench_in_process(config, prompt_ids, args) -> list[LevelResult]:
    import torch

    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(max(1, int(args.worker_num_cpus)))
    engine = AsyncLLMEngine(LLMEngine(config.engine))
    return bench_engine("in-process", engine, prompt_ids, args)


def bench_worker_actor(config, prompt_ids, args) -> list[LevelResult]:
    """The in-process engine stepping a worker actor: isolates the per-step actor call."""
    from deployments.worker_group import RayWorkerExecutor, WorkerGroup
    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLMEngine

    group = asyncio.run(WorkerGroup.start(config.engine, config.worker_num_cpus))
    try:
        engine = AsyncLLMEngine(LLMEngine(config.engine, executor=RayWorkerExecutor(group.ranks)))
        return bench_engine("actor", engine, prompt_ids, args)
    finally:
        group.shutdown()


def bench_http(config, prompt_ids, args) -> list[LevelResult]:
    import httpx
    from ray import serve

    from deployments.app import build_app

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(config.model_dump()), name="serve-latency", route_prefix="/")

        async def main() -> list[LevelResult]:
            limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=600,
                                         limits=limits) as client:
                model = config.served_model_name
                await time_http(client, model, prompt_ids, 4)  # warm-up
                results = []
                for c in args.concurrency:
                    results.append(await run_level(
                        "http", lambda: time_http(client, model, prompt_ids, args.max_tokens), c,
                        args.rounds))
                return results

        return asyncio.run(main())
    finally:
        serve.shutdown()


# ----- report


def overheads(base: list[LevelResult], other: list[LevelResult]) -> list[dict]:
    """Cost of `other` relative to `base`, per level (1.0 = no cost)."""
    return [
        {"concurrency": a.concurrency, "path": b.path,
         "ttft_ratio": b.ttft_ms_mean / a.ttft_ms_mean,
         "decode_ratio": a.decode_tok_s_mean / b.decode_tok_s_mean,
         "throughput_ratio": a.throughput_tok_s / b.throughput_tok_s}
        for a, b in zip(base, other)
    ]


def table(results: list[LevelResult], ratios: list[dict]) -> str:
    head = (f"{'path':<11} {'conc':>4} {'reqs':>4} {'TTFT mean ms':>12} {'p50 ms':>8} {'max ms':>8} "
            f"{'decode tok/s/req':>16} {'total tok/s':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.path:<11} {r.concurrency:>4} {r.num_requests:>4} {r.ttft_ms_mean:>12.1f} "
                     f"{r.ttft_ms_p50:>8.1f} {r.ttft_ms_max:>8.1f} {r.decode_tok_s_mean:>16.1f} "
                     f"{r.throughput_tok_s:>11.1f}")
    lines += ["", "CPU ms per output token, by process role (every process of the host; "
              f"roles under {MIN_CPU_MS_SHOWN} ms summed as 'other')"]
    for r in results:
        shown = {role: ms for role, ms in r.cpu_ms_per_token.items() if ms >= MIN_CPU_MS_SHOWN}
        other = sum(r.cpu_ms_per_token.values()) - sum(shown.values())
        parts = [f"{role} {ms:.2f}" for role, ms in sorted(shown.items(), key=lambda kv: -kv[1])]
        lines.append(f"  {r.path:<11} {r.concurrency:>2}: total {sum(r.cpu_ms_per_token.values()):.2f}"
                     f" = {', '.join(parts)}, other {other:.2f}")
    lines += ["", "Overhead vs in-process (1.0 = free): TTFT path/in-process; decode speed and "
              "throughput in-process/path"]
    for o in ratios:
        lines.append(f"  {o['path']:<6} concurrency {o['concurrency']:>2}: TTFT x{o['ttft_ratio']:.2f}"
                     f"   decode x{o['decode_ratio']:.2f}   throughput x{o['throughput_ratio']:.2f}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="default: the embedded tiny model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-repeats", type=int, default=2, help="copies of the sample sentence")
    p.add_argument("--rounds", type=int, default=2, help="waves of requests per level")
    p.add_argument("--worker-num-cpus", type=float, default=1.0)
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs given to ray.init")
    p.add_argument("--port", type=int, default=8000)
    add_out_argument(p, "serve_latency")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from deployments.config import AppConfig
    from engine.config import EngineConfig

    # Every request sends the same prompt: with checkpoints on, all but the first would restore
    # it and skip prefill, so this benchmark (the cost of the serving path) turns them off;
    # benchmarks/checkpoint_reuse.py measures what checkpoints save.
    engine = EngineConfig(max_model_len=1024, max_num_seqs=max(16, max(args.concurrency)),
                          max_num_batched_tokens=512, checkpoint_slots=())
    if args.model_dir:
        engine = replace(engine, model_dir=args.model_dir)
    config = AppConfig(engine=engine, worker_num_cpus=args.worker_num_cpus)
    tokenizer = AutoTokenizer.from_pretrained(config.engine.model_dir)
    prompt_ids = tokenizer.encode(PROMPT * args.prompt_repeats, add_special_tokens=False)

    import ray

    in_process = bench_in_process(config, prompt_ids, args)
    ray.init(num_cpus=args.ray_cpus, object_store_memory=256 * 1024 * 1024,
             include_dashboard=False, log_to_driver=False)
    try:
        actor = bench_worker_actor(config, prompt_ids, args)
        http = bench_http(config, prompt_ids, args)
    finally:
        ray.shutdown()
    ratios = overheads(in_process, actor) + overheads(in_process, http)
    report = table(in_process + actor + http, ratios)
    print(f"\nmodel {config.engine.model_dir}, prompt {len(prompt_ids)} tokens, {args.max_tokens} output "
          f"tokens, {args.rounds} rounds per level, worker threads {int(args.worker_num_cpus)}\n")
    print(report)

    out = write_result(args.out, "serve_latency", {
        "args": vars(args),
        "app_config": config.model_dump(),
        "prompt_tokens": len(prompt_ids),
        "results": [asdict(r) for r in in_process + actor + http],
        "overhead": ratios,
        "table": report,
    })
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
