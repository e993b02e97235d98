"""Runs workloads against one or more targets and returns one record per request.

Passes and interleaving: a pass is one (target, workload, rate). With several targets the
workload's conversations are split into `rounds` contiguous chunks, and each round runs its
chunk against every target, one target after the other (never two at once), in an order
rotated every round; so a slow drift of a shared machine hits every target alike. A pass's wall
time is the sum of its chunks' times. Each pass gets its own cache_salt (when salts are on), so
no pass restores what another one left, and its own ShareableTracker; without salts a server
may restore what an earlier pass of the run sent it, so each target keeps one tracker for the
whole run.

Arrivals within a chunk: with rate None, a closed loop of `concurrency` workers, each taking the
next conversation and running its turns one after the other; with a rate (conversations per
second), conversations start at Poisson arrival times (seeded) and every request waits for one
of `concurrency` slots. The arrivals restart with every chunk (and the chunk drains before the
next target's), so a rate pass is `rounds` short bursts at that rate, not one steady stream:
use few rounds and many requests per rate when the queueing itself is the question.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from hybrid_serve_bench.accounting import ShareableTracker
from hybrid_serve_bench.client import RECORD_FIELDS, ChatRequest, StreamResult, stream_chat
from hybrid_serve_bench.tokens import TokenCounter
from hybrid_serve_bench.workloads import Conversation, Workload


@dataclass(frozen=True)
class Target:
    """A server to drive: label (the table's row name), base_url (without /v1), model name, and
    fields added to every request body (cache_salt and ignore_eos are added per pass).
    chat: an in-process target's request function (engine_target.py), called instead of
    POSTing to base_url; None for a server."""

    label: str
    base_url: str
    model: str
    extra_body: dict | None = None
    chat: Callable[[ChatRequest], Awaitable[StreamResult]] | None = None

    @property
    def chat_url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/chat/completions"


@dataclass(frozen=True)
class RunSettings:
    concurrency: int = 4
    max_tokens: int = 16
    rounds: int = 4
    timeout_s: float = 600.0
    seed: int = 0
    ignore_eos: bool = True
    cache_salt: str | None = None  # the run's salt; each pass appends its workload and rate


@dataclass
class Pass:
    """One (target, workload, rate): its wall time, summed over its chunks."""

    target: str
    workload: str
    rate: float | None
    wall_s: float = 0.0


def salted(*parts: object) -> str:
    """A cache_salt made of `parts`, joined by ":", with the characters vLLM refuses in a salt
    ("@", "/", "\\", NUL) replaced by "_" (a sweep's workload is named shared-instructions@L)."""
    text = ":".join(str(p) for p in parts)
    for refused in ("@", "/", "\\", "\0"):
        text = text.replace(refused, "_")
    return text


async def server_identity(client: httpx.AsyncClient, base_url: str) -> dict:
    """GET {base_url}/v1/models: the response JSON, or {"error": ...} when it fails."""
    try:
        response = await client.get(f"{base_url.rstrip('/')}/v1/models")
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def chunks(conversations: tuple[Conversation, ...], rounds: int) -> list[tuple[Conversation, ...]]:
    """`conversations` split into at most `rounds` contiguous, nearly equal, non-empty chunks."""
    rounds = max(1, min(rounds, len(conversations)))
    bounds = [round(i * len(conversations) / rounds) for i in range(rounds + 1)]
    return [conversations[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


class _PassState:
    """What one pass carries between its chunks: tracker, salt, records."""

    def __init__(self, target: Target, workload: Workload, rate: float | None,
                 tracker: ShareableTracker, settings: RunSettings) -> None:
        self.target, self.workload, self.rate = target, workload, rate
        self.tracker = tracker
        extra = dict(target.extra_body or {})
        if settings.ignore_eos:
            extra["ignore_eos"] = True
        if settings.cache_salt:
            extra["cache_salt"] = salted(settings.cache_salt, workload.name, rate)
        self.extra_body = extra
        self.records: list[dict] = []
        self.summary = Pass(target.label, workload.name, rate)


async def _run_conversation(client: httpx.AsyncClient, state: _PassState, conversation: Conversation,
                            settings: RunSettings, slots: asyncio.Semaphore, t0: float,
                            on_request: Callable[[], None]) -> None:
    history: list[dict] = []
    for index, turn in enumerate(conversation.turns):
        messages = [*history, *turn.new_messages]
        prompt_ids = state.tracker.prompt_ids(messages)
        async with slots:
            shareable = state.tracker.shareable_tokens(prompt_ids)
            state.tracker.record_sent(prompt_ids)
            start_s = time.perf_counter() - t0
            request = ChatRequest(state.target.model, messages, settings.max_tokens,
                                  extra_body=state.extra_body)
            result = await (state.target.chat(request) if state.target.chat
                            else stream_chat(client, state.target.chat_url, request))
        state.tracker.record_reply(messages, result.reply)
        record = {"workload": state.workload.name, "target": state.target.label,
                  "conversation": conversation.key, "turn": index, "rate": state.rate,
                  "start_s": start_s, "first_chunk_s": result.first_chunk_s,
                  "ttft_s": result.ttft_s, "itl_s": result.itl_s, "e2e_s": result.e2e_s,
                  "render_s": result.render_s,
                  "prompt_tokens": result.prompt_tokens, "counted_prompt_tokens": len(prompt_ids),
                  "completion_tokens": result.completion_tokens,
                  "cached_tokens": result.cached_tokens, "shareable_tokens": shareable,
                  "finish_reason": result.finish_reason, "error": result.error}
        assert tuple(record) == RECORD_FIELDS
        state.records.append(record)
        on_request()
        if result.error is not None:
            return  # the rest of the conversation depends on this turn
        history = [*messages, *([{"role": "assistant", "content": result.reply}]
                                if turn.keep_reply else [])]


async def _run_chunk(client: httpx.AsyncClient, state: _PassState, chunk: tuple[Conversation, ...],
                     settings: RunSettings, rng: random.Random, t0: float,
                     on_request: Callable[[], None]) -> None:
    slots = asyncio.Semaphore(settings.concurrency)
    start = time.perf_counter()
    if state.rate is None:
        queue = list(reversed(chunk))

        async def worker() -> None:
            while queue:
                await _run_conversation(client, state, queue.pop(), settings, slots, t0, on_request)

        await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
    else:
        tasks = []
        for i, conversation in enumerate(chunk):
            if i:
                await asyncio.sleep(rng.expovariate(state.rate))  # Poisson: exponential gaps
            tasks.append(asyncio.create_task(
                _run_conversation(client, state, conversation, settings, slots, t0, on_request)))
        await asyncio.gather(*tasks)
    state.summary.wall_s += time.perf_counter() - start


async def run_workloads(targets: list[Target], workloads: list[Workload], rates: list[float | None],
                        settings: RunSettings, counter: TokenCounter,
                        on_request: Callable[[], None] = lambda: None) -> tuple[list[dict], list[Pass]]:
    """Every workload at every rate against every target, interleaved by rounds (module doc).
    Returns the records (RECORD_FIELDS, in completion order per pass) and the passes.
    on_request is called after every request (the progress bar)."""
    records: list[dict] = []
    passes: list[Pass] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=settings.concurrency * 2 + 4)
    run_trackers = {t.label: ShareableTracker(counter) for t in targets}  # without cache salts

    def tracker(target: Target) -> ShareableTracker:
        return run_trackers[target.label] if settings.cache_salt is None else ShareableTracker(counter)

    async with httpx.AsyncClient(timeout=settings.timeout_s, limits=limits) as client:
        for workload in workloads:
            for rate in rates:
                states = [_PassState(t, workload, rate, tracker(t), settings) for t in targets]
                for r, chunk in enumerate(chunks(workload.conversations, settings.rounds)):
                    order = states[r % len(states):] + states[:r % len(states)]
                    for state in order:
                        rng = random.Random(f"{settings.seed}/{workload.name}/{rate}/{r}")
                        await _run_chunk(client, state, chunk, settings, rng, t0, on_request)
                for state in states:
                    records += state.records
                    passes.append(state.summary)
    return records, passes
