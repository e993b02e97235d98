"""Serving latency: time to first token and decode speed, in process vs through Ray Serve + HTTP.

    .venv/bin/python benchmarks/serve_latency.py                 # default model, CPU
    .venv/bin/python benchmarks/serve_latency.py --max-tokens 32 --concurrency 1 4

For each concurrency level the same workload runs every path from one process, in rounds: each
round runs one wave of requests on every path, one path after the other (never two at once, so
they do not compete for cores, and a slow drift of a shared machine hits all paths alike):

  in-process  AsyncLLMEngine(LLMEngine(config)) on this event loop: the engine's own cost.
  actor       the same engine stepping a Ray rank actor through RayWorkerExecutor (one actor
              call per step), as the LLM server replica does with tensor_parallel_size > 1:
              the cost of that hop alone.
  http si=N   the Serve application with stream_interval N (HTTP proxy -> ingress ->
              renderer, then the LLM server replica, which runs the step loop and, with one
              rank, the model), driven over HTTP with streamed /v1/completions; one app per
              --stream-intervals value, by default the app's default and 1.

Every request sends the same prompt token ids, decodes greedily with ignore_eos, and produces
exactly --max-tokens tokens. TTFT: request start to first token (first SSE chunk on HTTP).
Decode tok/s per request: (tokens - 1) / (last token time - first token time). Throughput: all
tokens of a level / its wall time. Overhead, for actor and http: path / in-process for TTFT,
in-process / path for decode speed and throughput; 1.0 means Ray and HTTP cost nothing. The
round trips of the hops before a first token (proxy to ingress, renderer, LLM server) are timed
on their own, with no work done.

The process that runs the model (the LLM server replica, the worker actor) runs torch with
worker_num_cpus threads; the in-process path is given the same count, so the comparison is
like for like. For every level it also records where the host's CPU went: CPU milliseconds per output token
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
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace

from harness import add_out_argument, cpu_seconds_between, process_cpu_seconds, write_result

MIN_CPU_MS_SHOWN = 0.05
HOP_CALLS = 30
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
    from engine.interfaces.generation_request import GenerationRequest
    from engine.interfaces.sampling_params import SamplingParams

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


async def time_http(client, prefix: str, model: str, prompt_ids: list[int], max_tokens: int) -> RequestTiming:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    async with client.stream("POST", f"{prefix}/v1/completions", json=body) as response:
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


@dataclass(frozen=True)
class ServingPath:
    """One way to serve the workload: its name and a coroutine function that runs one request
    of max_tokens output tokens and times it."""

    name: str
    one_request: Callable[[int], Awaitable[RequestTiming]]


async def run_levels(paths: list[ServingPath], levels: list[int], rounds: int,
                     max_tokens: int) -> list[LevelResult]:
    """Per concurrency level, `rounds` rounds; in each round every path runs one wave of
    `concurrency` simultaneous requests, one path after the other (never two at once), so a
    slow drift of a shared machine hits every path alike. Each path's waves are timed and the
    CPU every process spent during them is added up."""
    results = []
    for concurrency in levels:
        timings: dict[str, list[RequestTiming]] = {path.name: [] for path in paths}
        wall_s = dict.fromkeys(timings, 0.0)
        cpu_s: dict[str, dict[str, float]] = {name: {} for name in timings}
        for _ in range(rounds):
            for path in paths:
                cpu_before, start = process_cpu_seconds(), time.perf_counter()
                timings[path.name] += await asyncio.gather(
                    *(path.one_request(max_tokens) for _ in range(concurrency)))
                wall_s[path.name] += time.perf_counter() - start
                for role, seconds in cpu_seconds_between(cpu_before, process_cpu_seconds()).items():
                    cpu_s[path.name][role] = cpu_s[path.name].get(role, 0.0) + seconds
        results += [summarize(path.name, concurrency, timings[path.name], wall_s[path.name],
                              cpu_s[path.name]) for path in paths]
    return results


async def median_ms(call: Callable[[], Awaitable[object]], times: int = HOP_CALLS) -> float:
    """Median wall milliseconds of `times` sequential awaits of call()."""
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


async def measure_hops(client, app: str, prefix: str) -> dict[str, float]:
    """Round trips of the serving hops a request crosses before its first token, each doing
    (almost) no work: HTTP proxy -> ingress (GET /v1/models), a handle call to the renderer
    (tokenize_prompt of three ids, which pass through) and to the LLM server (model_info)."""
    from ray import serve

    renderer = serve.get_deployment_handle("Renderer", app_name=app)
    llm_server = serve.get_deployment_handle("LLMServer", app_name=app)

    async def models():
        (await client.get(f"{prefix}/v1/models")).raise_for_status()

    return {
        "http proxy -> ingress": await median_ms(models),
        "handle -> renderer": await median_ms(lambda: renderer.tokenize_prompt.remote([5, 6, 7])),
        "handle -> LLM server": await median_ms(lambda: llm_server.model_info.remote()),
    }


async def measure(config, prompt_ids: list[int], args) -> tuple[list[LevelResult], dict[str, float]]:
    """Start the in-process engine and the actor path's engine beside the running Serve apps
    (one per stream interval, `http_apps`), warm every path up, time the hops, then run every
    level (run_levels); shut the engines down."""
    import httpx

    from deployments.worker_group import RayWorkerExecutor, WorkerGroup
    from engine.core.async_engine import AsyncLLMEngine
    from engine.core.llm_engine import LLMEngine

    in_process = AsyncLLMEngine(LLMEngine(config.engine))
    group = await WorkerGroup.start(config.engine, config.worker_num_cpus)
    actor = AsyncLLMEngine(LLMEngine(config.engine, executor=RayWorkerExecutor(group.ranks)))
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=600,
                                     limits=limits) as client:
            paths = [
                ServingPath("in-process", lambda n: time_in_process(in_process, prompt_ids, n)),
                ServingPath("actor", lambda n: time_in_process(actor, prompt_ids, n)),
            ]
            for interval in args.stream_intervals:
                prefix = f"/si{interval}"
                paths.append(ServingPath(
                    f"http si={interval}",
                    lambda n, prefix=prefix: time_http(client, prefix, config.served_model_name,
                                                       prompt_ids, n)))
            for path in paths:
                await path.one_request(4)  # warm-up
            first = args.stream_intervals[0]
            hops = await measure_hops(client, f"serve-latency-si{first}", f"/si{first}")
            return await run_levels(paths, args.concurrency, args.rounds, args.max_tokens), hops
    finally:
        in_process.shutdown()
        actor.shutdown()
        group.shutdown()


# ----- report


def overheads(results: list[LevelResult]) -> list[dict]:
    """Cost of every path relative to in-process at the same level (1.0 = no cost; TTFT also
    as milliseconds above in-process)."""
    base = {r.concurrency: r for r in results if r.path == "in-process"}
    return [
        {"concurrency": r.concurrency, "path": r.path,
         "ttft_ratio": r.ttft_ms_mean / base[r.concurrency].ttft_ms_mean,
         "ttft_ms_above": r.ttft_ms_mean - base[r.concurrency].ttft_ms_mean,
         "decode_ratio": base[r.concurrency].decode_tok_s_mean / r.decode_tok_s_mean,
         "throughput_ratio": base[r.concurrency].throughput_tok_s / r.throughput_tok_s}
        for r in results if r.path != "in-process"
    ]


def table(results: list[LevelResult], ratios: list[dict], hops: dict[str, float]) -> str:
    head = (f"{'path':<12} {'conc':>4} {'reqs':>4} {'TTFT mean ms':>12} {'p50 ms':>8} {'max ms':>8} "
            f"{'decode tok/s/req':>16} {'total tok/s':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.path:<12} {r.concurrency:>4} {r.num_requests:>4} {r.ttft_ms_mean:>12.1f} "
                     f"{r.ttft_ms_p50:>8.1f} {r.ttft_ms_max:>8.1f} {r.decode_tok_s_mean:>16.1f} "
                     f"{r.throughput_tok_s:>11.1f}")
    lines += ["", "CPU ms per output token, by process role (every process of the host; "
              f"roles under {MIN_CPU_MS_SHOWN} ms summed as 'other')"]
    for r in results:
        shown = {role: ms for role, ms in r.cpu_ms_per_token.items() if ms >= MIN_CPU_MS_SHOWN}
        other = sum(r.cpu_ms_per_token.values()) - sum(shown.values())
        parts = [f"{role} {ms:.2f}" for role, ms in sorted(shown.items(), key=lambda kv: -kv[1])]
        lines.append(f"  {r.path:<12} {r.concurrency:>2}: total {sum(r.cpu_ms_per_token.values()):.2f}"
                     f" = {', '.join(parts)}, other {other:.2f}")
    lines += ["", "Overhead vs in-process (1.0 = free): TTFT path/in-process; decode speed and "
              "throughput in-process/path"]
    for o in ratios:
        lines.append(f"  {o['path']:<10} concurrency {o['concurrency']:>2}: TTFT x{o['ttft_ratio']:.2f}"
                     f" ({o['ttft_ms_above']:+.1f} ms)   decode x{o['decode_ratio']:.2f}"
                     f" ({100 / o['decode_ratio']:.0f}% of in-process)"
                     f"   throughput x{o['throughput_ratio']:.2f}")
    lines += ["", f"Hop round trips before the first token (median of {HOP_CALLS}, no work done):"]
    lines += [f"  {hop:<22} {ms:6.2f} ms" for hop, ms in hops.items()]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="default: the embedded tiny model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-repeats", type=int, default=2, help="copies of the sample sentence")
    p.add_argument("--rounds", type=int, default=3, help="waves of requests per level and path")
    p.add_argument("--worker-num-cpus", type=float, default=1.0)
    p.add_argument("--stream-intervals", type=int, nargs="+", default=None,
                   help="one http path per AppConfig.stream_interval "
                        "(default: the app's default, then 1)")
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs given to ray.init")
    p.add_argument("--port", type=int, default=8000)
    add_out_argument(p, "serve_latency")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from deployments.config import AppConfig
    from engine.engine_config import EngineConfig

    # Every request sends the same prompt: with checkpoints on, all but the first would restore
    # it and skip prefill, so this benchmark (the cost of the serving path) turns them off;
    # benchmarks/checkpoint_reuse.py measures what checkpoints save.
    engine = EngineConfig(max_model_len=1024, max_num_seqs=max(16, max(args.concurrency)),
                          max_num_batched_tokens=512, checkpoint_slots=())
    if args.model_dir:
        engine = replace(engine, model_dir=args.model_dir)
    config = AppConfig(engine=engine, worker_num_cpus=args.worker_num_cpus)
    if args.stream_intervals is None:
        args.stream_intervals = list(dict.fromkeys([config.stream_interval, 1]))
    tokenizer = AutoTokenizer.from_pretrained(config.engine.model_dir)
    prompt_ids = tokenizer.encode(PROMPT * args.prompt_repeats, add_special_tokens=False)

    import ray
    import torch
    from ray import serve

    from deployments.app import build_app

    torch.set_num_threads(max(1, int(args.worker_num_cpus)))  # as many as the model's process
    ray.init(address="local", num_cpus=args.ray_cpus, object_store_memory=256 * 1024 * 1024,
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for interval in args.stream_intervals:
            app_config = config.model_copy(update={"stream_interval": interval})
            serve.run(build_app(app_config.model_dump()), name=f"serve-latency-si{interval}",
                      route_prefix=f"/si{interval}")
        results, hops = asyncio.run(measure(config, prompt_ids, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    ratios = overheads(results)
    report = table(results, ratios, hops)
    print(f"\nmodel {config.engine.model_dir}, prompt {len(prompt_ids)} tokens, {args.max_tokens} output "
          f"tokens, {args.rounds} rounds per level, worker threads {int(args.worker_num_cpus)}; "
          f"'http si=N': the app with stream_interval N\n")
    print(report)

    out = write_result(args.out, "serve_latency", {
        "args": vars(args),
        "app_config": config.model_dump(),
        "prompt_tokens": len(prompt_ids),
        "results": [asdict(r) for r in results],
        "overhead": ratios,
        "hops_ms": hops,
        "table": report,
    })
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
