"""GET /health of the replica's app (deployments/frontend.py openai_app): 200 with whether the
replica is still warming up (its compiled CPU decode step compiling beside serving), 503 with
an OpenAI-style error body when the replica's health check raises. No Ray: the probes are
plain coroutines here, as the replica's own methods are on the lean path."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deployments.frontend import openai_app
from deployments.http.api_keys import ApiKeys
from deployments.http.limits import RequestLimits

LIMITS = RequestLimits(max_body_bytes=1 << 20, max_requests_in_flight=4, retry_after_s=1.0,
                       max_stop_strings=16, max_stop_string_chars=256, max_prompt_tokens=None,
                       max_output_tokens=4096)


def _get_health(healthy: bool, warming: bool) -> httpx.Response:
    async def check_health() -> None:
        if not healthy:
            raise RuntimeError("the engine step loop or its executor is not running")

    async def warming_up() -> bool:
        return warming

    # /health touches neither the frontend nor the engine: no frontend is needed to serve it
    app = openai_app(None, check_health, warming_up, ApiKeys.load(None), LIMITS)

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
            return await client.get("/health")
    return asyncio.run(get())


@pytest.mark.parametrize("warming", [True, False])
def test_a_healthy_replica_says_whether_it_is_warming_up(warming):
    answer = _get_health(healthy=True, warming=warming)
    assert answer.status_code == 200
    assert answer.json() == {"status": "ok", "warming_up": warming}


def test_an_unhealthy_replica_answers_503_with_an_error_body():
    answer = _get_health(healthy=False, warming=True)
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
