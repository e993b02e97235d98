"""Soak: mixed traffic against the whole application for a long time, and what it left behind.

    python benchmarks/soak.py                    # 30 minutes (the documented run)
    python benchmarks/soak.py --duration-s 180   # the CI version (tests/soak/test_soak.py)

Starts Ray and the app on the embedded model (all three checkpoint slots), then keeps
--concurrency clients busy until --duration-s has passed, each request one of:
  - chat with one of four shared system prompts and a fresh user message (instruction reuse),
  - the next turn of a conversation, resending its history (multi-turn reuse),
  - a completion of random text,
  - a stream the client abandons after its first chunk (a disconnect: aborted in the engine),
  - a request the server must refuse with 400 (a temperature out of range).
Streamed and whole answers alternate. Every --window-s it records the requests served, their
p99 latency and each app process's resident memory.

Prints a table and writes results/soak.json: requests by kind and status, errors by kind, the
p99 latency of the first and last windows (the drift), each process's memory at start and
end. Exits 1 (the run failed) on any 5xx, any answer other than the one expected of its kind,
any transport error, pools not idle at the end, or memory that grows without bound: a process
whose mean resident memory over the last third of the windows exceeds that over the first
third (after the first window, which warms up) by more than MEMORY_GROWTH_BYTES and
MEMORY_GROWTH_FRACTION.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
from harness import add_out_argument, markdown_table, process_rss_bytes, write_result

APP_NAME = "hybrid-serve-soak"
MODEL_NAME = "hybrid-serve-tiny"
MEMORY_GROWTH_BYTES = 64 * 1024 * 1024
MEMORY_GROWTH_FRACTION = 0.10
SYSTEMS = [f"You are assistant {i} of a railway help desk. Answer in one sentence, politely, "
           f"and mention platform {i + 3} only if asked." for i in range(4)]
WORDS = ("train ticket platform delay coast mountain bicycle night sleeper café window luggage "
         "station timetable conductor").split()
KINDS = ("instruction", "multi_turn", "completion", "disconnect", "bad_request")
EXPECTED_STATUS = {"bad_request": 400}  # every other kind: 200


@dataclass
class Sample:
    """One request: its kind, HTTP status (0 for a transport error), seconds, window."""

    kind: str
    status: int
    seconds: float
    window: int
    error: str | None = None


@dataclass
class Window:
    index: int
    requests: int
    p99_s: float | None
    rss_bytes: dict[str, int] = field(default_factory=dict)


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


async def one_request(http: httpx.AsyncClient, kind: str, rng: random.Random,
                      conversations: list[list[dict]]) -> tuple[int, str | None]:
    """Send one request of `kind`; return (HTTP status, error text or None). A chat that
    succeeds becomes a conversation a later multi_turn request continues."""
    common = {"model": MODEL_NAME, "max_tokens": rng.randint(2, 16), "temperature": 0,
              "stream": kind == "disconnect" or rng.random() < 0.5}
    conversation: list[dict] | None = None
    if kind == "completion":
        path, body = "/v1/completions", {**common, "prompt": words(rng, 5, 80)}
    elif kind == "bad_request":
        path, body = "/v1/chat/completions", {**common, "temperature": 7.5,
                                              "messages": [{"role": "user", "content": "hi"}]}
    else:
        if kind == "multi_turn" and conversations:
            conversation = rng.choice(conversations)
        else:
            conversation = [{"role": "system", "content": rng.choice(SYSTEMS)}]
        question = {"role": "user", "content": words(rng, 3, 30)}
        path, body = "/v1/chat/completions", {**common, "messages": [*conversation, question]}
    if not body["stream"]:
        response = await http.post(path, json=body)
        if response.status_code != 200:
            return response.status_code, response.text
        reply = response.json()["choices"][0].get("message", {}).get("content", "")
    else:
        reply = ""
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return response.status_code, (await response.aread()).decode()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if kind == "disconnect":
                    return 200, None  # gone after the first chunk: the server must abort it
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return 500, line
                for choice in event.get("choices") or ():
                    reply += (choice.get("delta") or {}).get("content") or ""
    if conversation is not None and len(conversation) < 9:
        grown = [*body["messages"], {"role": "assistant", "content": reply}]
        conversations.append(grown) if len(conversations) < 64 else None
    return 200, None


async def drive(base_url: str, duration_s: float, concurrency: int, window_s: float,
                seed: int) -> tuple[list[Sample], list[Window]]:
    start = time.monotonic()
    samples: list[Sample] = []
    windows: list[Window] = []
    conversations: list[list[dict]] = []

    def window_now() -> int:
        return int((time.monotonic() - start) // window_s)

    async def client(index: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() - start < duration_s:
            kind = rng.choices(KINDS, weights=(40, 25, 20, 10, 5))[0]
            began = time.monotonic()
            try:
                status, error = await one_request(http, kind, rng, conversations)
            except httpx.HTTPError as exc:
                status, error = 0, f"{type(exc).__name__}: {exc}"
            samples.append(Sample(kind, status, time.monotonic() - began, window_now(), error))

    async def sample_windows() -> None:
        while time.monotonic() - start < duration_s + window_s:
            index = window_now()
            await asyncio.sleep(max(0.0, (index + 1) * window_s - (time.monotonic() - start)))
            served = [s for s in samples if s.window == index]
            latencies = sorted(s.seconds for s in served if s.kind != "disconnect")
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None
            windows.append(Window(index, len(served), p99, app_rss()))

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        sampler = asyncio.create_task(sample_windows())
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
        await sampler
    return samples, windows


def app_rss() -> dict[str, int]:
    prefix = f"ray::ServeReplica:{APP_NAME}:"
    return {role.removeprefix(prefix): rss for role, rss in process_rss_bytes().items()
            if role.startswith(prefix)}


def memory_growth(windows: list[Window]) -> dict[str, dict[str, float]]:
    """Per process: mean resident MiB over the first and last thirds of the windows (the first
    window left out) and whether the growth between them is beyond both bounds."""
    measured = [w for w in windows[1:] if w.rss_bytes]
    third = max(1, len(measured) // 3)
    growth = {}
    for role in measured[0].rss_bytes if measured else ():
        early = sum(w.rss_bytes.get(role, 0) for w in measured[:third]) / third
        late = sum(w.rss_bytes.get(role, 0) for w in measured[-third:]) / third
        unbounded = late - early > max(MEMORY_GROWTH_BYTES, MEMORY_GROWTH_FRACTION * early)
        growth[role] = {"early_mib": early / 2**20, "late_mib": late / 2**20, "unbounded": unbounded}
    return growth


def verdict(samples: list[Sample], growth: dict, idle: bool) -> list[str]:
    """The reasons the soak failed (none: it passed)."""
    problems = []
    wrong = Counter((s.kind, s.status) for s in samples if s.status != EXPECTED_STATUS.get(s.kind, 200))
    for (kind, status), count in sorted(wrong.items()):
        problems.append(f"{count} {kind} request(s) answered {status or 'no HTTP answer'}")
    problems += [f"{role} memory grows: {g['early_mib']:.0f} -> {g['late_mib']:.0f} MiB"
                 for role, g in growth.items() if g["unbounded"]]
    if not idle:
        problems.append("the pools were not idle at the end")
    return problems


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--window-s", type=float, default=None,
                   help="sampling window (default: duration / 12, at most 60 s)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8231)
    p.add_argument("--ray-cpus", type=int, default=4)
    add_out_argument(p, "soak")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    window_s = args.window_s or min(60.0, args.duration_s / 12)
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.config import AppConfig
    from engine.engine_config import EngineConfig

    config = AppConfig(
        served_model_name=MODEL_NAME, worker_num_cpus=1.0,
        engine=EngineConfig(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256,
                            kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20,
                            checkpoint_cache_bytes=8 << 20))  # small: eviction is exercised
    ray.init(address="local", num_cpus=args.ray_cpus, object_store_memory=256 * 1024 * 1024,
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        handle = serve.run(build_app(config.model_dump()), name=APP_NAME, route_prefix="/")
        start_rss = app_rss()
        samples, windows = asyncio.run(drive(f"http://127.0.0.1:{args.port}", args.duration_s,
                                             args.concurrency, window_s, args.seed))
        deadline = time.monotonic() + 30
        while True:
            usage = handle.pool_usage.remote().result()
            if (usage.idle and usage.num_requests == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        end_rss = app_rss()
        stats = handle.engine_stats.remote().result()
    finally:
        serve.shutdown()
        ray.shutdown()

    growth = memory_growth(windows)
    problems = verdict(samples, growth, usage.idle and usage.num_requests == 0)
    by_kind = Counter(f"{s.kind} {s.status}" for s in samples)
    timed = [w for w in windows if w.p99_s is not None]
    first_p99, last_p99 = (timed[0].p99_s, timed[-1].p99_s) if timed else (None, None)
    rows = [[kind, str(count)] for kind, count in sorted(by_kind.items())]
    print(markdown_table(["kind and status", "requests"], rows))
    print()
    print(markdown_table(
        ["process", "start MiB", "end MiB", "first third MiB", "last third MiB"],
        [[role, f"{start_rss.get(role, 0) / 2**20:.0f}", f"{end_rss.get(role, 0) / 2**20:.0f}",
          f"{g['early_mib']:.0f}", f"{g['late_mib']:.0f}"] for role, g in sorted(growth.items())]))
    print(f"\n{len(samples)} requests in {args.duration_s:.0f} s; p99 latency first window "
          f"{first_p99}, last window {last_p99}; preemptions {stats.scheduler.preemptions}, "
          f"checkpoints evicted {sum(c.evicted for c in stats.checkpoints.values())}")
    print("PASSED" if not problems else "FAILED:\n  " + "\n  ".join(problems))
    out = write_result(args.out, "soak", {
        "args": {**vars(args), "window_s": window_s},
        "requests": len(samples),
        "by_kind_and_status": dict(by_kind),
        "errors": [asdict(s) for s in samples if s.status != EXPECTED_STATUS.get(s.kind, 200)][:50],
        "p99_latency_s": {"first_window": first_p99, "last_window": last_p99,
                          "drift_ratio": (last_p99 / first_p99) if first_p99 and last_p99 else None},
        "windows": [asdict(w) for w in windows],
        "rss_mib": {"start": {r: b / 2**20 for r, b in start_rss.items()},
                    "end": {r: b / 2**20 for r, b in end_rss.items()}},
        "memory_growth": growth,
        "engine": {"preemptions": stats.scheduler.preemptions,
                   "checkpoints": {k: asdict(c) for k, c in stats.checkpoints.items()}},
        "problems": problems,
    })
    print(f"wrote {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
