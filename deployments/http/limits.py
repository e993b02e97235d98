"""Request limits at the HTTP edge, before a request costs anything.

check_stop_limits: the stop conditions of one request (the ingress checks them first, for HTTP
and handle calls alike); check_cache_markers: a chat request's cache_control markers. Its prompt length and max_tokens are checked against max_prompt_tokens
and max_output_tokens by engine.interfaces.sampling_params.output_budget, with the context.

RequestLimitsMiddleware (ASGI, in front of the ingress's routes; its limits are
scope["app"].state.request_limits, set by the ingress replica):
  - a body larger than max_body_bytes gets 413 (from Content-Length when the client sends it,
    else while the body is read), with an OpenAI error body;
  - a generation request (POST .../completions) beyond max_requests_in_flight, the requests
    this ingress replica has accepted and not yet answered to the end, gets 429 with
    Retry-After at once, instead of waiting in a queue with no bound.
The ingress deployment's own Serve limit (max_ongoing_requests) is set above
max_requests_in_flight (deployments/app.py), so excess requests reach this middleware and are
answered, rather than waiting in Serve's proxy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from starlette.exceptions import HTTPException

from deployments.http.errors import APIError, send_error
from deployments.http.protocol import ChatCompletionRequest, SamplingFields

MAX_CACHE_BREAKPOINTS = 4  # cache_control markers a chat request may carry (AppConfig's default)


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int
    max_requests_in_flight: int
    retry_after_s: float
    max_stop_strings: int  # stop strings, and stop token ids, a request may give
    max_stop_string_chars: int
    max_prompt_tokens: int | None  # None: as many as the context leaves room for
    max_output_tokens: int
    max_cache_breakpoints: int = MAX_CACHE_BREAKPOINTS  # cache_control markers a chat request may carry


def check_stop_limits(fields: SamplingFields, limits: RequestLimits) -> None:
    """Raise APIError 400 (param "stop" or "stop_token_ids") for more stop strings or stop token
    ids than limits.max_stop_strings, or a stop string longer than max_stop_string_chars: every
    stop string is matched against every step's new text."""
    stops = fields.stop_strings()
    if len(stops) > limits.max_stop_strings:
        raise APIError.bad_request(
            f"at most {limits.max_stop_strings} stop strings are accepted, got {len(stops)}", "stop")
    if any(len(stop) > limits.max_stop_string_chars for stop in stops):
        raise APIError.bad_request(
            f"stop strings may have at most {limits.max_stop_string_chars} characters", "stop")
    if len(fields.stop_token_ids or ()) > limits.max_stop_strings:
        raise APIError.bad_request(
            f"at most {limits.max_stop_strings} stop token ids are accepted", "stop_token_ids")


def check_cache_markers(request: ChatCompletionRequest, limits: RequestLimits) -> None:
    """Raise APIError 400 (param "messages") for more cache_control markers than
    limits.max_cache_breakpoints: each is one more rendering of the conversation's head and, when
    breakpoint checkpoints are on, one more checkpoint and prefill chunk edge. Counted whether
    or not the engine captures breakpoints: the same request is valid or not on every replica."""
    markers = request.num_cache_markers()
    if markers > limits.max_cache_breakpoints:
        raise APIError.bad_request(
            f"at most {limits.max_cache_breakpoints} cache_control breakpoints are accepted per "
            f"request, got {markers}", "messages")


class BodyTooLarge(HTTPException):
    """Raised while the body is read; FastAPI passes HTTPExceptions through its body parsing
    to the app's handler, which answers with an OpenAI error body."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body exceeds {limit} bytes (max_body_bytes).")


class RequestLimitsMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self.in_flight = 0  # generation requests of this replica not yet answered to the end

    async def __call__(self, scope, receive, send) -> None:
        limits: RequestLimits | None = getattr(scope["app"].state, "request_limits", None)
        if scope["type"] != "http" or limits is None:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            await send_error(scope, receive, send, _too_large(limits))
            return
        generation = scope["method"] == "POST" and scope["path"].endswith("completions")
        if generation and self.in_flight >= limits.max_requests_in_flight:
            error = APIError(429, f"The server is at its limit of {limits.max_requests_in_flight} "
                             "requests in flight; retry after the Retry-After delay.",
                             "rate_limit_error", None, "rate_limit_exceeded")
            await send_error(scope, receive, send, error,
                             {"Retry-After": str(max(1, math.ceil(limits.retry_after_s)))})
            return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limits.max_body_bytes:
                    raise BodyTooLarge(limits.max_body_bytes)
            return message

        self.in_flight += generation
        try:
            await self.app(scope, counted_receive, send)
        finally:
            self.in_flight -= generation


def _too_large(limits: RequestLimits) -> APIError:
    return APIError(413, BodyTooLarge(limits.max_body_bytes).detail, "invalid_request_error")

