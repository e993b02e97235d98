"""Request limits at the HTTP edge (deployments/http/limits.py), in front of a small FastAPI
app with the ingress's error handlers: 413 for large bodies, declared or streamed, 429 with
Retry-After beyond the requests in flight, and nothing held after requests end."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
from fastapi import FastAPI

from deployments.http.errors import install_error_handlers
from deployments.http.limits import RequestLimits, RequestLimitsMiddleware

LIMITS = RequestLimits(max_body_bytes=1000, max_requests_in_flight=1, retry_after_s=2.5,
                       max_stop_strings=16, max_stop_string_chars=256, max_prompt_tokens=None,
                       max_output_tokens=4096)


def make_app(release: asyncio.Event, entered: asyncio.Event | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestLimitsMiddleware)
    app.state.request_limits = LIMITS

    @app.post("/v1/completions")
    async def completions(body: dict):
        if entered is not None:
            entered.set()
        await release.wait()
        return {"size": len(str(body))}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def run(scenario) -> None:
    async def main():
        release, entered = asyncio.Event(), asyncio.Event()
        transport = httpx.ASGITransport(app=make_app(release, entered))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await scenario(client, release, entered)

    asyncio.run(main())


def test_bodies_over_the_limit_get_413_declared_or_streamed():
    async def scenario(client, release, entered):
        release.set()
        declared = await client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert declared.status_code == 413
        assert "max_body_bytes" in declared.json()["error"]["message"]

        async def chunks():  # no Content-Length: counted while FastAPI reads it
            for _ in range(4):
                yield b" " * 400
            yield b"{}"

        streamed = await client.post("/v1/completions", content=chunks(),
                                     headers={"content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200

    run(scenario)


def test_requests_beyond_the_limit_in_flight_get_429_with_retry_after():
    async def scenario(client, release, entered):
        first = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a"}))
        await asyncio.wait_for(entered.wait(), 10)  # the first is in flight, held by the endpoint
        refused = await client.post("/v1/completions", json={"prompt": "b"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert (await client.get("/health")).status_code == 200  # not a generation route
        release.set()
        assert (await first).status_code == 200
        again = await client.post("/v1/completions", json={"prompt": "c"})
        assert again.status_code == 200  # the slot was given back

    run(scenario)


def test_stop_limits_accept_up_to_the_limit_and_refuse_beyond():
    import pytest

    from deployments.http.errors import APIError
    from deployments.http.limits import check_stop_limits
    from deployments.http.protocol import CompletionRequest

    limits = dataclasses.replace(LIMITS, max_stop_strings=3, max_stop_string_chars=5)

    def request(**fields):
        return CompletionRequest(prompt="x", **fields)

    check_stop_limits(request(stop=["a", "b", "12345"], stop_token_ids=[1, 2, 3]), limits)
    check_stop_limits(request(stop="12345"), limits)
    for fields, param in (({"stop": ["a", "b", "c", "d"]}, "stop"), ({"stop": "123456"}, "stop"),
                          ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids")):
        with pytest.raises(APIError) as refused:
            check_stop_limits(request(**fields), limits)
        assert refused.value.status_code == 400 and refused.value.param == param


def test_a_full_queue_is_a_503_with_retry_after():
    """Serve raises BackPressureError to the ingress when a deployment's max_queued_requests is
    reached (through Ray, wrapped); the client gets 503 with Retry-After and an OpenAI body."""
    import json

    from ray.serve.exceptions import BackPressureError

    from deployments.http.errors import as_api_error, error_json

    error = as_api_error(BackPressureError(num_queued_requests=9, max_queued_requests=8))
    response = error_json(error)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    body = json.loads(response.body)
    assert body["error"]["code"] == "overloaded" and "queue" in body["error"]["message"]
