"""Time to first token over HTTP on the lean path for long shared-instruction chats at growing
concurrency, and for a short chat one at a time, with the replica's own render time.

    .venv/bin/python benchmarks/render_http.py                          # CPU, about 3 minutes
    .venv/bin/python benchmarks/render_http.py --levels 1 32 64 --out /tmp/r.json
    .venv/bin/python benchmarks/render_http.py --against /path/to/other/checkout   # A/B

The server is started as `make serve` starts it (deployments/serve_main.py in a child process,
benchmarks/lean_cluster.py): HAProxy -> one LLM server replica that renders, in process, and
generates. The long workload is hybrid-serve-bench's shared-instructions (2 systems of
--instruction-tokens tokens, user messages of 50-500 tokens; the embedded model's tokenizer),
every request a distinct user message (--user-tokens, short by default so that the engine's
prefill does not drown the rendering); one unmeasured request per system first, so the
instruction checkpoints exist and the renderer has seen the instructions (as an application's
server has). Per level: waves of `level` simultaneous streamed chats, each producing
--max-tokens tokens, --rounds waves and at least MIN_REQUESTS requests. Then --short requests one at a time of a short chat (a system sentence and
a user question, as benchmarks/serve_latency.py --workload chat).

Per request: TTFT (send to first content), and the replica's render time from its
Server-Timing header (None on a server that sends none). The server runs the code of the
checkout this file is in; with --against DIR a second server runs the code of another checkout
(its own lean_cluster.py, the same config) at the same time, and every wave and every short
request goes to both, in alternating order, so that a shared machine's drift hits both alike:
a before/after comparison in one run. The load average goes into the JSON: on a shared machine
it says how far to trust a run. Prints a table and writes JSON (--out, default
benchmarks/results/render_http.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from harness import add_out_argument, markdown_table, write_result  # noqa: E402
from lean_cluster import free_port, serve_main_server  # noqa: E402

MIN_REQUESTS = 16
SHORT_CHAT = [{"role": "system", "content": "You are a terse assistant."},
              {"role": "user", "content": "Tell me about the fox and the dog, briefly."}]


def server_config(args, port: int) -> dict:
    """A Serve config for serve_main: one lean app, rendering in the replica."""
    from deployments.config import AppConfig
    from engine.engine_config import EngineConfig

    engine = EngineConfig(max_model_len=4096, max_num_seqs=max(args.levels), max_num_batched_tokens=2048,
                          kv_cache_bytes=256 << 20)
    config = AppConfig(engine=engine, worker_num_cpus=1.0, direct_ingress=True, render_in_replica=True)
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "render-http", "route_prefix": "/",
                              "import_path": "deployments.app:build_app",
                              "args": config.model_dump(mode="json"),
                              "deployments": [{"name": "LLMServer", "num_replicas": 1}]}]}


async def one_chat(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat: TTFT (first non-empty content) and the Server-Timing render time."""
    from hybrid_serve_bench.client import server_render_s

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        render = server_render_s(response.headers.get("server-timing"))
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            usage = event.get("usage") or usage
            if ttft is None and any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                ttft = time.perf_counter() - start
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_s": ttft, "render_s": render, "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": cached}


def summary(server: str, name: str, level: int, results: list[dict]) -> dict:
    ttfts = sorted(1e3 * r["ttft_s"] for r in results if r["ttft_s"] is not None)
    renders = sorted(1e3 * r["render_s"] for r in results if r["render_s"] is not None)

    def p(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {"server": server, "workload": name, "concurrency": level, "requests": len(results),
            "no_content": sum(r["ttft_s"] is None for r in results),
            "ttft_ms_p50": statistics.median(ttfts) if ttfts else None, "ttft_ms_p90": p(ttfts, 0.9),
            "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else None,
            "render_ms_p50": statistics.median(renders) if renders else None, "render_ms_p90": p(renders, 0.9),
            "render_ms_mean": statistics.fmean(renders) if renders else None,
            "prompt_tokens_p50": statistics.median(r["prompt_tokens"] or 0 for r in results),
            "cached_tokens_p50": statistics.median(r["cached_tokens"] or 0 for r in results)}


def waves(args, level: int) -> int:
    return max(args.rounds, -(-MIN_REQUESTS // level))


async def measure(args, ports: dict[str, int], conversations: list[list[dict]]) -> list[dict]:
    """Warm each server up, then per level its waves and then the short chats, every wave (the
    same requests) and short chat sent to each server in turn, the order alternating."""
    import httpx

    limits = httpx.Limits(max_connections=2 * max(args.levels) + 4)
    clients = {name: httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits)
               for name, port in ports.items()}

    def in_turn(index: int) -> list[str]:
        return list(clients) if index % 2 == 0 else list(clients)[::-1]

    results: dict[tuple[str, str, int], list[dict]] = {}
    try:
        for client in clients.values():
            for messages in conversations[:2] + [SHORT_CHAT]:  # one per system, and the short chat
                await one_chat(client, messages, args.max_tokens)
        queue = list(conversations[2:])
        for level in args.levels:
            for index in range(waves(args, level)):
                wave = [queue.pop() for _ in range(level)]
                for name in in_turn(index):
                    results.setdefault((name, "long", level), []).extend(await asyncio.gather(
                        *(one_chat(clients[name], m, args.max_tokens) for m in wave)))
        for index in range(args.short):
            for name in in_turn(index):
                results.setdefault((name, "short", 1), []).append(
                    await one_chat(clients[name], SHORT_CHAT, args.max_tokens))
    finally:
        for client in clients.values():
            await client.aclose()
    return [summary(*key, rows) for key, rows in results.items()]


def lean_cluster_of(tree: Path):
    """The lean_cluster module of the checkout `tree` (its serve_main_server runs that code)."""
    spec = importlib.util.spec_from_file_location(f"lean_cluster_{len(str(tree))}_{tree.name}",
                                                  tree / "benchmarks" / "lean_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--instruction-tokens", type=int, default=3000,
                        help="per system (the embedded model's context is 4,096 tokens)")
    parser.add_argument("--user-tokens", default="10-40", help="user message tokens, low-high")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--short", type=int, default=30, help="short chats, one at a time")
    parser.add_argument("--against", default=None,
                        help="another checkout: a second server runs its code, interleaved with this one's")
    add_out_argument(parser, "render_http")
    args = parser.parse_args()

    from engine.engine_config import DEFAULT_MODEL_DIR
    from hybrid_serve_bench.tokens import TokenizerCounter
    from hybrid_serve_bench.workloads import Sizes, shared_instructions

    needed = 2 + sum(level * waves(args, level) for level in args.levels)
    low, high = (int(n) for n in args.user_tokens.split("-"))
    workload = shared_instructions(Sizes(instruction_tokens=args.instruction_tokens, requests=needed, systems=2,
                                         user_tokens=(low, high)),
                                   TokenizerCounter(str(DEFAULT_MODEL_DIR)))
    conversations = [[dict(m) for m in c.turns[0].new_messages] for c in workload.conversations]
    trees = {"this": ROOT, **({"against": Path(args.against).resolve()} if args.against else {})}
    ports = {name: free_port() for name in trees}
    logs = {name: Path(tempfile.mkdtemp(prefix=f"render-http-{name}-")) / "serve.log" for name in trees}
    load_start = os.getloadavg()
    with contextlib.ExitStack() as servers:
        servers.enter_context(serve_main_server(server_config(args, ports["this"]), logs["this"]))
        if args.against:
            # its own fallback proxy ports, whatever that checkout's serve_main sets
            fallback = {"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
                        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port())}
            servers.enter_context(lean_cluster_of(trees["against"]).serve_main_server(
                server_config(args, ports["against"]), logs["against"], fallback))
        rows = asyncio.run(measure(args, ports, conversations))
    load_end = os.getloadavg()

    def cell(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    print(", ".join(f"{name}: {tree}" for name, tree in trees.items()) + f"; load average {load_start[0]:.1f} "
          f"at the start, {load_end[0]:.1f} at the end ({os.cpu_count()} cores)")
    print(markdown_table(
        ["server", "workload", "concurrency", "requests", "prompt tokens", "cached", "TTFT p50 ms", "p90", "mean",
         "render p50 ms", "p90", "mean"],
        [[r["server"], r["workload"], str(r["concurrency"]), str(r["requests"]), f"{r['prompt_tokens_p50']:.0f}",
          f"{r['cached_tokens_p50']:.0f}", cell(r["ttft_ms_p50"]), cell(r["ttft_ms_p90"]), cell(r["ttft_ms_mean"]),
          cell(r["render_ms_p50"], 2), cell(r["render_ms_p90"], 2), cell(r["render_ms_mean"], 2)] for r in rows]))
    write_result(args.out, "render_http", {
        "code": {name: str(tree) for name, tree in trees.items()}, "args": vars(args), "rows": rows,
        "load_average_1min": {"start": load_start[0], "end": load_end[0]},
        "serve_log_lines": {name: [line for line in log.read_text().splitlines() if "serving path" in line]
                            for name, log in logs.items()}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
