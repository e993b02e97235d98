"""Load: many concurrent streaming requests of mixed lengths, some sharing instructions.

- The session's app takes 256 at once (its limits are above that): every one completes, and
  afterwards the block pool, state slots and checkpoint pins are back to idle and no process of
  the app has grown (resident memory after a second identical load against after the first).
- An app with small limits (24 requests in flight per ingress, 4 ongoing + 4 queued per
  renderer and LLM server replica) takes 96 at once: each completes, or is refused at once with
  429 (the ingress's limit) or 503 (a full queue), both with Retry-After and an OpenAI error
  body; nothing hangs, and afterwards the pools are idle and a request succeeds.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from ray import serve

from tests.e2e.conftest import APP_NAME, BASE_URL, MODEL_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from harness import process_rss_bytes  # noqa: E402  (benchmarks/ is a folder of scripts)

SYSTEMS = [f"You are assistant {i} of the city library. Answer in one short sentence and "
           f"never mention shelf {i * 7}." for i in range(4)]
WORDS = "river mountain ticket station harbour lantern garden window bicycle ferry".split()
GROWTH_ALLOWED_BYTES = 64 * 1024 * 1024
OVERLOAD_APP, OVERLOAD_PREFIX = "hybrid-serve-e2e-overload", "/overload"


@dataclass
class Outcome:
    status: int
    finish_reason: str | None = None
    error: dict | None = None
    retry_after: str | None = None
    events: int = 0


def mixed_requests(count: int, seed: int) -> list[dict]:
    """Chat and completion bodies: 5 to 150 words, max_tokens 1 to 24, three in four chats
    with one of four shared system prompts."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 150)))
        common = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 24), "temperature": 0,
                  "stream": True, "ignore_eos": rng.random() < 0.5}
        if i % 4:
            messages = [{"role": "system", "content": rng.choice(SYSTEMS)},
                        {"role": "user", "content": text}]
            bodies.append(("/v1/chat/completions", {**common, "messages": messages}))
        else:
            bodies.append(("/v1/completions", {**common, "prompt": text}))
    return bodies


async def stream_one(http: httpx.AsyncClient, path: str, body: dict) -> Outcome:
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            payload = json.loads(await response.aread())
            return Outcome(response.status_code, error=payload.get("error"),
                           retry_after=response.headers.get("retry-after"))
        outcome = Outcome(200)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            outcome.events += 1
            if "error" in event:
                outcome.error = event["error"]
            for choice in event.get("choices") or ():
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        return outcome


def send_all(prefix: str, bodies: list[tuple[str, dict]]) -> list[Outcome]:
    async def main():
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        async with httpx.AsyncClient(base_url=BASE_URL + prefix, timeout=300, limits=limits) as http:
            return await asyncio.gather(*(stream_one(http, path, body) for path, body in bodies))

    return asyncio.run(main())


def app_rss(app_name: str) -> dict[str, int]:
    """Resident bytes of the app's replica processes, by deployment."""
    prefix = f"ray::ServeReplica:{app_name}:"
    return {role.removeprefix(prefix): rss for role, rss in process_rss_bytes().items()
            if role.startswith(prefix)}


def assert_clean(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        if outcome.status == 200:
            assert outcome.error is None and outcome.finish_reason in ("stop", "length"), outcome
        else:
            assert outcome.status in (429, 503), outcome
            assert outcome.retry_after is not None and int(outcome.retry_after) >= 1, outcome
            assert isinstance(outcome.error["message"], str) and outcome.error["type"], outcome


@pytest.mark.timeout(600)
def test_256_concurrent_streams_complete_and_leave_nothing_held(serve_app, wait_until_idle):
    bodies = mixed_requests(256, seed=1)
    first = send_all("", bodies)
    assert_clean(first)
    assert [o.status for o in first] == [200] * 256
    wait_until_idle()
    after_first = app_rss(APP_NAME)
    assert set(after_first) >= {"OpenAIIngress", "Renderer", "LLMServer"}

    second = send_all("", bodies)
    assert [o.status for o in second] == [200] * 256
    usage = wait_until_idle()
    assert usage.num_requests == 0 and usage.checkpoint_pins == 0
    after_second = app_rss(APP_NAME)
    for role, rss in after_second.items():
        assert rss <= after_first[role] + GROWTH_ALLOWED_BYTES, (
            f"{role} grew from {after_first[role] >> 20} MiB to {rss >> 20} MiB")
    print(f"resident MiB after the first / second load: "
          f"{ {r: after_first[r] >> 20 for r in after_first} } / "
          f"{ {r: after_second[r] >> 20 for r in after_second} }")


@pytest.mark.timeout(600)
def test_beyond_the_limits_requests_get_429_or_503_at_once(deploy_variant):
    deploy_variant(OVERLOAD_APP, OVERLOAD_PREFIX, worker_num_cpus=0.2, max_requests_in_flight=24,
                   max_ongoing_requests=4, max_queued_requests=4)
    outcomes = send_all(OVERLOAD_PREFIX, mixed_requests(96, seed=2))
    assert_clean(outcomes)
    statuses = {o.status for o in outcomes}
    assert statuses == {200, 429, 503}, [o.status for o in outcomes]
    server = serve.get_deployment_handle("LLMServer", app_name=OVERLOAD_APP)
    for _ in range(200):
        usage = server.pool_usage.remote().result()
        if usage.num_requests == 0 and usage.idle:
            break
        time.sleep(0.1)
    assert usage.num_requests == 0 and usage.idle, usage
    after = send_all(OVERLOAD_PREFIX, mixed_requests(1, seed=3))
    assert [o.status for o in after] == [200]
