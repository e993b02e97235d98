"""HTTP response helpers for the ingress: JSON bodies and OpenAI-style server-sent events.

Kept out of ingress.py on purpose: Serve serializes the ingress class when it is decorated, so
helpers it calls must live in an importable module.
"""

from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect
from pydantic import BaseModel

from deployments.http.errors import APIError, as_api_error
from engine.core.llm_engine import RequestOutput


async def first_output_ready(
    outputs: AsyncGenerator[RequestOutput, None],
) -> AsyncGenerator[RequestOutput, None]:
    """Wait for the first output so that engine refusals still become an HTTP error status
    (and the response headers leave together with the first token)."""
    try:
        first = await anext(outputs)
    except StopAsyncIteration:
        raise APIError(500, "the engine produced no output", "server_error") from None

    async def chained() -> AsyncGenerator[RequestOutput, None]:
        async with aclosing(outputs):
            yield first
            async for out in outputs:
                yield out

    return chained()


def server_timing(render_s: float | None) -> dict[str, str]:
    """The W3C Server-Timing header of a generation response: `render;dur=<ms>`, the time its
    prompt took to render in this server (clients split their time to first token with it:
    hybrid_serve_bench's client reads it); no header when unknown."""
    return {} if render_s is None else {"Server-Timing": f"render;dur={1000 * render_s:.3f}"}


def json_response(model: BaseModel, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), headers=headers)


def sse_response(chunks: AsyncGenerator[BaseModel, None],
                 headers: dict[str, str] | None = None) -> StreamingResponse:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`. An error after the
    headers went out is reported in-band as an OpenAI error object before [DONE]. `headers`
    go out with the first chunk, beside Cache-Control."""

    async def events() -> AsyncGenerator[str, None]:
        async with aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield f"data: {chunk.model_dump_json()}\n\n"
            except Exception as exc:
                yield f"data: {as_api_error(exc).to_response().model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return EventStreamResponse(events(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", **(headers or {})})


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that streams on the request's own task. Starlette's, under an ASGI
    server of spec 2.3 (uvicorn), runs the stream in a task group beside a task that listens
    for the client's disconnect; Ray Serve already listens (the proxy on the classic path, the
    replica's direct-ingress wrapper on the lean one) and cancels the request's task when the
    client goes, which closes the stream and with it the engine request (tests/e2e/
    test_disconnect.py). A send the server refuses (OSError) ends the stream as Starlette's
    does."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None
