"""Serving latency: time to first token and decode speed, in process against Ray Serve over HTTP
on the classic path and on the lean path, in one run.

    .venv/bin/python benchmarks/serve_latency.py                       # ids workload
    .venv/bin/python benchmarks/serve_latency.py --workload chat \
        --out benchmarks/results/serve_latency_chat.json               # where rendering runs
    .venv/bin/python benchmarks/serve_latency.py --max-tokens 32 --concurrency 1 4

The same workload runs every path from one process, in three windows: first the classic window
(in-process, actor and the classic apps, in this process's Ray), then, that Ray shut down, one
window per lean app (in-process and that app alone, behind a serve_main Ray of its own, as
`make serve` runs one app), so that no path pays for another path's idle cluster on the same
cores. Within a window, for each concurrency level, in rounds: each round runs one wave of
requests on every path, one path after the other in a random order (never two at once, so
they do not compete for cores, a slow drift of a shared machine hits all paths alike, and no
path always inherits the work another leaves behind); a level has at least --min-requests
requests per path. Overheads are against the in-process path of the same window:

  in-process       AsyncLLMEngine(LLMEngine(config)) on this event loop: the engine's own
                   cost (with --workload chat, the PromptRenderer's rendering too). This
                   process switches threads at the LLM server replica's interval
                   (GIL_SWITCH_INTERVAL_S, deployments/llm_server.py): at Python's default
                   5 ms the event loop waits longer for the first token the step thread hands
                   it, which put the in-process time to first token about 1.4 ms above the
                   replica's own engine (timestamps on the 2-core VM).
  actor            the same engine stepping a Ray rank actor through RayWorkerExecutor (one
                   actor call per step), as the LLM server replica does with
                   tensor_parallel_size > 1: the cost of that hop alone (--no-actor: left out).
  classic si=N     the classic path (the fallback where HAProxy cannot run): Serve's HTTP proxy
                   -> ingress -> renderer, then the LLM server replica, which runs the step
                   loop and, with one rank, the model; one app per --stream-intervals value, in
                   this process's Ray (started without the lean path's switches).
  lean             the lean path, started as `make serve` starts it (deployments/serve_main.py
                   in a child process: its own Ray with HAProxy, benchmarks/lean_cluster.py):
                   HAProxy -> the LLM server replica, which serves HTTP, renders and generates.
  lean renderer    the lean path with render_in_replica false, in its own window: the replica
                   renders through the Renderer deployment (a handle call on the gRPC data
                   plane) before it generates.

Workloads: ids (default) sends the same prompt token ids to /v1/completions, so rendering is a
pass-through; chat sends a short chat (a system message and a user message) to
/v1/chat/completions, rendered with the chat template and its instruction boundary. Every
request decodes greedily with ignore_eos and produces exactly --max-tokens tokens. TTFT: request
start to first token (first SSE chunk on HTTP). Decode tok/s per request: the tokens after each
request's first over the summed time from its first token to its last (decode_tok_s).
Throughput: all tokens of a level / its wall time. Overhead: path / in-process for TTFT, in-process / path for decode speed and throughput; 1.0 means Ray
and HTTP cost nothing. The round trips before a first token are timed on their own, with no
work done: the classic path's hops (proxy to ingress, handle calls to the renderer and the LLM
server) and the lean path's one (HAProxy to the replica); with --workload chat, also the chat's
rendering in process. The load average at the start and the end goes into the JSON: on a shared
machine it says how far to trust a run (the TTFT medians above in process are the steadier
figure).

Every app has the same AppConfig except the path's keys (checkpoints off: every request sends
the same prompt). The process that runs the model (an LLM server replica, the worker actor)
runs torch with worker_num_cpus threads, and so does the in-process path. For every level it
also records where the host's CPU went: CPU milliseconds per output token of each process role
(harness.process_cpu_seconds; every process of the host, other users' included on a shared
machine). Prints a table and writes JSON (--out, default benchmarks/results/serve_latency.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from harness import add_out_argument, cpu_seconds_between, process_cpu_seconds, write_result
from lean_cluster import serve_main_server

MIN_CPU_MS_SHOWN = 0.05
HOP_CALLS = 30
SETTLE_S = 0.05  # pause before each wave (run_levels)
PROMPT = "The quick brown fox jumps over the lazy dog while hybrid models keep a recurrent state. "
CHAT_USER = "Tell me about the fox and the dog, briefly."
LEAN_APPS = {"lean": "/lean", "lean renderer": "/lean-renderer"}  # path name -> route prefix


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    last_token_s: float
    num_tokens: int


@dataclass(frozen=True)
class LevelResult:
    window: str  # the servers beside the path: "classic", a lean app's name (the module docstring), "gpu"
    path: str
    concurrency: int
    num_requests: int
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_max: float
    decode_tok_s: float  # decode_tok_s() of the level's requests
    throughput_tok_s: float
    # CPU milliseconds each process role spent per output token during the level (harness.
    # process_cpu_seconds: every process of the host, the benchmark's own included)
    cpu_ms_per_token: dict[str, float]


def decode_tok_s(timings: list[RequestTiming]) -> float:
    """One stream's decode speed over a level: every request's tokens after its first over the
    summed time from its first token to its last. A request whose first token came late and
    the rest in one burst adds little time and few tokens here; a mean of per-request rates
    would take its burst for thousands of tokens a second."""
    spans = [(t.num_tokens - 1, t.last_token_s - t.ttft_s) for t in timings if t.num_tokens > 1]
    seconds = sum(span for _, span in spans)
    return sum(tokens for tokens, _ in spans) / seconds if seconds > 0 else float("nan")


def summarize(window: str, path: str, concurrency: int, timings: list[RequestTiming],
              wall_s: float, cpu_s: dict[str, float]) -> LevelResult:
    ttfts = [t.ttft_s * 1000 for t in timings]
    num_tokens = sum(t.num_tokens for t in timings)
    return LevelResult(
        window=window,
        path=path,
        concurrency=concurrency,
        num_requests=len(timings),
        ttft_ms_mean=statistics.fmean(ttfts),
        ttft_ms_p50=statistics.median(ttfts),
        ttft_ms_max=max(ttfts),
        decode_tok_s=decode_tok_s(timings),
        throughput_tok_s=num_tokens / wall_s,
        cpu_ms_per_token={role: 1000 * seconds / num_tokens for role, seconds in cpu_s.items()},
    )


# ----- the two paths: each returns one RequestTiming per request


async def time_in_process(engine, prompt_ids: list[int], max_tokens: int,
                          render=None) -> RequestTiming:
    """One request on an AsyncLLMEngine; with `render` (a callable returning a RenderedPrompt),
    the prompt is rendered first, inside the timed span, as the replica renders a chat."""
    from engine.interfaces.generation_request import GenerationRequest
    from engine.interfaces.sampling_params import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    boundary = None
    if render is not None:
        rendered = render()
        prompt_ids, boundary = list(rendered.token_ids), rendered.instruction_boundary
    first = last = None
    num_tokens = 0
    request = GenerationRequest(uuid.uuid4().hex, prompt_ids, sampling, instruction_boundary=boundary)
    async for out in engine.generate(request):
        now = time.perf_counter() - start
        first = now if first is None else first
        last = now
        num_tokens = out.num_output_tokens
    return RequestTiming(first, last, num_tokens)


def request_body(workload: str, model: str, prompt_ids: list[int], max_tokens: int) -> tuple[str, dict]:
    """(route, body) of one streamed request of the workload."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if workload == "chat":
        return "/v1/chat/completions", {**body, "messages": chat_messages()}
    return "/v1/completions", {**body, "prompt": prompt_ids}


def chat_messages() -> list[dict]:
    return [{"role": "system", "content": PROMPT}, {"role": "user", "content": CHAT_USER}]


def http_session(max_connections: int):
    """The benchmark's HTTP client, an aiohttp session (close it: `async with`). aiohttp, as
    vLLM's serving benchmark uses: with httpx the client's own Python added 1.5 to 2 ms to each
    streamed request's time to first token on the 2-core VM (paired probes), which is the
    client's cost, not the server's."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def time_http(session, prefix: str, route: str, body: dict) -> RequestTiming:
    """One streamed request over HTTP (session: http_session): the times from the POST to the
    first and to the last SSE chunk with choices, and the completion tokens of the usage chunk."""
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    async with session.post(f"{prefix}{route}", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one SSE line at a time
            line = raw.decode().rstrip("\r\n")
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


def rounds_for(concurrency: int, rounds: int, min_requests: int) -> int:
    """Rounds of a level: `rounds`, or more where a level's waves are small, so that every
    path times at least `min_requests` requests (a median of a handful is noise)."""
    return max(rounds, -(-min_requests // concurrency))


async def run_levels(window: str, paths: list[ServingPath], levels: list[int], rounds: int,
                     max_tokens: int, min_requests: int = 0,
                     seed: int = 0) -> list[LevelResult]:
    """Per concurrency level, rounds_for(...) rounds; in each round every path runs one wave of
    `concurrency` simultaneous requests, one path after the other (never two at once), so a
    slow drift of a shared machine hits every path alike. The paths run in a new random order
    each round (seeded), after a pause of SETTLE_S: the work a path leaves behind when its last
    token is out (a replica's logs and metrics, an engine's last step) would otherwise always
    land on the same next path. Each path's waves are timed and the CPU every process spent
    during them is added up."""
    order = random.Random(seed)
    results = []
    for concurrency in levels:
        timings: dict[str, list[RequestTiming]] = {path.name: [] for path in paths}
        wall_s = dict.fromkeys(timings, 0.0)
        cpu_s: dict[str, dict[str, float]] = {name: {} for name in timings}
        for _ in range(rounds_for(concurrency, rounds, min_requests)):
            for path in order.sample(paths, len(paths)):
                await asyncio.sleep(SETTLE_S)
                cpu_before, start = process_cpu_seconds(), time.perf_counter()
                timings[path.name] += await asyncio.gather(
                    *(path.one_request(max_tokens) for _ in range(concurrency)))
                wall_s[path.name] += time.perf_counter() - start
                for role, seconds in cpu_seconds_between(cpu_before, process_cpu_seconds()).items():
                    cpu_s[path.name][role] = cpu_s[path.name].get(role, 0.0) + seconds
        results += [summarize(window, path.name, concurrency, timings[path.name],
                              wall_s[path.name], cpu_s[path.name]) for path in paths]
    return results


async def median_ms(call: Callable[[], Awaitable[object]], times: int = HOP_CALLS) -> float:
    """Median wall milliseconds of `times` sequential awaits of call()."""
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


async def measure_hops(session, window: str, args) -> dict[str, float]:
    """Round trips of the serving hops a request crosses before its first token, each doing
    (almost) no work. Classic: HTTP proxy -> ingress (GET /v1/models), a handle call to the
    renderer (tokenize_prompt of three ids, which pass through) and to the LLM server
    (model_info). Lean: HAProxy -> LLM server replica (GET /v1/models)."""
    async def get(url: str):
        async with session.get(url) as response:
            response.raise_for_status()
            await response.read()

    if window in LEAN_APPS:
        return {f"{window}: HAProxy -> LLM server": await median_ms(
            lambda: get(f"http://127.0.0.1:{args.lean_port}{LEAN_APPS[window]}/v1/models"))}
    from ray import serve

    first = args.stream_intervals[0]
    app, prefix = f"serve-latency-si{first}", f"/si{first}"
    renderer = serve.get_deployment_handle("Renderer", app_name=app)
    llm_server = serve.get_deployment_handle("LLMServer", app_name=app)
    return {
        "classic: http proxy -> ingress": await median_ms(
            lambda: get(f"http://127.0.0.1:{args.port}{prefix}/v1/models")),
        "classic: handle -> renderer": await median_ms(lambda: renderer.tokenize_prompt.remote([5, 6, 7])),
        "classic: handle -> LLM server": await median_ms(lambda: llm_server.model_info.remote()),
    }


async def measure(window: str, config, prompt_ids: list[int],
                  args) -> tuple[list[LevelResult], dict[str, float]]:
    """One window, "classic" or a lean app's name (the module docstring): start the in-process
    engine (and in the classic window the actor path's engine) beside the window's running
    servers, warm every path up, time the hops, then run every level (run_levels); shut the
    engines down."""
    from deployments.prompts.rendering import PromptRenderer
    from deployments.worker_group import RayWorkerExecutor, WorkerGroup
    from engine.core.async_engine import AsyncLLMEngine
    from engine.core.llm_engine import LLMEngine

    in_process = AsyncLLMEngine(LLMEngine(config.engine))
    render = None
    if args.workload == "chat":
        renderer = PromptRenderer.from_pretrained(config.engine.model_dir)
        render = lambda: renderer.render_chat(chat_messages())  # noqa: E731
    group = actor = None
    if window == "classic" and args.actor:
        group = await WorkerGroup.start(config.engine, config.worker_num_cpus)
        actor = AsyncLLMEngine(LLMEngine(config.engine, executor=RayWorkerExecutor(group.ranks)))
    try:
        async with http_session(2 * max(args.concurrency) + 4) as session:
            def http_path(name: str, url_prefix: str) -> ServingPath:
                def one(n: int) -> Awaitable[RequestTiming]:
                    route, body = request_body(args.workload, config.served_model_name, prompt_ids, n)
                    return time_http(session, url_prefix, route, body)
                return ServingPath(name, one)

            paths = [ServingPath("in-process",
                                 lambda n: time_in_process(in_process, prompt_ids, n, render))]
            if actor is not None:
                paths.append(ServingPath("actor",
                                         lambda n: time_in_process(actor, prompt_ids, n, render)))
            if window == "classic":
                paths += [http_path(f"classic si={i}", f"http://127.0.0.1:{args.port}/si{i}")
                          for i in args.stream_intervals]
            else:
                paths.append(http_path(window, f"http://127.0.0.1:{args.lean_port}{LEAN_APPS[window]}"))
            for path in paths:
                await path.one_request(4)  # warm-up
            hops = await measure_hops(session, window, args)
            if render is not None:
                async def render_once():
                    render()
                hops[f"render the chat in process (PromptRenderer), {window} window"] = \
                    await median_ms(render_once)
            return await run_levels(window, paths, args.concurrency, args.rounds, args.max_tokens,
                                    args.min_requests), hops
    finally:
        in_process.shutdown()
        if actor is not None:
            actor.shutdown()
            group.shutdown()


def match_replica_interpreter() -> None:
    """Switch this process's threads at the LLM server replica's interval, so that the
    in-process engine's step thread and event loop share the GIL as the replica's do."""
    import sys

    from deployments.llm_server import GIL_SWITCH_INTERVAL_S

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def lean_serve_config(config, lean_port: int, name: str) -> dict:
    """A Serve config file for serve_main: the lean app `name` of LEAN_APPS, alone, on
    `config`'s AppConfig."""
    prefix = LEAN_APPS[name]
    args = config.model_copy(update={"direct_ingress": True, "render_in_replica": name == "lean"})
    app = {"name": prefix.strip("/"), "route_prefix": prefix, "import_path": "deployments.app:build_app",
           "args": args.model_dump(mode="json"),
           "deployments": [{"name": "LLMServer", "num_replicas": 1}]}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": lean_port},
            "applications": [app]}


# ----- report


def overheads(results: list[LevelResult]) -> list[dict]:
    """Cost of every path relative to in-process at the same level in the same window (1.0 =
    no cost; TTFT also as milliseconds above in-process, of the means and of the medians: on a
    shared machine the median is the steadier)."""
    base = {(r.window, r.concurrency): r for r in results if r.path == "in-process"}
    ratios = []
    for r in results:
        if r.path == "in-process":
            continue
        b = base[r.window, r.concurrency]
        ratios.append({"concurrency": r.concurrency, "path": r.path, "window": r.window,
                       "ttft_ratio": r.ttft_ms_mean / b.ttft_ms_mean,
                       "ttft_ms_above": r.ttft_ms_mean - b.ttft_ms_mean,
                       "ttft_p50_ms_above": r.ttft_ms_p50 - b.ttft_ms_p50,
                       "decode_ratio": b.decode_tok_s / r.decode_tok_s,
                       "throughput_ratio": b.throughput_tok_s / r.throughput_tok_s})
    return ratios


def table(results: list[LevelResult], ratios: list[dict], hops: dict[str, float]) -> str:
    head = (f"{'window':<13} {'path':<14} {'conc':>4} {'reqs':>4} {'TTFT mean ms':>12} {'p50 ms':>8} "
            f"{'max ms':>8} {'decode tok/s/req':>16} {'total tok/s':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.window:<13} {r.path:<14} {r.concurrency:>4} {r.num_requests:>4} {r.ttft_ms_mean:>12.1f} "
                     f"{r.ttft_ms_p50:>8.1f} {r.ttft_ms_max:>8.1f} {r.decode_tok_s:>16.1f} "
                     f"{r.throughput_tok_s:>11.1f}")
    lines += ["", "CPU ms per output token, by process role (every process of the host; "
              f"roles under {MIN_CPU_MS_SHOWN} ms summed as 'other')"]
    for r in results:
        shown = {role: ms for role, ms in r.cpu_ms_per_token.items() if ms >= MIN_CPU_MS_SHOWN}
        other = sum(r.cpu_ms_per_token.values()) - sum(shown.values())
        parts = [f"{role} {ms:.2f}" for role, ms in sorted(shown.items(), key=lambda kv: -kv[1])]
        lines.append(f"  {r.window:<13} {r.path:<14} {r.concurrency:>2}: total {sum(r.cpu_ms_per_token.values()):.2f}"
                     f" = {', '.join(parts)}, other {other:.2f}")
    lines += ["", "Overhead vs in-process of the same window (1.0 = free): TTFT path/in-process; "
              "decode speed and throughput in-process/path"]
    for o in ratios:
        lines.append(f"  {o['path']:<14} concurrency {o['concurrency']:>2}: TTFT x{o['ttft_ratio']:.2f}"
                     f" ({o['ttft_ms_above']:+.1f} ms, p50 {o['ttft_p50_ms_above']:+.1f} ms)"
                     f"   decode x{o['decode_ratio']:.2f}"
                     f" ({100 / o['decode_ratio']:.0f}% of in-process)"
                     f"   throughput x{o['throughput_ratio']:.2f}")
    lines += ["", f"Hop round trips before the first token (median of {HOP_CALLS}, no work done):"]
    lines += [f"  {hop:<38} {ms:6.2f} ms" for hop, ms in hops.items()]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=None, help="default: the embedded tiny model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-repeats", type=int, default=2, help="copies of the sample sentence")
    p.add_argument("--rounds", type=int, default=3, help="waves of requests per level and path")
    p.add_argument("--min-requests", type=int, default=40,
                   help="more rounds where a level's waves are small: at least this many "
                        "requests per path and level")
    p.add_argument("--worker-num-cpus", type=float, default=1.0)
    p.add_argument("--stream-intervals", type=int, nargs="+", default=None,
                   help="one http path per AppConfig.stream_interval "
                        "(default: the app's default, then 1)")
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs given to ray.init")
    p.add_argument("--workload", choices=("ids", "chat"), default="ids",
                   help="ids: /v1/completions with token ids; chat: /v1/chat/completions, rendered")
    p.add_argument("--no-actor", dest="actor", action="store_false",
                   help="leave out the rank-actor path")
    p.add_argument("--port", type=int, default=8000, help="the classic apps' Serve HTTP port")
    p.add_argument("--lean-port", type=int, default=8010, help="the lean server's HTTP port")
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
    if args.workload == "chat":  # what the chat renders to (the ids workload's ids are unused)
        prompt_tokens = len(tokenizer.apply_chat_template(chat_messages(), add_generation_prompt=True,
                                                          tokenize=True, return_dict=False))
    else:
        prompt_tokens = len(prompt_ids)

    import ray
    import torch
    from ray import serve

    from deployments.app import build_app

    torch.set_num_threads(max(1, int(args.worker_num_cpus)))  # as many as the model's process
    match_replica_interpreter()
    load_at_start = os.getloadavg()  # a shared machine's other work shows here
    log_dir = Path(tempfile.mkdtemp(prefix="serve-latency-"))
    # the classic window: this process's Ray (started without the lean path's switches)
    ray.init(address="local", num_cpus=args.ray_cpus, object_store_memory=256 * 1024 * 1024,
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        for interval in args.stream_intervals:
            app_config = config.model_copy(update={"stream_interval": interval,
                                                   "direct_ingress": False})
            serve.run(build_app(app_config.model_dump()), name=f"serve-latency-si{interval}",
                      route_prefix=f"/si{interval}")
        results, hops = asyncio.run(measure("classic", config, prompt_ids, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    # a window per lean app: serve_main in a child process, its own Ray with HAProxy
    lean_log = []
    for name, prefix in LEAN_APPS.items():
        log = log_dir / f"{prefix.strip('/')}.log"
        with serve_main_server(lean_serve_config(config, args.lean_port, name), log) as lean:
            lean_results, lean_hops = asyncio.run(measure(name, config, prompt_ids, args))
        results += lean_results
        hops.update(lean_hops)
        lean_log += [line for line in log.read_text().splitlines() if "serving path" in line]
        if lean.returncode not in (0, None):
            print(f"warning: the {name} server exited with {lean.returncode}")
    ratios = overheads(results)
    report = table(results, ratios, hops)
    print(f"\nload average {load_at_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"(this machine's {os.cpu_count()} cores)")
    print(f"model {config.engine.model_dir}, prompt {prompt_tokens} tokens, {args.max_tokens} output "
          f"tokens, {args.rounds} rounds per level (at least {args.min_requests} requests), worker threads {int(args.worker_num_cpus)}; "
          f"workload {args.workload}; 'classic si=N': the classic app with stream_interval N; "
          f"the lean apps stream_interval {config.stream_interval}\n")
    print(report)

    out = write_result(args.out, "serve_latency", {
        "args": vars(args),
        "app_config": config.model_dump(),
        "lean_serve_configs": [lean_serve_config(config, args.lean_port, name) for name in LEAN_APPS],
        "lean_server_log": lean_log,
        "prompt_tokens": prompt_tokens,
        "results": [asdict(r) for r in results],
        "overhead": ratios,
        "hops_ms": hops,
        "load_average_1_5_15_min": {"start": load_at_start, "end": os.getloadavg()},
        "table": report,
    })
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
